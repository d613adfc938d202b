//! Dot product and axpy of f32 vectors against f32, bf16 or FP8 E4M3 ones (a bf16 or FP8 KV
//! cache), with 16 independent lanes so that the compiler vectorises them; compiled a second
//! time with AVX-512 and picked at run time. bf16 and E4M3 values are widened exactly, so the
//! products and sums are the f32 ones of the widened values.
use float8::F8E4M3;
use half::bf16;
use multiversion::multiversion;

/// An element a vector can be read as f32 from.
pub trait Widen: Copy + Send + Sync {
    fn f32(self) -> f32;
}
impl Widen for f32 {
    #[inline(always)]
    fn f32(self) -> f32 {
        self
    }
}
impl Widen for bf16 {
    #[inline(always)]
    fn f32(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
}
impl Widen for F8E4M3 {
    #[inline(always)]
    fn f32(self) -> f32 {
        super::e4m3::value(self.to_bits())
    }
}

#[inline(always)]
fn dot_portable<T: Widen>(a: &[f32], b: &[T]) -> f32 {
    let mut acc = [0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..16 {
            acc[i] += x[i] * y[i].f32();
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y.f32();
    }
    s
}

#[inline(always)]
fn axpy_portable<T: Widen>(y: &mut [f32], a: f32, x: &[T]) {
    for (o, v) in y.iter_mut().zip(x) {
        *o += a * v.f32();
    }
}

/// `y = y * c + x` (an online softmax's running output, rescaled, plus the next partial sum).
#[inline(always)]
fn scale_add_portable(y: &mut [f32], c: f32, x: &[f32]) {
    for (o, v) in y.iter_mut().zip(x) {
        *o = *o * c + v;
    }
}

#[multiversion(targets("x86_64+avx512f"))]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    dot_portable(a, b)
}

#[multiversion(targets("x86_64+avx512f"))]
pub fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    axpy_portable(y, a, x)
}

#[multiversion(targets("x86_64+avx512f"))]
pub fn scale_add(y: &mut [f32], c: f32, x: &[f32]) {
    scale_add_portable(y, c, x)
}

/// `out[i] = q · rows[i]` for the `out.len()` consecutive rows of `q.len()` values in `rows`
/// (a run of cached keys). Each row's sum is formed on its own (no dependence on the rows
/// around it), so a sequence's scores are the same alone and in a batch.
#[inline(always)]
fn dots_portable<T: Widen>(q: &[f32], rows: &[T], out: &mut [f32]) {
    let hd = q.len();
    for (i, o) in out.iter_mut().enumerate() {
        *o = dot_portable(q, &rows[i * hd..(i + 1) * hd]);
    }
}

/// `o += sum_i p[i] * rows[i]` over the `p.len()` consecutive rows of `o.len()` values in
/// `rows` (a run of cached values).
#[inline(always)]
fn weighted_sum_portable<T: Widen>(p: &[f32], rows: &[T], o: &mut [f32]) {
    let hd = o.len();
    for (i, &w) in p.iter().enumerate() {
        axpy_portable(o, w, &rows[i * hd..(i + 1) * hd]);
    }
}

/// The element type of a KV cache: what decode attention reads keys and values as, for the
/// `g` query heads that share a kv head at once (each run of keys and values is read and
/// widened once for all of them). With AVX-512 and a head_dim that is a multiple of 16, the
/// runs go through `x86` (four keys per pass over the queries, the output rows held in
/// registers over a run of values); otherwise the portable forms above, head by head. Both
/// give each head the sums it would get alone.
pub trait CacheElem: Widen + x86::Load16 {
    /// `out[j * stride + i] = q_j · rows[i]` for the `qs.len() / hd` query heads `q_j` (rows of
    /// `hd` values of `qs`) and the `rows.len() / hd` rows of `rows` (a run of cached keys).
    fn dots(qs: &[f32], hd: usize, rows: &[Self], out: &mut [f32], stride: usize) {
        #[cfg(target_arch = "x86_64")]
        if hd.is_multiple_of(16) && std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the feature was detected; the lengths are checked by the callee.
            return unsafe { x86::dots(qs, hd, rows, out, stride) };
        }
        let n = rows.len() / hd;
        for (j, q) in qs.chunks_exact(hd).enumerate() {
            dots_portable(q, &rows[..n * hd], &mut out[j * stride..j * stride + n]);
        }
    }
    /// `o_j += sum_i p[j * stride + i] * rows[i]` for the `o.len() / hd` heads' output rows
    /// `o_j` and the `rows.len() / hd` rows of `rows` (a run of cached values).
    fn weighted_sum(p: &[f32], stride: usize, rows: &[Self], o: &mut [f32], hd: usize) {
        #[cfg(target_arch = "x86_64")]
        if hd.is_multiple_of(16) && std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: as above.
            return unsafe { x86::weighted_sum(p, stride, rows, o, hd) };
        }
        let n = rows.len() / hd;
        for (j, o) in o.chunks_exact_mut(hd).enumerate() {
            weighted_sum_portable(&p[j * stride..j * stride + n], &rows[..n * hd], o);
        }
    }
}
impl CacheElem for f32 {}
impl CacheElem for bf16 {}
impl CacheElem for F8E4M3 {}

