//! Weight-only quantized products: weights stored in a small code per value (a [`Codec`]: 4-bit
//! integers of a W4A16 checkpoint, FP8 e4m3 of an FP8 one) with one scale per output row and
//! group of inputs, times f32 activations. The weight stays in its codes in memory and is
//! expanded in registers:
//!
//! * decode rows (up to [`GEMV_ROWS`]): a gemv. Per group the codes' values multiply the
//!   activations (plus the codec's offset times the group's activation sum) and the sum is
//!   scaled by the group's scale: `sum_g s_g * (sum v x + offset * sum x)`, the scheme's `sum
//!   (v + offset) s x` in another order. 4-bit codes, where the CPU has AVX512-BF16, run on
//!   `vdpbf16ps`: a code's 16-bit lane ORed with 0x4300 is the bf16 of `128 + q`, exact, times
//!   the activations rounded to bf16 (as the prefill path rounds them), f32 sums, and `136 *
//!   sum x` taken off per group; 3 instructions expand 64 codes. FP8 codes (and 4-bit ones on
//!   other CPUs) run in f32: `vcvtph2ps` of their f16 form, FMAs.
//! * more rows (prefill), on CPUs with the bf16 GEMM: each task expands a run of panels to the
//!   bf16 GEMM's packed layout in a per-thread buffer (`(v + offset) * s` rounded to bf16, the
//!   dequantized weight the reference multiplies by in a bf16 model), and runs
//!   [`super::bf16_gemm::gemm_bf16_a`] (AMX tiles where granted) over every activation row
//!   with it; the activations are rounded to bf16 once per call. A run is at most
//!   [`RUN_BYTES`] of bf16 panels, so it stays in L2 while every row block passes over it.
//!   Expanding costs one pass over the weight per call, against `m` multiply-adds per value.
//!
//! Layout (made at load): output rows in panels of [`NR`] (the bf16 GEMM's), and inside a
//! panel, per pair of inputs `(2p, 2p + 1)`, the 64 codes in the packed-panel order (slot `2c +
//! (i & 1)` for column `c`) as the codec lays them out ([`Codec::PAIR_BYTES`]). Scales: per
//! panel and group, the 32 columns' f32 scales. Without AVX512 the same sums run in scalar
//! code (exact to the scheme, slow).
use super::aligned::{Aligned, AlignedU16};
use super::bf16_gemm::{self, BView};
use super::packed::{PackedB, NR};
use super::ptr::SendPtr;
use rayon::prelude::*;
use std::cell::RefCell;
use std::marker::PhantomData;

/// Rows up to which a product is a gemv (the weight streamed once, expanded in registers).
/// More rows expand the panels for the bf16 GEMM: at 8 rows two gemv passes took 1.6x the bf16
/// GEMM's time on the 2B's shapes where expanding took 1.0x (4-bit) and 1.5-2.0x (FP8) (the
/// `dequant_gemm` bench, Xeon with AMX, whose `vdpbf16ps` and FMAs bound a 4-row pass).
pub const GEMV_ROWS: usize = 4;
/// Bytes of bf16 panels a prefill task expands and keeps in L2 (the bf16 GEMM's AMX run).
const RUN_BYTES: usize = 1 << 20;
/// Panels per gemv task.
const GEMV_PANELS: usize = 4;
/// Bytes the gemv of 4-bit codes prefetches ahead of its loads (within a panel's run).
const PREFETCH_AHEAD: usize = 2048;

/// How a value is stored: `W = (value(code) + OFFSET) * scale`.
pub trait Codec: Send + Sync + std::fmt::Debug + 'static {
    /// Bytes holding the 64 codes of one input pair of a panel.
    const PAIR_BYTES: usize;
    /// Added to every value before scaling (the stored offset of unsigned codes).
    const OFFSET: f32;
    /// The code of padding columns (value `-OFFSET`, so that they sum to zero).
    const ZERO: u8;
    /// Writes `code` at slot `t` (0..64) of a pair's bytes.
    fn put(pair: &mut [u8], t: usize, code: u8);
    /// The code at slot `t` of a pair's bytes.
    fn get(pair: &[u8], t: usize) -> u8;
    /// The value of a code (before the offset and the scale).
    fn value(code: u8) -> f32;
    /// The 64 slots of the pair at `p` as 4 vectors of 16 f32 values, times [`Self::VEC_UNIT`].
    ///
    /// # Safety
    /// AVX512-F/BW; `p` readable for [`Self::PAIR_BYTES`].
    #[cfg(target_arch = "x86_64")]
    unsafe fn slots(p: *const u8) -> [std::arch::x86_64::__m512; 4];
    /// What [`Self::slots`] returns per unit of [`Self::value`] (a power of two the scales
    /// are divided by).
    const VEC_UNIT: f32;
    /// Codes whose 16-bit lane ORed with this is the bf16 of `DOT_BIAS_VALUE + value` (4-bit
    /// codes: 0x4300 | q is 128 + q): decode rows then run on `vdpbf16ps` ([`x86::gemv_dot`]).
    const DOT_BIAS: Option<(u16, f32)>;
}

