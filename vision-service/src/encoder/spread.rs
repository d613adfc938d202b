//! One image across the whole pool. A compute thread runs an image on its own core (one-thread
//! rayon pool); when an image is alone — nothing else queued, nothing else running — it runs
//! instead on a rayon pool with one thread pinned to each core of the pool, so a lone request
//! does not leave the other cores idle. The CPU kernels split each product, attention and
//! elementwise pass over whatever pool they run on, so the result is the same either way.
//!
//! The [`Gate`] keeps the two modes apart: a spread run starts only when no single-core run is
//! in progress and waits for none; a single-core run that comes up during a spread run waits
//! for it to end (at most one image's time, run at the pool's full width) instead of sharing a
//! core with it.
use std::sync::{Condvar, Mutex};

/// How one image runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// On the compute thread's own core.
    Own,
    /// On every core of the pool.
    Spread,
}

#[derive(Debug, Default)]
struct State {
    own: usize,
    spread: bool,
}

/// Who runs now: any number of single-core runs, or one spread run.
#[derive(Debug, Default)]
pub struct Gate {
    state: Mutex<State>,
    changed: Condvar,
}

impl Gate {
    /// Waits for a spread run to end, then enters: spread when `alone` (no image queued
    /// behind this one) and no single-core run is in progress, else on the thread's own core.
    pub fn enter(&self, alone: impl Fn() -> bool) -> Mode {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        while s.spread {
            s = self.changed.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        if s.own == 0 && alone() {
            s.spread = true;
            Mode::Spread
        } else {
            s.own += 1;
            Mode::Own
        }
    }

    /// Leaves after a run entered as `mode`.
    pub fn leave(&self, mode: Mode) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        match mode {
            Mode::Spread => s.spread = false,
            Mode::Own => s.own = s.own.saturating_sub(1),
        }
        drop(s);
        self.changed.notify_all();
    }
}

/// The pool-wide rayon pool and its gate.
pub struct Spread {
    pub pool: rayon::ThreadPool,
    pub gate: Gate,
}

impl Spread {
    /// A pool of one thread per core in `cores`, each pinned to its core.
    pub fn new(cores: Vec<usize>) -> Result<Spread, rayon::ThreadPoolBuildError> {
        let pins = cores.clone();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(cores.len())
            .thread_name(|i| format!("vision-spread-{i}"))
            .start_handler(move |i| {
                if !vlm_service_kit::affinity::pin_current_thread(&[pins[i]]) {
                    tracing::warn!(core = pins[i], "could not pin a spread thread to its core");
                }
            })
            .build()?;
        Ok(Spread {
            pool,
            gate: Gate::default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn a_lone_image_spreads_and_a_busy_pool_runs_on_own_cores() {
        let g = Gate::default();
        assert_eq!(g.enter(|| true), Mode::Spread);
        g.leave(Mode::Spread);
        // Something queued behind it: its own core.
        assert_eq!(g.enter(|| false), Mode::Own);
        // Another single-core run in progress: own core too, even if nothing is queued.
        assert_eq!(g.enter(|| true), Mode::Own);
        g.leave(Mode::Own);
        g.leave(Mode::Own);
        assert_eq!(g.enter(|| true), Mode::Spread);
        g.leave(Mode::Spread);
    }

    #[test]
    fn a_run_that_comes_up_during_a_spread_run_waits_for_it() {
        let g = Arc::new(Gate::default());
        assert_eq!(g.enter(|| true), Mode::Spread);
        let entered = Arc::new(AtomicBool::new(false));
        let t = {
            let (g, entered) = (Arc::clone(&g), Arc::clone(&entered));
            std::thread::spawn(move || {
                let m = g.enter(|| false);
                entered.store(true, Ordering::SeqCst);
                m
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            !entered.load(Ordering::SeqCst),
            "entered during a spread run"
        );
        g.leave(Mode::Spread);
        assert_eq!(t.join().unwrap(), Mode::Own);
        assert!(entered.load(Ordering::SeqCst));
    }
}
