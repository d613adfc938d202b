//! Admission: at most `max_in_flight` requests run, at most `max_queue` wait, and the KV tokens
//! (prompt + max_tokens) of running requests stay under a budget. A request that fits nowhere
//! is refused at once with the reason ([`GatewayError::Overloaded`]); a queued request that the
//! caller abandons leaves the queue.
//!
//! The state is small and every operation is O(queue); it sits behind a mutex, and a
//! [`Permit`] gives its share back when dropped.
use crate::error::{GatewayError, OverloadReason};
use crate::metrics as m;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use tokio::sync::oneshot;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionLimits {
    pub max_in_flight: usize,
    pub max_queue: usize,
    /// 0 = no KV budget.
    pub max_kv_tokens: u64,
}

#[derive(Debug)]
struct Waiter {
    id: u64,
    kv_tokens: u64,
    tx: oneshot::Sender<Permit>,
}

#[derive(Debug, Default)]
struct State {
    in_flight: usize,
    kv_tokens: u64,
    queue: VecDeque<Waiter>,
    next_id: u64,
    draining: bool,
}

#[derive(Debug)]
struct Shared {
    limits: AdmissionLimits,
    state: Mutex<State>,
}

/// Cheap to clone.
#[derive(Debug, Clone)]
pub struct Admission {
    shared: Arc<Shared>,
}

/// A running request's share; dropping it frees the share and admits waiters that now fit.
#[derive(Debug)]
pub struct Permit {
    /// `None` once disarmed (its share was given back by hand).
    shared: Option<Arc<Shared>>,
    kv_tokens: u64,
}

impl Drop for Permit {
    fn drop(&mut self) {
        if let Some(shared) = self.shared.take() {
            let mut st = shared.lock();
            st.in_flight -= 1;
            st.kv_tokens -= self.kv_tokens;
            shared.admit_waiters(&mut st);
        }
    }
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn fits(&self, st: &State, kv: u64) -> bool {
        st.in_flight < self.limits.max_in_flight
            && (self.limits.max_kv_tokens == 0 || st.kv_tokens + kv <= self.limits.max_kv_tokens)
    }

    fn grant(self: &Arc<Self>, st: &mut State, kv: u64) -> Permit {
        st.in_flight += 1;
        st.kv_tokens += kv;
        Permit {
            shared: Some(self.clone()),
            kv_tokens: kv,
        }
    }

    /// Admits queued requests in order while the head fits (FIFO: no overtaking).
    fn admit_waiters(self: &Arc<Self>, st: &mut State) {
        while let Some(head) = st.queue.front() {
            if !self.fits(st, head.kv_tokens) {
                break;
            }
            let w = st.queue.pop_front().expect("front exists");
            let permit = self.grant(st, w.kv_tokens);
            if let Err(mut permit) = w.tx.send(permit) {
                // The waiter went away; undo here (the lock is held, so no Drop).
                permit.shared = None;
                st.in_flight -= 1;
                st.kv_tokens -= permit.kv_tokens;
            }
        }
        self.publish(st);
    }

    fn publish(&self, st: &State) {
        metrics::gauge!(m::QUEUE_DEPTH).set(st.queue.len() as f64);
        metrics::gauge!(m::IN_FLIGHT).set(st.in_flight as f64);
    }
}

/// A request's place in admission: its permit, or its place in the queue (given up when
/// dropped).
#[derive(Debug)]
pub struct Entry(EntryState);

#[derive(Debug)]
enum EntryState {
    Admitted(Permit),
    Queued(oneshot::Receiver<Permit>, QueueGuard),
}

impl Entry {
    /// Whether the request waits in the queue (else it is admitted).
    pub fn is_queued(&self) -> bool {
        matches!(self.0, EntryState::Queued(..))
    }

    /// The permit, once the queue reaches this request.
    pub async fn wait(self) -> Result<Permit, GatewayError> {
        match self.0 {
            EntryState::Admitted(p) => Ok(p),
            EntryState::Queued(rx, mut guard) => {
                let permit = rx
                    .await
                    .map_err(|_| GatewayError::Internal("admission queue closed".into()));
                guard.armed = false;
                permit
            }
        }
    }
}

/// Removes a queued waiter whose caller went away.
#[derive(Debug)]
struct QueueGuard {
    shared: Arc<Shared>,
    id: u64,
    armed: bool,
}

impl Drop for QueueGuard {
    fn drop(&mut self) {
        if self.armed {
            let mut st = self.shared.lock();
            st.queue.retain(|w| w.id != self.id);
            self.shared.admit_waiters(&mut st);
        }
    }
}

impl Admission {
    pub fn new(limits: AdmissionLimits) -> Self {
        Admission {
            shared: Arc::new(Shared {
                limits,
                state: Mutex::new(State::default()),
            }),
        }
    }

    pub fn limits(&self) -> AdmissionLimits {
        self.shared.limits
    }

    /// (in flight, queued).
    pub fn counts(&self) -> (usize, usize) {
        let st = self.shared.lock();
        (st.in_flight, st.queue.len())
    }

