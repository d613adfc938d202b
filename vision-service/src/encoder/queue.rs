//! The bounded queue in front of the graphs.
//!
//! [`Admission`] counts queue slots: `capacity` images at most admitted and unfinished, each
//! slot given back when that image's [`Permit`] is dropped: after its chunks were handed to the
//! response stream, when it failed, or when its caller went away. So the memory of
//! finished-but-unsent embeddings is bounded by the capacity. Images that find no free slot
//! wait their turn in one FIFO line ([`Waiting`]: tokio's semaphore is fair, so a request is
//! never overtaken); the line holds at most `max_waiting` images, past that a request is
//! refused at once (`Overloaded`). A request may have more images than the capacity: its
//! images take slots as earlier ones give theirs back.
//!
//! [`JobQueue`] is the FIFO the compute threads pop from.
use crate::error::VisionError;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use tokio::sync::Semaphore;

/// Queue slots and the line of images waiting for one.
#[derive(Debug)]
pub struct Admission {
    capacity: usize,
    max_waiting: usize,
    slots: Arc<Semaphore>,
    /// Slots held by admitted images (counted here: the semaphore hands a waiting request the
    /// free slots one by one, so its free count is not the admitted count).
    admitted: AtomicUsize,
    waiting: AtomicUsize,
}

/// One image's queue slot; dropping it frees the slot.
#[derive(Debug)]
pub struct Permit {
    admission: Arc<Admission>,
}

/// A request's places in the wait line: the images that have no slot yet. Dropping it (the
/// request was cancelled or failed) leaves the line.
#[derive(Debug)]
pub struct Waiting {
    admission: Arc<Admission>,
    remaining: usize,
}

impl Admission {
    pub fn new(capacity: usize, max_waiting: usize) -> Arc<Admission> {
        Arc::new(Admission {
            capacity,
            max_waiting,
            slots: Arc::new(Semaphore::new(capacity)),
            admitted: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
        })
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn max_waiting(&self) -> usize {
        self.max_waiting
    }

    /// Images admitted and not finished.
    pub fn depth(&self) -> usize {
        self.admitted.load(Ordering::Acquire)
    }

    /// Images waiting for a slot.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }

    /// Puts `n` images in the wait line at once, or none: `Overloaded` when the line has no
    /// room for them. A request with more images than the line ever holds is invalid
    /// (`Validation`), not a reason to retry.
    pub fn enter(self: &Arc<Self>, n: usize) -> Result<Waiting, VisionError> {
        if n > self.max_waiting {
            return Err(VisionError::invalid_request(format!(
                "the request has {n} images (a video counts one per temporal group), more than \
                 the {} the vision queue lets wait (--max-waiting-images)",
                self.max_waiting
            )));
        }
        let mut current = self.waiting.load(Ordering::Acquire);
        loop {
            if current + n > self.max_waiting {
                return Err(VisionError::Overloaded {
                    requested: n,
                    waiting: current,
                    max_waiting: self.max_waiting,
                    capacity: self.capacity,
                });
            }
            match self.waiting.compare_exchange_weak(
                current,
                current + n,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => break,
                Err(now) => current = now,
            }
        }
        self.publish();
        Ok(Waiting {
            admission: Arc::clone(self),
            remaining: n,
        })
    }

    fn publish(&self) {
        metrics::gauge!("vlm_vision_queue_depth").set(self.depth() as f64);
        metrics::gauge!("vlm_vision_images_waiting").set(self.waiting() as f64);
    }
}

impl Waiting {
    /// Images of the request still without a slot.
    pub fn remaining(&self) -> usize {
        self.remaining
    }

