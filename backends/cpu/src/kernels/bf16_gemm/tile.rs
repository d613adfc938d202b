//! The register tile: `mr` rows of A against one panel of B, on x86-64 AVX512-BF16.
use super::store::Store;

/// Lines a register tile brings into L2 while it runs (`prefetcht1`), spread over its pairs:
/// `lines` consecutive lines from `start`.
#[derive(Clone, Copy)]
pub(crate) struct L2Prefetch {
    pub(super) start: *const u8,
    pub(super) lines: usize,
}

impl L2Prefetch {
    pub(super) const NONE: L2Prefetch = L2Prefetch {
        start: std::ptr::null(),
        lines: 0,
    };
}

/// One register tile: `mr` (<= 12) rows of A against one panel.
#[allow(clippy::too_many_arguments)]
#[inline]
pub(super) unsafe fn tile(
    mr: usize,
    pairs: usize,
    a: *const u16,
    lda: usize,
    b: *const u16,
    c: *mut f32,
    ldc: usize,
    cols: usize,
    store: Store,
    pf: L2Prefetch,
) {
    #[cfg(target_arch = "x86_64")]
    {
        use super::x86::micro;
        let f = match mr {
            12 => micro::<12>,
            11 => micro::<11>,
            10 => micro::<10>,
            9 => micro::<9>,
            8 => micro::<8>,
            7 => micro::<7>,
            6 => micro::<6>,
            5 => micro::<5>,
            4 => micro::<4>,
            3 => micro::<3>,
            2 => micro::<2>,
            _ => micro::<1>,
        };
        f(pairs, a, lda, b, c, ldc, cols, store, pf)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (mr, pairs, a, lda, b, c, ldc, cols, store, pf);
        unreachable!("bf16 gemm needs x86-64 AVX512-BF16")
    }
}