/// 4-bit integers stored `+ 8` (a W4A16 checkpoint's): slot `t` in the low nibble of byte `t`
/// and slot `t + 32` in the high nibble, so one load and two masks give the 64 slots in order.
#[derive(Debug)]
pub struct Int4;

impl Codec for Int4 {
    const PAIR_BYTES: usize = 32;
    const OFFSET: f32 = -8.0;
    const ZERO: u8 = 8;
    fn put(pair: &mut [u8], t: usize, code: u8) {
        let b = &mut pair[t % 32];
        *b = if t < 32 {
            (*b & 0xF0) | (code & 0xF)
        } else {
            (*b & 0x0F) | (code << 4)
        };
    }
    fn get(pair: &[u8], t: usize) -> u8 {
        let b = pair[t % 32];
        if t < 32 {
            b & 0xF
        } else {
            b >> 4
        }
    }
    fn value(code: u8) -> f32 {
        code as f32
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn slots(p: *const u8) -> [std::arch::x86_64::__m512; 4] {
        use std::arch::x86_64::*;
        let b = _mm256_loadu_si256(p as *const __m256i);
        let mask = _mm256_set1_epi8(0x0F);
        let lo = _mm256_and_si256(b, mask);
        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(b), mask);
        [
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(lo))),
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256::<1>(lo))),
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(hi))),
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256::<1>(hi))),
        ]
    }
    const VEC_UNIT: f32 = 1.0;
    const DOT_BIAS: Option<(u16, f32)> = Some((0x4300, 128.0));
}

/// FP8 e4m3fn (an FP8 checkpoint's), a byte a slot: slot `t` in the low byte of 16-bit lane
/// `t` and slot `t + 32` in its high byte, so that each half of a lane expands in place. In
/// registers a code becomes the f16 with its 7 magnitude bits at bits 7..14 (exponent and
/// mantissa shifted into f16's, bias 7 against 15): exactly 2^-8 times its value, subnormals
/// included, so two masks, two shifts and `vcvtph2ps` expand it and the scale takes the 2^8.
#[derive(Debug)]
pub struct Fp8E4M3;

impl Codec for Fp8E4M3 {
    const PAIR_BYTES: usize = 64;
    const OFFSET: f32 = 0.0;
    const ZERO: u8 = 0;
    fn put(pair: &mut [u8], t: usize, code: u8) {
        pair[2 * (t % 32) + t / 32] = code;
    }
    fn get(pair: &[u8], t: usize) -> u8 {
        pair[2 * (t % 32) + t / 32]
    }
    fn value(code: u8) -> f32 {
        super::e4m3::value(code)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn slots(p: *const u8) -> [std::arch::x86_64::__m512; 4] {
        use std::arch::x86_64::*;
        // Two codes a 16-bit lane: slot t's (the low byte) and slot t + 32's (the high one).
        let b = _mm512_loadu_si512(p as *const __m512i);
        let (mag, sign) = (_mm512_set1_epi16(0x7F << 7), _mm512_set1_epi16(-0x8000));
        // Low bytes: magnitude << 7, sign << 8. High bytes: magnitude >> 1, sign as is.
        let lo = _mm512_or_si512(
            _mm512_and_si512(_mm512_slli_epi16::<7>(b), mag),
            _mm512_and_si512(_mm512_slli_epi16::<8>(b), sign),
        );
        let hi = _mm512_or_si512(
            _mm512_and_si512(_mm512_srli_epi16::<1>(b), mag),
            _mm512_and_si512(b, sign),
        );
        [
            _mm512_cvtph_ps(_mm512_castsi512_si256(lo)),
            _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(lo)),
            _mm512_cvtph_ps(_mm512_castsi512_si256(hi)),
            _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(hi)),
        ]
    }
    const VEC_UNIT: f32 = 1.0 / 256.0;
    const DOT_BIAS: Option<(u16, f32)> = None;
}

/// A weight of codes `C` laid out for [`DequantWeight::matmul`].
#[derive(Debug)]
pub struct DequantWeight<C: Codec> {
    n: usize,
    k: usize,
    group: usize,
    /// `n` rounded up to [`NR`] / [`NR`].
    panels: usize,
    /// Per panel, per input pair, [`Codec::PAIR_BYTES`]; columns past `n` hold
    /// [`Codec::ZERO`] with scale 0.
    codes: Aligned<u8>,
    /// Per panel, per group, [`NR`] scales.
    scales: Vec<f32>,
    simd: bool,
    /// Prefill products on AMX tiles (the bf16 GEMM's option).
    amx: bool,
    codec: PhantomData<C>,
}

