//! The bounded queue in front of the graphs.
//!
//! [`Admission`] counts queue slots: one per image, taken all at once when a request arrives
//! (or not at all: the caller gets `Overloaded`), and given back one by one as each image's
//! [`Permit`] is dropped: after its chunks were handed to the response stream, when it failed,
//! or when its caller went away. So the depth is "images admitted and not finished" and the
//! memory of finished-but-unsent embeddings is bounded by the capacity too.
//!
//! [`JobQueue`] is the FIFO the compute threads pop from.
use crate::error::VisionError;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

/// Queue slots: `capacity` images at most admitted and unfinished.
#[derive(Debug)]
pub struct Admission {
    capacity: usize,
    held: AtomicUsize,
}

/// One image's queue slot; dropping it frees the slot.
#[derive(Debug)]
pub struct Permit {
    admission: Arc<Admission>,
}

impl Admission {
    pub fn new(capacity: usize) -> Arc<Admission> {
        Arc::new(Admission {
            capacity,
            held: AtomicUsize::new(0),
        })
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Images admitted and not finished.
    pub fn depth(&self) -> usize {
        self.held.load(Ordering::Acquire)
    }

    /// Takes `n` slots at once, or none.
    pub fn try_acquire(self: &Arc<Self>, n: usize) -> Result<Vec<Permit>, VisionError> {
        let mut current = self.held.load(Ordering::Acquire);
        loop {
            if current + n > self.capacity {
                return Err(VisionError::Overloaded {
                    requested: n,
                    depth: current,
                    capacity: self.capacity,
                });
            }
            match self.held.compare_exchange_weak(
                current,
                current + n,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => break,
                Err(now) => current = now,
            }
        }
        metrics::gauge!("vlm_vision_queue_depth").set(self.depth() as f64);
        Ok((0..n)
            .map(|_| Permit {
                admission: Arc::clone(self),
            })
            .collect())
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let before = self.admission.held.fetch_sub(1, Ordering::AcqRel);
        metrics::gauge!("vlm_vision_queue_depth").set(before.saturating_sub(1) as f64);
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

    #[test]
    fn admits_all_or_nothing_and_frees_on_drop() {
        let a = Admission::new(3);
        let two = a.try_acquire(2).unwrap();
        assert_eq!(a.depth(), 2);
        let err = a.try_acquire(2).unwrap_err();
        assert!(
            matches!(
                err,
                VisionError::Overloaded {
                    requested: 2,
                    depth: 2,
                    capacity: 3
                }
            ),
            "{err:?}"
        );
        assert_eq!(a.depth(), 2, "a refused request takes nothing");
        let one = a.try_acquire(1).unwrap();
        drop(two);
        assert_eq!(a.depth(), 1);
        drop(one);
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
