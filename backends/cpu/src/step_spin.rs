//! Keeps the rayon pool's other threads awake and looking for work while one forward step runs.
//!
//! A step is a few hundred short parallel products separated by short serial parts (norms,
//! rope, residuals). Between two of them rayon's idle workers yield a few times, then sleep;
//! the next product then waits for the kernel to wake them, and on a VM an idle vCPU has
//! halted (`pv_native_safe_halt`) and needs an interrupt through the hypervisor. In a batch-8
//! decode step that was ~8% idle and ~5% scheduler time (`perf record -a`, 2026-12-04). OpenMP
//! runtimes spin at their barriers for the same reason (Intel's `KMP_BLOCKTIME`, 200 ms);
//! here the spinning ends with the step, and an idle spinner calls `sched_yield` rather than
//! `pause`, so that the vision service's threads on a shared core run first.
//! `vlm up` on the 2B checkpoint, two cores, servers alternated (2026-12-04): text TTFT
//! 0.90 -> 0.84 s, 8 concurrent image requests 39.6 -> 41.0 tok/s (pure `pause` spinning:
//! 0.82 s but 37.4 tok/s, the spinner taking the core from the concurrent ViT).
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a spinner waits without work before it hands its thread back to rayon (and
/// queues its successor). Rayon may run a spinner inside a thread's wait for a stolen job's
/// other half (a join); a spinner that never returned would then hold that join, and with it
/// the step, until the step ended: a deadlock. Returning this often bounds the delay instead.
const IDLE_SPIN: Duration = Duration::from_micros(50);

/// Runs `f` while every other thread of the current rayon pool (the global one off a pool)
/// spins, taking any work the step's products post. The spinning stops when `f` returns or
/// unwinds.
pub fn during<R>(f: impl FnOnce() -> R) -> R {
    if rayon::current_num_threads() < 2 {
        return f();
    }
    let stop = Arc::new(AtomicBool::new(false));
    let me = rayon::current_thread_index();
    {
        let stop = stop.clone();
        rayon::spawn_broadcast(move |ctx| {
            if Some(ctx.index()) != me {
                spin(stop.clone(), me);
            }
        });
    }
    /// Sets the flag however `f` ends.
    struct Stop(Arc<AtomicBool>);
    impl Drop for Stop {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Release);
        }
    }
    let _stop = Stop(stop);
    f()
}

/// One spinner: runs the pool's work until `stop`, or until it found none for [`IDLE_SPIN`];
/// then, unless stopped, it queues the next spinner on this thread's own deque (the thread
/// takes it first) and returns.
fn spin(stop: Arc<AtomicBool>, me: Option<usize>) {
    // A thread that took a spinner from another's deque and runs `f` returns at once (the
    // spinner's own thread then waits for work as rayon's threads do).
    if rayon::current_thread_index() == me {
        return;
    }
    let mut last_work = Instant::now();
    while !stop.load(Ordering::Acquire) {
        if rayon::yield_now() == Some(rayon::Yield::Executed) {
            last_work = Instant::now();
        } else if last_work.elapsed() > IDLE_SPIN {
            rayon::spawn(move || spin(stop, me));
            return;
        } else {
            // Not `spin_loop`: a thread of another process on this core (the vision service
            // when the parts share cores) runs first, and this one stays awake.
            std::thread::yield_now();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;

    fn work() -> u64 {
        (0..100_000u64).into_par_iter().map(|x| x * 2).sum()
    }

    /// Nested joins of uneven length, so that a thread often waits in a join for a stolen half
    /// when the next step's spinner arrives (a spinner that never returned deadlocked the LM
    /// this way).
    fn nested() -> u64 {
        (0..64u64)
            .into_par_iter()
            .map(|i| {
                (0..(i % 7 + 1) * 300)
                    .into_par_iter()
                    .map(|x| (x ^ i).wrapping_mul(31) % 1009)
                    .sum::<u64>()
            })
            .sum()
    }

    #[test]
    fn steps_finish_inside_and_outside_a_pool() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        for _ in 0..3 {
            assert_eq!(pool.install(|| during(|| during(work))), work());
        }
        for _ in 0..3 {
            assert_eq!(during(work), work());
        }
    }

    #[test]
    fn back_to_back_steps_with_nested_joins_do_not_deadlock() {
        let want = nested();
        for threads in [2, 3] {
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let sums: Vec<u64> = pool.install(|| (0..3000).map(|_| during(nested)).collect());
                tx.send(sums).unwrap();
            });
            let sums = rx
                .recv_timeout(Duration::from_secs(120))
                .expect("3000 steps on a spinning pool did not finish in 120 s");
            assert!(sums.iter().all(|&s| s == want));
        }
    }
}