    /// Refuses every new request from now on (graceful drain).
    pub fn drain(&self) {
        self.shared.lock().draining = true;
    }

    /// Admits now, queues, or refuses at once.
    pub async fn acquire(&self, kv_tokens: u64) -> Result<Permit, GatewayError> {
        self.enter(kv_tokens)?.wait().await
    }

    /// The synchronous half of [`acquire`](Self::acquire): admitted, or queued (a place kept
    /// until the [`Entry`] is dropped), or refused at once.
    pub fn enter(&self, kv_tokens: u64) -> Result<Entry, GatewayError> {
        let mut st = self.shared.lock();
        let limits = self.shared.limits;
        if let Some(e) = self.refusal(&st, kv_tokens, limits) {
            metrics::counter!(m::ADMISSION_REFUSALS_TOTAL, "reason" => match &e {
                GatewayError::Overloaded { reason, .. } => reason.label(),
                _ => "other",
            })
            .increment(1);
            return Err(e);
        }
        if st.queue.is_empty() && self.shared.fits(&st, kv_tokens) {
            let p = self.shared.grant(&mut st, kv_tokens);
            self.shared.publish(&st);
            return Ok(Entry(EntryState::Admitted(p)));
        }
        let (tx, rx) = oneshot::channel();
        st.next_id += 1;
        let id = st.next_id;
        st.queue.push_back(Waiter { id, kv_tokens, tx });
        self.shared.publish(&st);
        Ok(Entry(EntryState::Queued(
            rx,
            QueueGuard {
                shared: self.shared.clone(),
                id,
                armed: true,
            },
        )))
    }

    fn refusal(&self, st: &State, kv: u64, l: AdmissionLimits) -> Option<GatewayError> {
        if st.draining {
            return Some(GatewayError::Overloaded {
                reason: OverloadReason::Draining,
                message: "the gateway is draining; retry on another replica".into(),
            });
        }
        if l.max_kv_tokens > 0 && kv > l.max_kv_tokens {
            return Some(GatewayError::Overloaded {
                reason: OverloadReason::KvBudget,
                message: format!(
                    "request needs {kv} KV tokens (prompt + max_tokens), over the budget of {} (--max-kv-tokens-in-flight)",
                    l.max_kv_tokens
                ),
            });
        }
        let must_queue = !st.queue.is_empty() || !self.shared.fits(st, kv);
        if must_queue && st.queue.len() >= l.max_queue {
            return Some(GatewayError::Overloaded {
                reason: OverloadReason::QueueFull,
                message: format!(
                    "{} requests in flight (limit {}, --max-in-flight) and {} queued (limit {}, --max-queue)",
                    st.in_flight, l.max_in_flight, st.queue.len(), l.max_queue
                ),
            });
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn adm(in_flight: usize, queue: usize, kv: u64) -> Admission {
        Admission::new(AdmissionLimits {
            max_in_flight: in_flight,
            max_queue: queue,
            max_kv_tokens: kv,
        })
    }

    fn reason(e: GatewayError) -> OverloadReason {
        match e {
            GatewayError::Overloaded { reason, .. } => reason,
            other => panic!("expected Overloaded, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn admits_queues_then_refuses_at_once() {
        let a = adm(1, 1, 0);
        let p1 = a.acquire(10).await.unwrap();
        let a2 = a.clone();
        let queued = tokio::spawn(async move { a2.acquire(10).await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(a.counts(), (1, 1));
        let e = a.acquire(10).await.unwrap_err();
        assert_eq!(reason(e.clone()), OverloadReason::QueueFull);
        assert!(e.to_string().contains("--max-queue"), "{e}");
        drop(p1);
        let p2 = queued.await.unwrap().unwrap();
        assert_eq!(a.counts(), (1, 0));
        drop(p2);
        assert_eq!(a.counts(), (0, 0));
    }

    #[tokio::test]
    async fn kv_budget_queues_and_refuses_the_impossible() {
        let a = adm(10, 4, 100);
        let e = a.acquire(101).await.unwrap_err();
        assert_eq!(reason(e), OverloadReason::KvBudget);
        let p1 = a.acquire(60).await.unwrap();
        let a2 = a.clone();
        let queued = tokio::spawn(async move { a2.acquire(60).await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(a.counts(), (1, 1));
        drop(p1);
        queued.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn abandoned_waiter_leaves_the_queue() {
        let a = adm(1, 1, 0);
        let p1 = a.acquire(1).await.unwrap();
        let a2 = a.clone();
        let queued = tokio::spawn(async move { a2.acquire(1).await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        queued.abort();
        let _ = queued.await;
        assert_eq!(a.counts(), (1, 0));
        drop(p1);
        assert_eq!(a.counts(), (0, 0));
        let _p = a.acquire(1).await.unwrap();
    }

    #[tokio::test]
    async fn draining_refuses() {
        let a = adm(1, 1, 0);
        a.drain();
        assert_eq!(
            reason(a.acquire(1).await.unwrap_err()),
            OverloadReason::Draining
        );
    }
}
