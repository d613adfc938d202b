//! The AVX512-BF16 register tiles and row conversion (`vdpbf16ps`), and their stores.
use super::{bf16_bits, ColBias, L2Prefetch, Prior, Store, NR};
use std::arch::x86_64::*;

#[target_feature(enable = "avx512f,avx512bf16")]
pub(super) unsafe fn convert_row(src: &[f32], dst: &mut [u16]) {
    let n16 = src.len() / 16 * 16;
    let mut i = 0;
    while i < n16 {
        let v = _mm512_loadu_ps(src.as_ptr().add(i));
        let h: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(v));
        _mm256_storeu_si256(dst.as_mut_ptr().add(i) as *mut __m256i, h);
        i += 16;
    }
    for j in n16..src.len() {
        dst[j] = bf16_bits(src[j]);
    }
    dst[src.len()..].fill(0);
}

/// Lane masks of the two 16-column halves of a panel with `cols` columns in C.
fn col_masks(cols: usize) -> (__mmask16, __mmask16) {
    let m0: __mmask16 = if cols >= 16 {
        0xffff
    } else {
        (1u16 << cols) - 1
    };
    let m1: __mmask16 = if cols >= 32 {
        0xffff
    } else if cols > 16 {
        (1u16 << (cols - 16)) - 1
    } else {
        0
    };
    (m0, m1)
}

/// C rows (`cols` columns) get the first `rows` rows of a 32-column f32 block as `store`
/// says (the f32 stores: `SiluMul` and `BiasGeluBf16` are register-tile only, their entry
/// points refuse AMX views).
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn write_rows(
    out: *const f32,
    rows: usize,
    c: *mut f32,
    ldc: usize,
    cols: usize,
    store: Store,
) {
    let masks = col_masks(cols);
    for r in 0..rows {
        let o = out.add(r * NR);
        let sums = (_mm512_loadu_ps(o), _mm512_loadu_ps(o.add(16)));
        store_row(c.add(r * ldc), sums, masks, store.prior(r));
    }
}

/// One C row's 32 columns (two halves, masked to the panel's columns) = `sums`, or C's
/// old values (scaled) + `sums`.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn store_row(
    cp: *mut f32,
    (mut x0, mut x1): (__m512, __m512),
    (m0, m1): (__mmask16, __mmask16),
    prior: Prior,
) {
    match prior {
        Prior::Drop => {}
        Prior::Add => {
            x0 = _mm512_add_ps(x0, _mm512_maskz_loadu_ps(m0, cp));
            x1 = _mm512_add_ps(x1, _mm512_maskz_loadu_ps(m1, cp.add(16)));
        }
        Prior::Scale(f) => {
            let f = _mm512_set1_ps(f);
            x0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m0, cp), f, x0);
            x1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m1, cp.add(16)), f, x1);
        }
    }
    _mm512_mask_storeu_ps(cp, m0, x0);
    _mm512_mask_storeu_ps(cp.add(16), m1, x1);
}

/// bf16(gelu_tanh(x + bias)) of 32 values, rounded to nearest even: `vit_ops::gelu_tanh`
/// on each (the loop vectorises here as in `bias_gelu_tanh`'s AVX-512 build: the same
/// operations, so the same f32 values), then the rounding `convert_row` does.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")]
unsafe fn bias_gelu_bf16_32((x0, x1): (__m512, __m512), (b0, b1): (__m512, __m512)) -> __m512i {
    let mut v = [0f32; 32];
    _mm512_storeu_ps(v.as_mut_ptr(), x0);
    _mm512_storeu_ps(v.as_mut_ptr().add(16), x1);
    let mut b = [0f32; 32];
    _mm512_storeu_ps(b.as_mut_ptr(), b0);
    _mm512_storeu_ps(b.as_mut_ptr().add(16), b1);
    for (x, b) in v.iter_mut().zip(&b) {
        *x = crate::kernels::vit_ops::gelu_tanh(*x + *b);
    }
    let (y0, y1) = (
        _mm512_loadu_ps(v.as_ptr()),
        _mm512_loadu_ps(v.as_ptr().add(16)),
    );
    // Lanes 0..16 from y0, 16..32 from y1.
    std::mem::transmute(_mm512_cvtne2ps_pbh(y1, y0))
}

/// R rows x 32 columns: for each inner pair, two 16-column vectors of B against R broadcast
/// pairs of A. Columns past `cols` are neither read nor written in C. With `SiluMul` the
/// two halves are a gate and an up column block: C gets silu(gate)·up, 16 columns a row.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vl,avx512bf16")]
pub(super) unsafe fn micro<const R: usize>(
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
    let mut lo = [_mm512_setzero_ps(); R];
    let mut hi = [_mm512_setzero_ps(); R];
    // One prefetched line every `every` pairs (`per` lines at a time when there are more
    // lines than pairs).
    let (every, per) = if pf.lines == 0 {
        (usize::MAX, 0)
    } else if pf.lines <= pairs {
        (pairs / pf.lines, 1)
    } else {
        (1, pf.lines.div_ceil(pairs))
    };
    let (mut next_pf, mut sent) = (0, 0);
    for p in 0..pairs {
        if p == next_pf && sent < pf.lines {
            for _ in 0..per.min(pf.lines - sent) {
                _mm_prefetch::<_MM_HINT_T1>(pf.start.wrapping_add(64 * sent) as *const i8);
                sent += 1;
            }
            next_pf += every;
        }
        let bp = b.add(p * 2 * NR);
        let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(bp as *const _));
        let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(bp.add(NR) as *const _));
        for r in 0..R {
            let pair = (a.add(r * lda + 2 * p) as *const i32).read_unaligned();
            let av: __m512bh = std::mem::transmute(_mm512_set1_epi32(pair));
            lo[r] = _mm512_dpbf16_ps(lo[r], av, b0);
            hi[r] = _mm512_dpbf16_ps(hi[r], av, b1);
        }
    }
    if store == Store::SiluMul {
        for r in 0..R {
            let v = crate::kernels::softmax::avx512::silu_mul_16(lo[r], hi[r]);
            _mm512_storeu_ps(c.add(r * ldc), v);
        }
        return;
    }
    let masks = col_masks(cols);
    if let Store::BiasGeluBf16(ColBias(bias)) = store {
        let bias = (
            _mm512_maskz_loadu_ps(masks.0, bias),
            _mm512_maskz_loadu_ps(masks.1, bias.add(16)),
        );
        let mask32 = masks.0 as u32 | (masks.1 as u32) << 16;
        for r in 0..R {
            let v = bias_gelu_bf16_32((lo[r], hi[r]), bias);
            _mm512_mask_storeu_epi16(c.add(r * ldc) as *mut i16, mask32, v);
        }
        return;
    }
    for r in 0..R {
        store_row(c.add(r * ldc), (lo[r], hi[r]), masks, store.prior(r));
    }
}