/// A W4A16 weight.
pub type Int4Weight = DequantWeight<Int4>;
/// An FP8 (e4m3, block scales) weight.
pub type Fp8Weight = DequantWeight<Fp8E4M3>;

/// Whether this CPU runs the AVX512 gemv and expansion.
fn avx512_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && std::arch::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// What the W4A16 and FP8 products run on, for logs and `Info` (as
/// `CpuKernels::int4_weight` and `fp8_weight` set them up): the decode gemv of 4-bit and FP8
/// codes, then the prefill path.
pub fn kernel_name(simd: bool, amx: bool) -> &'static str {
    let simd = simd && avx512_available();
    match (simd, bf16_gemm::available(), amx && super::amx::available()) {
        (false, _, _) => "scalar",
        (true, false, _) => "gemv-f32",
        (true, true, false) => "gemv-int4-vdpbf16ps+fp8-f32, prefill expand-bf16-avx512",
        (true, true, true) => "gemv-int4-vdpbf16ps+fp8-f32, prefill expand-bf16-amx",
    }
}

impl<C: Codec> DequantWeight<C> {
    /// Lays out `codes` (n, k) with `scale(r, g)`, the scale of row `r` and group `g` of
    /// `group` inputs. Panics unless `k` is a multiple of `group` and `group` is even (the
    /// loaders check both).
    pub fn new(
        n: usize,
        k: usize,
        group: usize,
        codes: &[u8],
        scale: impl Fn(usize, usize) -> f32,
    ) -> Self {
        assert!(
            group > 0 && group.is_multiple_of(2) && k.is_multiple_of(group),
            "DequantWeight: k {k}, group {group}"
        );
        assert_eq!(codes.len(), n * k, "DequantWeight: codes");
        let groups = k / group;
        let panels = n.div_ceil(NR);
        let pairs = k / 2;
        let mut data = Aligned::<u8>::zeroed(panels * pairs * C::PAIR_BYTES);
        for pair in data.chunks_exact_mut(C::PAIR_BYTES) {
            for t in 0..2 * NR {
                C::put(pair, t, C::ZERO);
            }
        }
        let mut sc = vec![0f32; panels * groups * NR];
        for r in 0..n {
            let (panel, c) = (r / NR, r % NR);
            for (i, &code) in codes[r * k..(r + 1) * k].iter().enumerate() {
                let at = (panel * pairs + i / 2) * C::PAIR_BYTES;
                C::put(&mut data[at..at + C::PAIR_BYTES], 2 * c + (i & 1), code);
            }
            for g in 0..groups {
                sc[(panel * groups + g) * NR + c] = scale(r, g);
            }
        }
        DequantWeight {
            n,
            k,
            group,
            panels,
            codes: data,
            scales: sc,
            simd: true,
            amx: false,
            codec: PhantomData,
        }
    }

    /// `false`: the scalar sums only (the backend's `kernels.simd: off`).
    pub fn with_simd(mut self, on: bool) -> Self {
        self.simd = on;
        self
    }

    /// Prefill products on AMX tiles when `on` (and the CPU grants them).
    pub fn with_amx(mut self, on: bool) -> Self {
        self.amx = on && super::amx::available();
        self
    }

    pub fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    /// Bytes held (codes and scales).
    pub fn bytes(&self) -> usize {
        self.codes.len() + 4 * self.scales.len()
    }

    /// `parts` (same k and group) stacked in order as one weight, so that q/k/v and gate/up
    /// run as one set of tasks; `None` when they differ or a part but the last ends inside a
    /// panel.
    pub fn concat(parts: &[&Self]) -> Option<Self> {
        let first = parts.first()?;
        let (k, group) = (first.k, first.group);
        let last = parts.len() - 1;
        if parts
            .iter()
            .enumerate()
            .any(|(i, p)| p.k != k || p.group != group || (i < last && !p.n.is_multiple_of(NR)))
        {
            return None;
        }
        let panels: usize = parts.iter().map(|p| p.panels).sum();
        let mut codes = Aligned::<u8>::zeroed(panels * k / 2 * C::PAIR_BYTES);
        let mut at = 0;
        for p in parts {
            codes[at..at + p.codes.len()].copy_from_slice(&p.codes);
            at += p.codes.len();
        }
        Some(DequantWeight {
            n: parts.iter().map(|p| p.n).sum(),
            k,
            group,
            panels,
            codes,
            scales: parts
                .iter()
                .flat_map(|p| p.scales.iter().copied())
                .collect(),
            simd: parts.iter().all(|p| p.simd),
            amx: parts.iter().all(|p| p.amx),
            codec: PhantomData,
        })
    }