#[cfg(not(target_arch = "x86_64"))]
mod x86 {
    pub trait Load16 {}
    impl Load16 for f32 {}
    impl Load16 for half::bf16 {}
    impl Load16 for float8::F8E4M3 {}
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use half::bf16;
    use std::arch::x86_64::*;

    /// 16 values widened to f32, short of a factor [`Load16::SCALE`] (a power of two, so the
    /// products and sums of the loaded values are exactly theirs times 1 / SCALE).
    pub trait Load16: Sized {
        const SCALE: f32 = 1.0;
        /// # Safety
        /// `p` valid for 16 reads; AVX-512F available.
        unsafe fn load16(p: *const Self) -> __m512;
    }
    impl Load16 for f32 {
        #[inline(always)]
        unsafe fn load16(p: *const f32) -> __m512 {
            _mm512_loadu_ps(p)
        }
    }
    impl Load16 for bf16 {
        #[inline(always)]
        unsafe fn load16(p: *const bf16) -> __m512 {
            let h = _mm256_loadu_si256(p as *const __m256i);
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        }
    }
    impl Load16 for float8::F8E4M3 {
        /// A code's 7 magnitude bits at bits 7..14 of an f16 (and its sign at 15) are exactly
        /// 2^-8 times its value, subnormals included (the FP8 weights' expansion in
        /// `dequant_gemm` does the same): widen, mask, shift, `vcvtph2ps`; the 2^8 is applied
        /// once per sum.
        const SCALE: f32 = 256.0;
        #[inline(always)]
        unsafe fn load16(p: *const float8::F8E4M3) -> __m512 {
            let w = _mm256_cvtepu8_epi16(_mm_loadu_si128(p as *const __m128i));
            let mag = _mm256_and_si256(_mm256_slli_epi16::<7>(w), _mm256_set1_epi16(0x7F << 7));
            let sign = _mm256_and_si256(_mm256_slli_epi16::<8>(w), _mm256_set1_epi16(-0x8000));
            _mm512_cvtph_ps(_mm256_or_si256(mag, sign))
        }
    }

    /// See [`super::CacheElem::dots`]: query heads in pairs (a last one alone).
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn dots<T: Load16>(
        qs: &[f32],
        hd: usize,
        rows: &[T],
        out: &mut [f32],
        stride: usize,
    ) {
        let (g, n) = (qs.len() / hd, rows.len() / hd);
        assert!(
            hd.is_multiple_of(16)
                && qs.len() == g * hd
                && (g == 0 || out.len() >= (g - 1) * stride + n),
            "dots: shapes"
        );
        let (q, r, o) = (qs.as_ptr(), rows.as_ptr(), out.as_mut_ptr());
        let mut j = 0;
        while j + 2 <= g {
            dots_heads::<T, 2>(q.add(j * hd), hd, r, n, o.add(j * stride), stride);
            j += 2;
        }
        if j < g {
            dots_heads::<T, 1>(q.add(j * hd), hd, r, n, o.add(j * stride), stride);
        }
    }