    /// The next `k` of the request's images get slots, all at once, when it is their turn.
    /// `k` is at most the capacity and at most [`Waiting::remaining`].
    pub async fn admit(&mut self, k: usize) -> Vec<Permit> {
        let a = &self.admission;
        let k = k.min(self.remaining).min(a.capacity);
        // The semaphore is never closed, so acquiring fails only if it were.
        if let Ok(p) = a.slots.acquire_many(k as u32).await {
            // Each image gives its slot back on its own (Permit's Drop).
            p.forget();
        }
        self.remaining -= k;
        a.admitted.fetch_add(k, Ordering::AcqRel);
        a.waiting.fetch_sub(k, Ordering::AcqRel);
        a.publish();
        (0..k)
            .map(|_| Permit {
                admission: Arc::clone(a),
            })
            .collect()
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if self.remaining > 0 {
            self.admission
                .waiting
                .fetch_sub(self.remaining, Ordering::AcqRel);
            self.admission.publish();
        }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.admission.admitted.fetch_sub(1, Ordering::AcqRel);
        self.admission.slots.add_permits(1);
        self.admission.publish();
    }
}

/// A FIFO that blocks poppers until a job arrives or the queue is closed.
#[derive(Debug)]
pub struct JobQueue<T> {
    state: Mutex<QueueState<T>>,
    ready: Condvar,
}

#[derive(Debug)]
struct QueueState<T> {
    jobs: VecDeque<T>,
    closed: bool,
}

impl<T> Default for JobQueue<T> {
    fn default() -> Self {
        JobQueue {
            state: Mutex::new(QueueState {
                jobs: VecDeque::new(),
                closed: false,
            }),
            ready: Condvar::new(),
        }
    }
}

impl<T> JobQueue<T> {
    /// Appends `jobs`; false (and the jobs dropped) when the queue is closed.
    pub fn push_all(&self, jobs: impl IntoIterator<Item = T>) -> bool {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if s.closed {
            return false;
        }
        s.jobs.extend(jobs);
        drop(s);
        self.ready.notify_all();
        true
    }

    /// The next job; None once the queue is closed and empty.
    pub fn pop(&self) -> Option<T> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(job) = s.jobs.pop_front() {
                return Some(job);
            }
            if s.closed {
                return None;
            }
            s = self.ready.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// No more pushes; poppers drain what is left, then get None.
    pub fn close(&self) {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).closed = true;
        self.ready.notify_all();
    }

    pub fn len(&self) -> usize {
        self.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .jobs
            .len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn admits_in_line_order_refuses_past_the_line_and_frees_on_drop() {
        let a = Admission::new(3, 4);
        let mut first = a.enter(2).unwrap();
        let two = first.admit(2).await;
        assert_eq!((a.depth(), a.waiting()), (2, 0));
        // Two more images wait: only one slot is free and a request takes its slots at once.
        let mut second = a.enter(2).unwrap();
        let a2 = Arc::clone(&a);
        let waiter = tokio::spawn(async move {
            let p = second.admit(2).await;
            (p.len(), a2.depth())
        });
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        assert_eq!((a.depth(), a.waiting()), (2, 2));
        // The line holds 4 images: 3 more do not fit, 2 do.
        let err = a.enter(3).unwrap_err();
        assert!(
            matches!(
                err,
                VisionError::Overloaded {
                    requested: 3,
                    waiting: 2,
                    max_waiting: 4,
                    ..
                }
            ),
            "{err:?}"
        );
        assert_eq!(a.waiting(), 2, "a refused request takes nothing");
        drop(a.enter(2).unwrap());
        assert_eq!(a.waiting(), 2, "leaving the line gives its places back");
        // More than the line ever holds can never wait: refused as invalid, not busy.
        let err = a.enter(5).unwrap_err();
        assert!(
            matches!(&err, VisionError::Validation { .. })
                && err
                    .to_string()
                    .contains("more than the 4 the vision queue lets wait"),
            "{err}"
        );
        drop(two);
        assert_eq!(waiter.await.unwrap(), (2, 2));
        assert_eq!(a.waiting(), 0);
    }

    #[tokio::test]
    async fn a_request_larger_than_the_capacity_takes_slots_as_they_free() {
        let a = Admission::new(2, 8);
        let mut w = a.enter(5).unwrap();
        let mut held = w.admit(5).await;
        assert_eq!((held.len(), w.remaining(), a.depth()), (2, 3, 2));
        held.pop();
        let more = w.admit(1).await;
        assert_eq!((more.len(), w.remaining(), a.depth()), (1, 2, 2));
        drop(w);
        assert_eq!(a.waiting(), 0);
        drop((held, more));
        assert_eq!(a.depth(), 0);
    }

    #[test]
    fn queue_is_fifo_and_drains_after_close() {
        let q = JobQueue::default();
        assert!(q.push_all([1, 2, 3]));
        assert_eq!(q.pop(), Some(1));
        q.close();
        assert!(!q.push_all([4]));
        assert_eq!(q.pop(), Some(2));
        assert_eq!(q.pop(), Some(3));
        assert_eq!(q.pop(), None);
    }

    #[test]
    fn close_wakes_a_waiting_popper() {
        let q = Arc::new(JobQueue::<u8>::default());
        let q2 = Arc::clone(&q);
        let t = std::thread::spawn(move || q2.pop());
        std::thread::sleep(std::time::Duration::from_millis(20));
        q.close();
        assert_eq!(t.join().unwrap(), None);
    }
}