    /// W[r][i] as the scheme defines it: `(value + offset) * scale`.
    fn at(&self, r: usize, i: usize) -> f32 {
        let (panel, c) = (r / NR, r % NR);
        let at = (panel * self.k / 2 + i / 2) * C::PAIR_BYTES;
        let code = C::get(&self.codes[at..at + C::PAIR_BYTES], 2 * c + (i & 1));
        let groups = self.k / self.group;
        let s = self.scales[(panel * groups + i / self.group) * NR + c];
        (C::value(code) + C::OFFSET) * s
    }

    /// Row `r` of W in floats.
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        for (i, o) in out[..self.k].iter_mut().enumerate() {
            *o = self.at(r, i);
        }
    }

    /// x (m, k) f32 row-major -> x · Wᵀ (m, n).
    pub fn matmul(&self, x: &[f32], m: usize) -> Vec<f32> {
        assert!(x.len() >= m * self.k, "DequantWeight::matmul: x");
        let simd = self.simd && avx512_available();
        if simd && m > GEMV_ROWS && bf16_gemm::available() {
            return self.matmul_bf16(x, m);
        }
        let mut out = vec![0f32; m * self.n];
        for r0 in (0..m).step_by(GEMV_ROWS) {
            let rows = GEMV_ROWS.min(m - r0);
            let xs = &x[r0 * self.k..(r0 + rows) * self.k];
            let o = &mut out[r0 * self.n..(r0 + rows) * self.n];
            if simd {
                self.gemv(xs, rows, o);
            } else {
                self.matmul_scalar(xs, rows, o);
            }
        }
        out
    }

    /// The scheme written out: `sum_i W[j][i] * x[i]`, in f32 (for CPUs without AVX512 and
    /// the tests).
    pub fn matmul_scalar(&self, x: &[f32], m: usize, out: &mut [f32]) {
        let optr = SendPtr(out.as_mut_ptr());
        (0..self.n).into_par_iter().for_each(|j| {
            for r in 0..m {
                let xr = &x[r * self.k..(r + 1) * self.k];
                let acc = xr
                    .iter()
                    .enumerate()
                    .fold(0f32, |a, (i, &xv)| a + self.at(j, i) * xv);
                // SAFETY: column j of every row is written by this task alone.
                unsafe { *optr.get().add(r * self.n + j) = acc };
            }
        });
    }

    /// The AVX512 gemv over `m` (1..=4) rows.
    fn gemv(&self, x: &[f32], m: usize, out: &mut [f32]) {
        if let (Some(bias), true) = (C::DOT_BIAS, bf16_gemm::available()) {
            return self.gemv_dot(x, m, out, bias);
        }
        let groups = self.k / self.group;
        // Per row and group: offset * (sum of the even inputs, sum of the odd ones), the
        // offset's part in the lanes of each parity.
        let mut corr = vec![[0f32; 2]; m * groups];
        if C::OFFSET != 0.0 {
            for r in 0..m {
                for g in 0..groups {
                    let xs = &x[r * self.k + g * self.group..r * self.k + (g + 1) * self.group];
                    let (mut e, mut o) = (0f32, 0f32);
                    for p in xs.chunks_exact(2) {
                        e += p[0];
                        o += p[1];
                    }
                    corr[r * groups + g] = [C::OFFSET * e, C::OFFSET * o];
                }
            }
        }
        let optr = SendPtr(out.as_mut_ptr());
        let tasks = self.panels.div_ceil(GEMV_PANELS);
        (0..tasks).into_par_iter().for_each(|t| {
            let p1 = ((t + 1) * GEMV_PANELS).min(self.panels);
            for panel in t * GEMV_PANELS..p1 {
                let mut sums = [[0f32; 2 * NR]; GEMV_ROWS];
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `matmul` checked AVX512-F/BW/VL and F16C; the panel's bytes and
                // scales are in bounds; x holds m rows of k.
                unsafe {
                    x86::gemv_panel(self, panel, x, m, &corr, &mut sums)
                };
                let cols = NR.min(self.n - panel * NR);
                for (r, s) in sums.iter().enumerate().take(m) {
                    for c in 0..cols {
                        // SAFETY: columns of this panel are written by this task alone.
                        unsafe {
                            *optr.get().add(r * self.n + panel * NR + c) = s[2 * c] + s[2 * c + 1]
                        };
                    }
                }
            }
        });
    }

    /// The gemv on `vdpbf16ps` for codes with a [`Codec::DOT_BIAS`] `(bits, value)`.
    fn gemv_dot(&self, x: &[f32], m: usize, out: &mut [f32], (bits, value): (u16, f32)) {
        let k = self.k;
        // x rounded to bf16, a pair of inputs a u32 (the low half the even input).
        let mut xb = vec![0u16; m * k];
        for (dst, src) in xb.chunks_exact_mut(k).zip(x.chunks_exact(k)) {
            bf16_gemm::to_bf16(src, dst);
        }
        let pairs: Vec<u32> = xb
            .chunks_exact(2)
            .map(|p| p[0] as u32 | (p[1] as u32) << 16)
            .collect();
        // Per row and group: (offset - bias value) * sum of the rounded inputs.
        let corr: Vec<f32> = xb
            .chunks_exact(self.group)
            .map(|g| {
                let sum: f32 = g.iter().map(|&b| half::bf16::from_bits(b).to_f32()).sum();
                (C::OFFSET - value) * sum
            })
            .collect();
        let optr = SendPtr(out.as_mut_ptr());
        let tasks = self.panels.div_ceil(GEMV_PANELS);
        (0..tasks).into_par_iter().for_each(|t| {
            let p1 = ((t + 1) * GEMV_PANELS).min(self.panels);
            for panel in t * GEMV_PANELS..p1 {
                let mut sums = [[0f32; NR]; GEMV_ROWS];
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the caller checked AVX512-BF16 and the rest of the bf16 GEMM's
                // features; the panel's bytes and scales are in bounds; `pairs` holds m rows
                // of k / 2, `corr` m rows of `groups`.
                unsafe {
                    x86::gemv_dot(self, panel, &pairs, m, &corr, bits, &mut sums)
                };
                let cols = NR.min(self.n - panel * NR);
                for (r, s) in sums.iter().enumerate().take(m) {
                    // SAFETY: columns of this panel are written by this task alone.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            s.as_ptr(),
                            optr.get().add(r * self.n + panel * NR),
                            cols,
                        )
                    };
                }
            }
        });
    }

    /// Prefill: each task expands a run of panels to bf16 and multiplies every row by it.
    fn matmul_bf16(&self, x: &[f32], m: usize) -> Vec<f32> {
        let k = self.k;
        // A in bf16, rows a line longer than k (the bf16 GEMM's advice: rows not 512 bytes
        // apart share no L1 set).
        let lda = k.next_multiple_of(32) + 32;
        let mut a = AlignedU16::zeroed(m * lda);
        a.par_chunks_mut(lda)
            .zip(x.par_chunks(k))
            .for_each(|(dst, src)| bf16_gemm::to_bf16(src, &mut dst[..k]));
        let mut out = vec![0f32; m * self.n];
        let optr = SendPtr(out.as_mut_ptr());
        let panel_len = PackedB::len_for(NR, k);
        let run = (RUN_BYTES / (2 * panel_len)).clamp(1, self.panels);
        let tasks = self.panels.div_ceil(run);
        (0..tasks).into_par_iter().for_each(|t| {
            let (p0, p1) = (t * run, ((t + 1) * run).min(self.panels));
            let cols = (p1 * NR).min(self.n) - p0 * NR;
            EXPANDED.with(|buf| {
                let mut buf = buf.borrow_mut();
                if buf.len() < (p1 - p0) * panel_len {
                    buf.resize((p1 - p0) * panel_len);
                }
                for p in p0..p1 {
                    let dst = &mut buf[(p - p0) * panel_len..(p - p0 + 1) * panel_len];
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: `matmul` checked AVX512 and the bf16 GEMM's features; `dst` is
                    // one panel.
                    unsafe {
                        x86::expand_panel(self, p, dst)
                    };
                }
                let b = BView::new(&buf, cols, k).with_amx(self.amx);
                // SAFETY: A holds m rows of lda with k values; C's columns p0 * NR.. are
                // written by this task alone; the call stays on this thread.
                unsafe {
                    bf16_gemm::gemm_bf16_a(
                        m,
                        a.as_ptr(),
                        lda,
                        b,
                        optr.get().add(p0 * NR),
                        self.n,
                        false,
                        false,
                    )
                };
            });
        });
        out
    }
}

