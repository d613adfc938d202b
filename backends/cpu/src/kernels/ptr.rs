//! The one wrapper through which kernels hand a raw output pointer to parallel tasks.

/// A pointer shared by rayon tasks that each write a disjoint part of the buffer it points
/// into (a row block of C, a head's columns of the attention output, ...).
#[derive(Clone, Copy)]
pub struct SendPtr<T>(pub *mut T);
// SAFETY: every user has its tasks write disjoint parts of the pointee; the callers' contracts
// say which.
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}

impl<T> SendPtr<T> {
    /// By value, so closures capture the whole (Send) wrapper, not its raw-pointer field.
    #[inline(always)]
    pub fn get(self) -> *mut T {
        self.0
    }
}
