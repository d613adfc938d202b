//! bf16 storage on 64-byte boundaries, for everything the AMX tiles read.
//!
//! `tileloadd` reads 16 rows of 64 bytes; a row that starts off a cache line spans two, and
//! the load then runs ~3x slower (measured on Emerald Rapids: 4 loads + 4 products from L1,
//! 28 ns aligned vs 75-108 ns at 16 bytes off). glibc gives large allocations 16 bytes past a
//! page, so a plain `Vec<u16>` is exactly that misaligned.
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};

/// One cache line.
#[derive(Clone, Copy, Debug)]
#[repr(C, align(64))]
struct Line([u8; 64]);

impl Default for Line {
    fn default() -> Line {
        Line([0; 64])
    }
}

/// Element types for which all-zero bytes are a valid value.
///
/// # Safety
/// Every bit pattern of the type's size must be a valid value.
pub unsafe trait Plain: Copy + Default + 'static {}
// SAFETY: plain numbers, every bit pattern valid.
unsafe impl Plain for u16 {}
// SAFETY: as above.
unsafe impl Plain for f32 {}
// SAFETY: as above.
unsafe impl Plain for i8 {}
// SAFETY: as above.
unsafe impl Plain for u8 {}

/// A growable `[T]` whose first element sits on a 64-byte boundary.
#[derive(Clone, Debug)]
pub struct Aligned<T: Plain> {
    lines: Vec<Line>,
    len: usize,
    _t: PhantomData<T>,
}

/// bf16 bits on cache lines (packed panels, tile-loaded rows).
pub type AlignedU16 = Aligned<u16>;

impl<T: Plain> Aligned<T> {
    const PER_LINE: usize = 64 / std::mem::size_of::<T>();

    /// Empty.
    pub const fn new() -> Aligned<T> {
        Aligned {
            lines: Vec::new(),
            len: 0,
            _t: PhantomData,
        }
    }

    /// `len` zeros.
    pub fn zeroed(len: usize) -> Aligned<T> {
        Aligned {
            lines: vec![Line::default(); len.div_ceil(Self::PER_LINE)],
            len,
            _t: PhantomData,
        }
    }

    /// `len` zeros with every page written once, so that they are resident before the first
    /// timed use (see `vlm_model::resident`).
    pub fn zeroed_resident(len: usize) -> Aligned<T> {
        let mut v = Aligned::zeroed(len);
        vlm_model::resident::touch_pages(&mut v);
        v
    }

    /// Grows (zero-filled) or shrinks to `len` values.
    pub fn resize(&mut self, len: usize) {
        self.lines
            .resize(len.div_ceil(Self::PER_LINE), Line::default());
        if len > self.len {
            let old = self.len;
            self.len = len;
            self[old..].fill(T::default());
        } else {
            self.len = len;
        }
    }
}

impl<T: Plain> Default for Aligned<T> {
    fn default() -> Aligned<T> {
        Aligned::new()
    }
}

impl<T: Plain> Deref for Aligned<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `lines` holds at least `len` values of T (64 bytes per line, T's alignment
        // divides 64), all initialised, and every bit pattern is a T (`Plain`).
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr() as *const T, self.len) }
    }
}

impl<T: Plain> DerefMut for Aligned<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`, and `&mut self` is unique.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr() as *mut T, self.len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_zeroed_and_resized() {
        let mut v = AlignedU16::zeroed(100);
        assert_eq!(v.as_ptr() as usize % 64, 0);
        assert!(v.iter().all(|&x| x == 0));
        v.fill(7);
        v.resize(40);
        assert_eq!(v.len(), 40);
        v.resize(70);
        assert_eq!(&v[..40], &[7; 40][..]);
        assert!(v[40..].iter().all(|&x| x == 0));
        assert_eq!(v.as_ptr() as usize % 64, 0);
        let f = Aligned::<f32>::zeroed_resident(5000);
        assert_eq!((f.len(), f.as_ptr() as usize % 64), (5000, 0));
        assert!(f.iter().all(|&x| x == 0.0));
    }
}