thread_local! {
    /// A prefill task's expanded panels.
    static EXPANDED: RefCell<AlignedU16> = const { RefCell::new(AlignedU16::new()) };
}

#[cfg(target_arch = "x86_64")]
// The accumulators are indexed in step with the rows and lanes.
#[allow(clippy::needless_range_loop)]
mod x86 {
    use super::{Codec, DequantWeight, GEMV_ROWS, NR, PREFETCH_AHEAD};
    use std::arch::x86_64::*;

    /// The scales of `group` of `panel` per slot, divided by the codec's vector unit: vector v
    /// holds columns 8v..8v + 8, each twice (slots 2c and 2c + 1).
    #[inline(always)]
    unsafe fn slot_scales<C: Codec>(
        w: &DequantWeight<C>,
        panel: usize,
        group: usize,
    ) -> [__m512; 4] {
        let groups = w.k / w.group;
        let s = w.scales.as_ptr().add((panel * groups + group) * NR);
        let unit = _mm512_set1_ps(1.0 / C::VEC_UNIT);
        let idx = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
        let (s0, s1) = (
            _mm512_mul_ps(_mm512_loadu_ps(s), unit),
            _mm512_mul_ps(_mm512_loadu_ps(s.add(16)), unit),
        );
        let hi = _mm512_add_epi32(idx, _mm512_set1_epi32(8));
        [
            _mm512_permutexvar_ps(idx, s0),
            _mm512_permutexvar_ps(hi, s0),
            _mm512_permutexvar_ps(idx, s1),
            _mm512_permutexvar_ps(hi, s1),
        ]
    }