    /// G query heads, four keys per pass: each key chunk is widened once for the G heads.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn dots_heads<T: Load16, const G: usize>(
        q: *const f32,
        hd: usize,
        r: *const T,
        n: usize,
        out: *mut f32,
        stride: usize,
    ) {
        let mut i = 0;
        while i + 4 <= n {
            let r = r.add(i * hd);
            let mut a = [[_mm512_setzero_ps(); 4]; G];
            let mut c = 0;
            while c < hd {
                let k = [0, 1, 2, 3].map(|k| T::load16(r.add(k * hd + c)));
                for (j, a) in a.iter_mut().enumerate() {
                    let qv = _mm512_loadu_ps(q.add(j * hd + c));
                    for (a, k) in a.iter_mut().zip(&k) {
                        *a = _mm512_fmadd_ps(qv, *k, *a);
                    }
                }
                c += 16;
            }
            for (j, a) in a.iter().enumerate() {
                for (k, a) in a.iter().enumerate() {
                    *out.add(j * stride + i + k) = _mm512_reduce_add_ps(*a) * T::SCALE;
                }
            }
            i += 4;
        }
        while i < n {
            let r = r.add(i * hd);
            let mut a = [_mm512_setzero_ps(); G];
            let mut c = 0;
            while c < hd {
                let k = T::load16(r.add(c));
                for (j, a) in a.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(_mm512_loadu_ps(q.add(j * hd + c)), k, *a);
                }
                c += 16;
            }
            for (j, a) in a.iter().enumerate() {
                *out.add(j * stride + i) = _mm512_reduce_add_ps(*a) * T::SCALE;
            }
            i += 1;
        }
    }

    /// See [`super::CacheElem::weighted_sum`]: the output rows in registers (C chunks of 16 per
    /// head, two heads at a time where they fit) over the whole run, for the head dims of the
    /// Qwen3 family; other multiples of 16 go chunk by chunk.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn weighted_sum<T: Load16>(
        p: &[f32],
        stride: usize,
        rows: &[T],
        o: &mut [f32],
        hd: usize,
    ) {
        let (g, n) = (o.len() / hd, rows.len() / hd);
        assert!(
            hd.is_multiple_of(16)
                && o.len() == g * hd
                && (g == 0 || p.len() >= (g - 1) * stride + n),
            "weighted_sum: shapes"
        );
        let (p, r, o) = (p.as_ptr(), rows.as_ptr(), o.as_mut_ptr());
        let mut j = 0;
        // Pairs where 2 x C accumulators stay in the 32 registers.
        while j + 2 <= g && matches!(hd / 16, 4 | 8) {
            let (pj, oj) = (p.add(j * stride), o.add(j * hd));
            if hd == 64 {
                held::<T, 4, 2>(pj, stride, r, n, oj)
            } else {
                held::<T, 8, 2>(pj, stride, r, n, oj)
            }
            j += 2;
        }
        while j < g {
            let (pj, oj) = (p.add(j * stride), o.add(j * hd));
            match hd / 16 {
                4 => held::<T, 4, 1>(pj, stride, r, n, oj),
                8 => held::<T, 8, 1>(pj, stride, r, n, oj),
                16 => held::<T, 16, 1>(pj, stride, r, n, oj),
                _ => {
                    let mut c = 0;
                    while c < hd {
                        let mut acc = _mm512_loadu_ps(oj.add(c));
                        if T::SCALE != 1.0 {
                            acc = _mm512_mul_ps(acc, _mm512_set1_ps(1.0 / T::SCALE));
                        }
                        for i in 0..n {
                            let w = _mm512_set1_ps(*pj.add(i));
                            acc = _mm512_fmadd_ps(w, T::load16(r.add(i * hd + c)), acc);
                        }
                        if T::SCALE != 1.0 {
                            acc = _mm512_mul_ps(acc, _mm512_set1_ps(T::SCALE));
                        }
                        _mm512_storeu_ps(oj.add(c), acc);
                        c += 16;
                    }
                }
            }
            j += 1;
        }
    }

    /// G heads' output rows (C chunks of 16 each, `o` .. `o + G * 16 C`) held in registers
    /// over `n` rows of values; head j's weights at `p + j * stride`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn held<T: Load16, const C: usize, const G: usize>(
        p: *const f32,
        stride: usize,
        r: *const T,
        n: usize,
        o: *mut f32,
    ) {
        let mut acc = [[_mm512_setzero_ps(); C]; G];
        for (j, acc) in acc.iter_mut().enumerate() {
            for (c, a) in acc.iter_mut().enumerate() {
                *a = _mm512_loadu_ps(o.add(j * 16 * C + 16 * c));
                if T::SCALE != 1.0 {
                    *a = _mm512_mul_ps(*a, _mm512_set1_ps(1.0 / T::SCALE));
                }
            }
        }
        for i in 0..n {
            let w: [__m512; G] = std::array::from_fn(|j| _mm512_set1_ps(*p.add(j * stride + i)));
            let row = r.add(i * 16 * C);
            for c in 0..C {
                let v = T::load16(row.add(16 * c));
                for (acc, w) in acc.iter_mut().zip(&w) {
                    acc[c] = _mm512_fmadd_ps(*w, v, acc[c]);
                }
            }
        }
        for (j, acc) in acc.iter().enumerate() {
            for (c, a) in acc.iter().enumerate() {
                let a = if T::SCALE != 1.0 {
                    _mm512_mul_ps(*a, _mm512_set1_ps(T::SCALE))
                } else {
                    *a
                };
                _mm512_storeu_ps(o.add(j * 16 * C + 16 * c), a);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn dot_and_axpy() {
        let a: Vec<f32> = (0..37).map(|i| i as f32 * 0.5).collect();
        let b: Vec<f32> = (0..37).map(|i| 1.0 - i as f32 * 0.25).collect();
        let want: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert!((super::dot(&a, &b) - want).abs() < 1e-3);
        let mut y = b.clone();
        super::axpy(&mut y, 2.0, &a);
        assert!(y
            .iter()
            .zip(&a)
            .zip(&b)
            .all(|((y, a), b)| *y == b + 2.0 * a));
    }

    #[test]
    fn runs_of_rows_match_the_plain_dot_and_axpy() {
        use super::CacheElem;
        // Query heads in a pair and alone; one group of four rows and a remainder of three.
        for (hd, g) in [(16usize, 3usize), (24, 2), (128, 3), (64, 2), (256, 1)] {
            let (n, stride) = (7, 9);
            let qs: Vec<f32> = (0..g * hd).map(|i| (i as f32 * 0.37).sin()).collect();
            let rows: Vec<f32> = (0..n * hd).map(|i| (i as f32 * 0.11).cos()).collect();
            let mut scores = vec![0f32; g * stride];
            f32::dots(&qs, hd, &rows, &mut scores, stride);
            for j in 0..g {
                for i in 0..n {
                    let s = scores[j * stride + i];
                    let want = super::dot(&qs[j * hd..(j + 1) * hd], &rows[i * hd..(i + 1) * hd]);
                    assert!(
                        (s - want).abs() < 1e-5,
                        "hd {hd} head {j} row {i}: {s} vs {want}"
                    );
                }
            }
            let p: Vec<f32> = (0..g * stride).map(|i| 0.1 + i as f32 * 0.05).collect();
            let mut o = vec![0.5f32; g * hd];
            f32::weighted_sum(&p, stride, &rows, &mut o, hd);
            for (jd, o) in o.iter().enumerate() {
                let (j, d) = (jd / hd, jd % hd);
                let sum = (0..n)
                    .map(|i| p[j * stride + i] * rows[i * hd + d])
                    .sum::<f32>();
                assert!(
                    (o - 0.5 - sum).abs() < 1e-5,
                    "hd {hd} head {j} d {d}: {o} vs {sum}"
                );
            }
        }
    }

    /// Dots and weighted sums over rows of `T` equal those over the rows widened to f32 (on
    /// the AVX-512 path where the CPU has it, which widens in registers), for three heads (a
    /// pair and one alone).
    fn rows_widen_exactly<T: super::CacheElem>(make: impl Fn(f32) -> T) {
        use super::CacheElem;
        let (hd, n, g) = (32usize, 6usize, 3usize);
        let qs: Vec<f32> = (0..g * hd).map(|i| i as f32 * 0.5 - 3.0).collect();
        let rows: Vec<T> = (0..n * hd).map(|i| make(i as f32 * 0.1 - 1.7)).collect();
        let wide: Vec<f32> = rows.iter().map(|x| x.f32()).collect();
        let (mut s1, mut s2) = (vec![0f32; g * n], vec![0f32; g * n]);
        T::dots(&qs, hd, &rows, &mut s1, n);
        f32::dots(&qs, hd, &wide, &mut s2, n);
        assert_eq!(s1, s2);
        let (mut o1, mut o2) = (qs.clone(), qs.clone());
        T::weighted_sum(&s1, n, &rows, &mut o1, hd);
        f32::weighted_sum(&s2, n, &wide, &mut o2, hd);
        assert_eq!(o1, o2);
    }

    #[test]
    fn bf16_rows_widen_exactly() {
        rows_widen_exactly(half::bf16::from_f32);
    }

    #[test]
    fn e4m3_rows_widen_exactly() {
        rows_widen_exactly(|x| float8::F8E4M3::from_bits(super::super::e4m3::encode(x)));
        // Every code but the NaNs, subnormals included, through the AVX-512 widening.
        let codes: Vec<float8::F8E4M3> = (0..=255u8)
            .filter(|c| c & 0x7F != 0x7F)
            .map(float8::F8E4M3::from_bits)
            .collect();
        for (i, row) in codes.chunks_exact(16).enumerate() {
            let mut o = vec![0f32; 16];
            super::CacheElem::weighted_sum(&[1.0], 1, row, &mut o, 16);
            let want: Vec<f32> = row.iter().map(|c| c.to_f32()).collect();
            assert_eq!(o, want, "row {i}");
        }
    }
}
