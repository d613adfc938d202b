//! Dot product and axpy of f32 vectors against f32 or bf16 ones (a bf16 KV cache), with 16
//! independent lanes so that the compiler vectorises them; compiled a second time with AVX-512
//! and picked at run time. bf16 values are widened exactly (bits << 16), so the products and
//! sums are the f32 ones of the widened values.
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

/// The element type of a KV cache: what decode attention reads keys and values as. With
/// AVX-512 and a head_dim that is a multiple of 16, the runs go through `x86` (four keys per
/// pass over q, the output row held in registers over a run of values); otherwise the portable
/// forms above.
pub trait CacheElem: Widen + x86::Load16 {
    /// See [`dots_portable`].
    fn dots(q: &[f32], rows: &[Self], out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if q.len().is_multiple_of(16) && std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the feature was detected; the lengths are checked by the callee.
            return unsafe { x86::dots(q, rows, out) };
        }
        dots_portable(q, rows, out)
    }
    /// See [`weighted_sum_portable`].
    fn weighted_sum(p: &[f32], rows: &[Self], o: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if o.len().is_multiple_of(16) && std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: as above.
            return unsafe { x86::weighted_sum(p, rows, o) };
        }
        weighted_sum_portable(p, rows, o)
    }
}
impl CacheElem for f32 {}
impl CacheElem for bf16 {}

#[cfg(not(target_arch = "x86_64"))]
mod x86 {
    pub trait Load16 {}
    impl Load16 for f32 {}
    impl Load16 for half::bf16 {}
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use half::bf16;
    use std::arch::x86_64::*;

    /// 16 values widened to f32.
    pub trait Load16: Sized {
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

    /// Four keys per pass: q's 16-lane chunks are loaded once for four rows.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn dots<T: Load16>(q: &[f32], rows: &[T], out: &mut [f32]) {
        let (hd, n) = (q.len(), out.len());
        assert!(
            hd.is_multiple_of(16) && rows.len() >= n * hd,
            "dots: shapes"
        );
        let (q, r) = (q.as_ptr(), rows.as_ptr());
        let mut i = 0;
        while i + 4 <= n {
            let r = r.add(i * hd);
            let mut a = [_mm512_setzero_ps(); 4];
            let mut c = 0;
            while c < hd {
                let qv = _mm512_loadu_ps(q.add(c));
                for (k, a) in a.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(qv, T::load16(r.add(k * hd + c)), *a);
                }
                c += 16;
            }
            for (k, a) in a.iter().enumerate() {
                out[i + k] = _mm512_reduce_add_ps(*a);
            }
            i += 4;
        }
        while i < n {
            let r = r.add(i * hd);
            let mut a = _mm512_setzero_ps();
            let mut c = 0;
            while c < hd {
                a = _mm512_fmadd_ps(_mm512_loadu_ps(q.add(c)), T::load16(r.add(c)), a);
                c += 16;
            }
            out[i] = _mm512_reduce_add_ps(a);
            i += 1;
        }
    }

    /// The output row in registers (C chunks of 16) over the whole run, for the head dims of
    /// the Qwen3 family; other multiples of 16 go chunk by chunk.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn weighted_sum<T: Load16>(p: &[f32], rows: &[T], o: &mut [f32]) {
        let hd = o.len();
        assert!(
            hd.is_multiple_of(16) && rows.len() >= p.len() * hd,
            "weighted_sum: shapes"
        );
        match hd / 16 {
            4 => held::<T, 4>(p, rows, o),
            8 => held::<T, 8>(p, rows, o),
            16 => held::<T, 16>(p, rows, o),
            _ => {
                let r = rows.as_ptr();
                let mut c = 0;
                while c < hd {
                    let mut acc = _mm512_loadu_ps(o.as_ptr().add(c));
                    for (i, &w) in p.iter().enumerate() {
                        acc = _mm512_fmadd_ps(_mm512_set1_ps(w), T::load16(r.add(i * hd + c)), acc);
                    }
                    _mm512_storeu_ps(o.as_mut_ptr().add(c), acc);
                    c += 16;
                }
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn held<T: Load16, const C: usize>(p: &[f32], rows: &[T], o: &mut [f32]) {
        let mut acc = [_mm512_setzero_ps(); C];
        for (c, a) in acc.iter_mut().enumerate() {
            *a = _mm512_loadu_ps(o.as_ptr().add(16 * c));
        }
        let r = rows.as_ptr();
        for (i, &w) in p.iter().enumerate() {
            let wv = _mm512_set1_ps(w);
            let row = r.add(i * 16 * C);
            for (c, a) in acc.iter_mut().enumerate() {
                *a = _mm512_fmadd_ps(wv, T::load16(row.add(16 * c)), *a);
            }
        }
        for (c, a) in acc.iter().enumerate() {
            _mm512_storeu_ps(o.as_mut_ptr().add(16 * c), *a);
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
        for hd in [16usize, 24, 128] {
            let n = 7; // one group of four and a remainder of three
            let q: Vec<f32> = (0..hd).map(|i| (i as f32 * 0.37).sin()).collect();
            let rows: Vec<f32> = (0..n * hd).map(|i| (i as f32 * 0.11).cos()).collect();
            let mut scores = vec![0f32; n];
            f32::dots(&q, &rows, &mut scores);
            for (i, s) in scores.iter().enumerate() {
                let want = super::dot(&q, &rows[i * hd..(i + 1) * hd]);
                assert!((s - want).abs() < 1e-5, "hd {hd} row {i}: {s} vs {want}");
            }
            let p: Vec<f32> = (0..n).map(|i| 0.1 + i as f32 * 0.05).collect();
            let mut o = vec![0.5f32; hd];
            f32::weighted_sum(&p, &rows, &mut o);
            for (d, o) in o.iter().enumerate() {
                let want: f32 = 0.5 + (0..n).map(|i| p[i] * rows[i * hd + d]).sum::<f32>();
                assert!((o - want).abs() < 1e-5, "hd {hd} d {d}: {o} vs {want}");
            }
        }
    }

    #[test]
    fn bf16_rows_widen_exactly() {
        use super::CacheElem;
        use half::bf16;
        let (hd, n) = (32usize, 6usize);
        let q: Vec<f32> = (0..hd).map(|i| i as f32 * 0.5 - 3.0).collect();
        let rows: Vec<bf16> = (0..n * hd)
            .map(|i| bf16::from_f32(i as f32 * 0.1 - 1.7))
            .collect();
        let wide: Vec<f32> = rows.iter().map(|x| x.to_f32()).collect();
        let (mut s1, mut s2) = (vec![0f32; n], vec![0f32; n]);
        bf16::dots(&q, &rows, &mut s1);
        f32::dots(&q, &wide, &mut s2);
        assert_eq!(s1, s2);
        let (mut o1, mut o2) = (q.clone(), q.clone());
        bf16::weighted_sum(&s1, &rows, &mut o1);
        f32::weighted_sum(&s2, &wide, &mut o2);
        assert_eq!(o1, o2);
    }
}