    #[inline(always)]
    unsafe fn pair_ptr<C: Codec>(w: &DequantWeight<C>, panel: usize, pair: usize) -> *const u8 {
        w.codes
            .as_ptr()
            .add((panel * w.k / 2 + pair) * C::PAIR_BYTES)
    }

    /// `sums[r][slot]` for the `m` rows of x against `panel`: per slot (column, parity), the
    /// scaled sums of its inputs of that parity; a column's result is its two slots' sum.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn gemv_panel<C: Codec>(
        w: &DequantWeight<C>,
        panel: usize,
        x: &[f32],
        m: usize,
        corr: &[[f32; 2]],
        sums: &mut [[f32; 2 * NR]; GEMV_ROWS],
    ) {
        let (k, group) = (w.k, w.group);
        let groups = k / group;
        let mut fin = [[_mm512_setzero_ps(); 4]; GEMV_ROWS];
        for g in 0..groups {
            let mut acc = [[_mm512_setzero_ps(); 4]; GEMV_ROWS];
            for pair in g * group / 2..(g + 1) * group / 2 {
                let p = pair_ptr(w, panel, pair);
                _mm_prefetch::<_MM_HINT_T0>(p.add(PREFETCH_AHEAD) as *const i8);
                let q = C::slots(p);
                for r in 0..m {
                    // (x[2p], x[2p + 1]) in every pair of lanes.
                    let xp = _mm512_castsi512_ps(_mm512_set1_epi64(std::ptr::read_unaligned(
                        x.as_ptr().add(r * k + 2 * pair) as *const i64,
                    )));
                    for v in 0..4 {
                        acc[r][v] = _mm512_fmadd_ps(q[v], xp, acc[r][v]);
                    }
                }
            }
            let s = slot_scales(w, panel, g);
            for r in 0..m {
                // The offset's part, in vector units (the scales carry 1 / VEC_UNIT).
                let [ce, co] = corr[r * groups + g].map(|c| c * C::VEC_UNIT);
                let c =
                    _mm512_castsi512_ps(_mm512_set1_epi64(std::mem::transmute::<[f32; 2], i64>([
                        ce, co,
                    ])));
                for v in 0..4 {
                    fin[r][v] = _mm512_fmadd_ps(_mm512_add_ps(acc[r][v], c), s[v], fin[r][v]);
                }
            }
        }
        for r in 0..m {
            for v in 0..4 {
                _mm512_storeu_ps(sums[r].as_mut_ptr().add(16 * v), fin[r][v]);
            }
        }
    }

    /// `sums[r][c]` for the `m` rows against `panel` on `vdpbf16ps`: codes laid out as 4-bit
    /// nibbles ([`super::Int4`]: slot t in the low nibble of byte t, slot t + 32 in the high
    /// one), each 16-bit lane ORed with `bits` to the bf16 of `bias + code`; `pairs` are the
    /// rows' bf16 input pairs, `corr` per row and group the bias's and offset's part.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")]
    pub(super) unsafe fn gemv_dot<C: Codec>(
        w: &DequantWeight<C>,
        panel: usize,
        pairs: &[u32],
        m: usize,
        corr: &[f32],
        bits: u16,
        sums: &mut [[f32; NR]; GEMV_ROWS],
    ) {
        debug_assert_eq!(C::PAIR_BYTES, 32);
        let (k, group) = (w.k, w.group);
        let groups = k / group;
        let mask = _mm512_set1_epi16(0x0F);
        let bias = _mm512_set1_epi16(bits as i16);
        let mut fin = [[_mm512_setzero_ps(); 2]; GEMV_ROWS];
        for g in 0..groups {
            // Two accumulators a half (even and odd pairs), so that the dot products of one
            // row do not wait on each other.
            let mut acc = [[_mm512_setzero_ps(); 4]; GEMV_ROWS];
            for pair in g * group / 2..(g + 1) * group / 2 {
                let p = pair_ptr(w, panel, pair);
                _mm_prefetch::<_MM_HINT_T0>(p.add(PREFETCH_AHEAD) as *const i8);
                let b = _mm256_loadu_si256(p as *const __m256i);
                let words = _mm512_cvtepu8_epi16(b);
                // (w & 0x0F) | bias: columns 0..16 from the low nibbles, 16..32 the high.
                let lo: __m512bh =
                    std::mem::transmute(_mm512_ternarylogic_epi32::<0xEA>(words, mask, bias));
                let hi: __m512bh = std::mem::transmute(_mm512_ternarylogic_epi32::<0xEA>(
                    _mm512_srli_epi16::<4>(words),
                    mask,
                    bias,
                ));
                for r in 0..m {
                    let xp: __m512bh = std::mem::transmute(_mm512_set1_epi32(
                        *pairs.get_unchecked(r * k / 2 + pair) as i32,
                    ));
                    let a = 2 * (pair & 1);
                    acc[r][a] = _mm512_dpbf16_ps(acc[r][a], lo, xp);
                    acc[r][a + 1] = _mm512_dpbf16_ps(acc[r][a + 1], hi, xp);
                }
            }
            let s = w.scales.as_ptr().add((panel * groups + g) * NR);
            let (s0, s1) = (_mm512_loadu_ps(s), _mm512_loadu_ps(s.add(16)));
            for r in 0..m {
                let c = _mm512_set1_ps(corr[r * groups + g]);
                let (a0, a1) = (
                    _mm512_add_ps(acc[r][0], acc[r][2]),
                    _mm512_add_ps(acc[r][1], acc[r][3]),
                );
                fin[r][0] = _mm512_fmadd_ps(_mm512_add_ps(a0, c), s0, fin[r][0]);
                fin[r][1] = _mm512_fmadd_ps(_mm512_add_ps(a1, c), s1, fin[r][1]);
            }
        }
        for r in 0..m {
            _mm512_storeu_ps(sums[r].as_mut_ptr(), fin[r][0]);
            _mm512_storeu_ps(sums[r].as_mut_ptr().add(16), fin[r][1]);
        }
    }

    /// Panel `panel` expanded to the bf16 GEMM's packed layout in `dst`: `(v + offset) * s`
    /// (exact in f32: a short code times a bf16, f16 or f32 scale), rounded to bf16.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
    pub(super) unsafe fn expand_panel<C: Codec>(
        w: &DequantWeight<C>,
        panel: usize,
        dst: &mut [u16],
    ) {
        let pairs = w.k / 2;
        debug_assert!(dst.len() >= pairs * 64);
        let per_group = w.group / 2;
        let off = _mm512_set1_ps(C::OFFSET * C::VEC_UNIT);
        // (No closures here: they would be compiled without this function's features.)
        let mut s = [_mm512_setzero_ps(); 4];
        let mut nb = [_mm512_setzero_ps(); 4];
        for pair in 0..pairs {
            if pair.is_multiple_of(per_group) {
                s = slot_scales(w, panel, pair / per_group);
                for v in 0..4 {
                    nb[v] = _mm512_mul_ps(s[v], off);
                }
            }
            let q = C::slots(pair_ptr(w, panel, pair));
            let mut f = [_mm512_setzero_ps(); 4];
            for v in 0..4 {
                f[v] = _mm512_fmadd_ps(q[v], s[v], nb[v]);
            }
            let out = dst.as_mut_ptr().add(pair * 64);
            let lo: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(f[1], f[0]));
            let hi: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(f[3], f[2]));
            _mm512_storeu_si512(out as *mut __m512i, lo);
            _mm512_storeu_si512(out.add(32) as *mut __m512i, hi);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: u64) -> impl FnMut() -> u32 {
        let mut s = seed;
        move || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 33) as u32
        }
    }

    /// Codes (n, k) and scales (n, k / group) from a seed: every 4-bit code, or every finite
    /// e4m3 code (subnormals and both zeros included; 0x7F/0xFF are NaN).
    fn weight<C: Codec>(n: usize, k: usize, group: usize, seed: u64) -> (Vec<u8>, Vec<f32>) {
        let mut next = lcg(seed);
        let codes = (0..n * k)
            .map(|_| {
                let c = next() as u8;
                if C::PAIR_BYTES == 32 {
                    c & 0xF
                } else if c & 0x7F == 0x7F {
                    c ^ 1
                } else {
                    c
                }
            })
            .collect();
        let scales = (0..n * k / group)
            .map(|_| half::bf16::from_f32(0.001 + (next() % 1000) as f32 * 1e-5).to_f32())
            .collect();
        (codes, scales)
    }

    fn xs(m: usize, k: usize) -> Vec<f32> {
        (0..m * k)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.7)
            .collect()
    }

    /// The scheme in f64 from the loader's codes.
    fn reference<C: Codec>(
        codes: &[u8],
        scales: &[f32],
        x: &[f32],
        (m, n, k, group): (usize, usize, usize, usize),
    ) -> Vec<f64> {
        let mut out = vec![0f64; m * n];
        for r in 0..m {
            for j in 0..n {
                out[r * n + j] = (0..k)
                    .map(|i| {
                        (C::value(codes[j * k + i]) + C::OFFSET) as f64
                            * scales[j * (k / group) + i / group] as f64
                            * x[r * k + i] as f64
                    })
                    .sum();
            }
        }
        out
    }

    fn every_path_computes_the_scheme<C: Codec>() {
        // n with a partial panel, several groups, group sizes of the presets and a small one.
        for (n, k, group) in [(70, 256, 128), (64, 96, 32), (33, 64, 64), (96, 384, 128)] {
            let (codes, scales) = weight::<C>(n, k, group, n as u64);
            let w =
                DequantWeight::<C>::new(n, k, group, &codes, |r, g| scales[r * (k / group) + g]);
            let mut row = vec![0f32; k];
            w.row_f32(5, &mut row);
            for (i, v) in row.iter().enumerate() {
                let want =
                    (C::value(codes[5 * k + i]) + C::OFFSET) * scales[5 * (k / group) + i / group];
                assert_eq!(*v, want);
            }
            for m in [1, 3, 4, 5, 17, 40] {
                let x = xs(m, k);
                let want = reference::<C>(&codes, &scales, &x, (m, n, k, group));
                let scale = want.iter().fold(0f64, |a, v| a.max(v.abs()));
                let mut scalar = vec![0f32; m * n];
                w.matmul_scalar(&x, m, &mut scalar);
                let fast = w.matmul(&x, m);
                // The prefill path rounds x and the weight to bf16 (2^-9 each); the gemv of
                // 4-bit codes rounds x.
                let bf16_path = avx512_available()
                    && bf16_gemm::available()
                    && (m > GEMV_ROWS || C::DOT_BIAS.is_some());
                for (name, got, tol) in [
                    ("scalar", &scalar, 1e-5),
                    ("fast", &fast, if bf16_path { 1e-2 } else { 1e-5 }),
                ] {
                    let diff = got
                        .iter()
                        .zip(&want)
                        .fold(0f64, |a, (g, w)| a.max((*g as f64 - w).abs()));
                    assert!(
                        diff <= tol * scale,
                        "{name} n {n} k {k} group {group} m {m}: {diff} vs {scale}"
                    );
                }
            }
        }
    }

    #[test]
    fn int4_paths_compute_the_scheme() {
        every_path_computes_the_scheme::<Int4>();
    }

    #[test]
    fn fp8_paths_compute_the_scheme() {
        every_path_computes_the_scheme::<Fp8E4M3>();
    }

    #[test]
    fn fp8_codes_are_e4m3fn_values() {
        // The format's corners (OCP FP8 e4m3fn): max normal, min normal, min subnormal, signs.
        for (code, v) in [
            (0x7Eu8, 448.0f32),
            (0x08, 2f32.powi(-6)),
            (0x01, 2f32.powi(-9)),
            (0x07, 7.0 * 2f32.powi(-9)),
            (0x38, 1.0),
            (0xB8, -1.0),
            (0x80, -0.0),
            (0x00, 0.0),
        ] {
            assert_eq!(Fp8E4M3::value(code), v, "code {code:#x}");
        }
        // Every finite code as the `float8` crate (candle's) converts it.
        for code in (0..=255u8).filter(|c| c & 0x7F != 0x7F) {
            let want = vlm_model::fp8::e4m3_value(code);
            assert_eq!(
                Fp8E4M3::value(code).to_bits(),
                want.to_bits(),
                "code {code:#x}"
            );
        }
    }

    #[test]
    fn concat_stacks_the_parts() {
        let (k, group) = (128, 64);
        let (va, sa) = weight::<Int4>(64, k, group, 1);
        let (vb, sb) = weight::<Int4>(40, k, group, 2);
        let a = Int4Weight::new(64, k, group, &va, |r, g| sa[r * 2 + g]);
        let b = Int4Weight::new(40, k, group, &vb, |r, g| sb[r * 2 + g]);
        let ab = Int4Weight::concat(&[&a, &b]).unwrap();
        assert_eq!(ab.dims(), (104, k));
        let x = xs(2, k);
        let (ya, yb, yab) = (a.matmul(&x, 2), b.matmul(&x, 2), ab.matmul(&x, 2));
        for r in 0..2 {
            assert_eq!(&yab[r * 104..r * 104 + 64], &ya[r * 64..(r + 1) * 64]);
            assert_eq!(&yab[r * 104 + 64..(r + 1) * 104], &yb[r * 40..(r + 1) * 40]);
        }
        // A part ending inside a panel cannot lead.
        assert!(Int4Weight::concat(&[&b, &a]).is_none());
    }
}
