//! W8A8 products: int8 weights with one scale per output row (a compressed-tensors
//! `int-quantized` checkpoint's), times activation rows quantized here to int8 with one scale
//! per row (dynamic, symmetric: `scale = max|x| / 127`, `q = round_half_even(x * 127 /
//! max|x|)`, as vLLM's `dynamic_scaled_int8_quant`). The integer sums are exact, so every
//! row's result is the same whatever the row count, split or instruction set.
//!
//! On AVX512-VNNI the sums run on `vpdpbusd` (u8 x s8, four products per 32-bit lane): the
//! activations are stored offset by +128 as u8, and `128 * sum(w row)` is taken off after. The
//! weight is packed once at load in panels of 16 output rows, 4 input columns per 64-byte
//! group (the instruction's layout), so a tile of up to [`MR`] activation rows and 32 output
//! columns keeps its 16 accumulators in registers and reads each weight byte once per tile.
//! With AMX-INT8 (and the backend's `kernels.amx`), products of 16 rows or more run on
//! `tdpbusd` tiles instead ([`super::amx::int8_tiles`]): the same panels are the tiles' B
//! operand as they are (16 lines of 64 bytes per 64 input columns), the same u8 rows their A.
//! Without VNNI the same sums run in scalar code (other CPUs; exact, slow).
use super::aligned::Aligned;
use super::ptr::SendPtr;
use rayon::prelude::*;

/// Output rows per panel (one zmm of i32 sums).
const NR: usize = 16;
/// Panels per tile: 32 output columns.
const PANELS: usize = 2;
/// Activation rows per register tile.
const MR: usize = 8;
/// Output columns per parallel task.
const STRIP: usize = NR * PANELS;
/// Input columns are padded to this (zeros): one AMX tile step.
const K_ALIGN: usize = 64;
/// AMX: rows from which the tiles run (a tile step takes 16 rows: fewer would be padded,
/// and decode rows are bound by streaming the weight, which the VNNI tile does), rows per
/// tile group, bytes of A rows per block (each strip of B is read from memory once per block,
/// then from L2 by every group of it), strips per task. The block and task sizes were chosen,
/// not tuned (the tries recorded in docs/performance.md moved nothing).
const AMX_MIN_ROWS: usize = 16;
const AMX_GROUP: usize = 32;
const AMX_A_BLOCK_BYTES: usize = 768 << 10;
const AMX_STRIPS_PER_TASK: usize = 4;

/// An int8 (n, k) weight packed for [`Int8Weight::matmul`].
#[derive(Debug)]
pub struct Int8Weight {
    n: usize,
    k: usize,
    /// `k` rounded up to [`K_ALIGN`] (zero columns).
    kp: usize,
    /// Panels of [`NR`] rows (`n` rounded up to [`STRIP`] with zero rows): for each group of 4
    /// input columns, 16 rows x 4 bytes; on cache lines (a 64-byte load off a line reads two).
    panels: Aligned<i8>,
    /// Per output row: the channel scale and the sum of the row's values.
    scales: Vec<f32>,
    sums: Vec<i32>,
    vnni: bool,
    /// Products of [`AMX_MIN_ROWS`] rows or more on AMX-INT8 tiles.
    amx: bool,
}

/// Whether this CPU runs the `vpdpbusd` path.
pub fn vnni_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

impl Int8Weight {
    /// Packs row-major (n, k) `values` with per-row `scales`.
    pub fn new(n: usize, k: usize, values: &[i8], scales: &[f32]) -> Int8Weight {
        assert_eq!(values.len(), n * k, "int8 weight values");
        assert_eq!(scales.len(), n, "int8 weight scales");
        let kp = k.next_multiple_of(K_ALIGN);
        let kq = kp / 4;
        let np = n.next_multiple_of(STRIP);
        let mut panels = Aligned::<i8>::zeroed(np * kp);
        for r in 0..n {
            let (p, lane) = (r / NR, r % NR);
            for (c, &v) in values[r * k..(r + 1) * k].iter().enumerate() {
                panels[(p * kq + c / 4) * 64 + lane * 4 + c % 4] = v;
            }
        }
        let sums = (0..n)
            .map(|r| values[r * k..(r + 1) * k].iter().map(|&v| v as i32).sum())
            .collect();
        Int8Weight {
            n,
            k,
            kp,
            panels,
            scales: scales.to_vec(),
            sums,
            vnni: vnni_available(),
            amx: false,
        }
    }

    /// `false`: the scalar sums even where VNNI is (the backend's `kernels.simd: off`, tests).
    pub fn with_simd(mut self, on: bool) -> Self {
        self.vnni = on && vnni_available();
        self
    }

    /// `true`: products of [`AMX_MIN_ROWS`] rows or more on AMX-INT8 tiles where the CPU has
    /// them (the backend's `kernels.amx`); the same sums, exactly.
    pub fn with_amx(mut self, on: bool) -> Self {
        self.amx = on && super::amx::int8_available();
        self
    }

    /// Whether products of many rows run on AMX tiles.
    pub fn amx(&self) -> bool {
        self.amx
    }

    /// The product [`Self::with_simd`] and [`Self::with_amx`] with these switches select on
    /// this CPU, for logs and `Info`: `int8-amx` (16 rows or more on tiles), `int8-vnni` or
    /// `int8-scalar`.
    pub fn kernel_name(simd: bool, amx: bool) -> &'static str {
        if amx && super::amx::int8_available() {
            "int8-amx"
        } else if simd && vnni_available() {
            "int8-vnni"
        } else {
            "int8-scalar"
        }
    }

    /// (n, k).
    pub fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    /// `parts` (same k, each n a multiple of 32) as one weight, their rows stacked in order;
    /// `None` otherwise.
    pub fn concat(parts: &[&Int8Weight]) -> Option<Int8Weight> {
        let first = parts.first()?;
        if parts.iter().any(|p| {
            p.k != first.k
                || !p.n.is_multiple_of(STRIP)
                || (p.vnni, p.amx) != (first.vnni, first.amx)
        }) {
            return None;
        }
        let mut panels = Aligned::<i8>::zeroed(parts.iter().map(|p| p.panels.len()).sum());
        let mut at = 0;
        for p in parts {
            panels[at..at + p.panels.len()].copy_from_slice(&p.panels);
            at += p.panels.len();
        }
        Some(Int8Weight {
            n: parts.iter().map(|p| p.n).sum(),
            k: first.k,
            kp: first.kp,
            panels,
            scales: parts
                .iter()
                .flat_map(|p| p.scales.iter().copied())
                .collect(),
            sums: parts.iter().flat_map(|p| p.sums.iter().copied()).collect(),
            vnni: first.vnni,
            amx: first.amx,
        })
    }

    /// Value (r, c).
    fn value(&self, r: usize, c: usize) -> i8 {
        self.panels[((r / NR) * (self.kp / 4) + c / 4) * 64 + (r % NR) * 4 + c % 4]
    }

    /// Row `r` in floats (`value * scale`).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        for (c, o) in out.iter_mut().enumerate().take(self.k) {
            *o = self.value(r, c) as f32 * self.scales[r];
        }
    }

    /// `x` (m, k) row-major -> (m, n): each row quantized to int8 with its own scale, exact
    /// integer sums, `sum * (row scale * channel scale)`.
    pub fn matmul(&self, x: &[f32], m: usize) -> Vec<f32> {
        assert_eq!(x.len(), m * self.k, "int8 matmul input");
        let amx = self.amx && m >= AMX_MIN_ROWS;
        // The tiles read whole groups of 16 rows: the padding rows are zeros (128 as u8).
        let rows = if amx { m.next_multiple_of(16) } else { m };
        let a = QuantizedRows::new(x, m, rows, self.k, self.kp, self.vnni);
        let mut out = vec![0f32; m * self.n];
        if amx {
            self.matmul_amx(&a, m, &mut out);
            return out;
        }
        let optr = SendPtr(out.as_mut_ptr());
        let strips = self.n.div_ceil(STRIP);
        // Decode rows stream the weight: runs of strips, 8 per thread (a task per strip
        // streamed the 2B's 2048x2048 o_proj at 37 GB/s, runs at 43; 2 runs per thread let
        // one slow vCPU hold the step); prefill tiles are compute-bound: a task per strip
        // balances best.
        let per = if m <= 4 {
            strips.div_ceil(8 * rayon::current_num_threads())
        } else {
            1
        };
        (0..strips.div_ceil(per)).into_par_iter().for_each(|task| {
            let o = optr;
            for s in task * per..((task + 1) * per).min(strips) {
                for m0 in (0..m).step_by(MR) {
                    let mr = MR.min(m - m0);
                    let mut acc = [[0i32; STRIP]; MR];
                    self.tile(&a, m0, mr, s, &mut acc);
                    // SAFETY: each strip's columns [s * STRIP, (s + 1) * STRIP) are written by
                    // one task only.
                    unsafe { self.store(&a, m0, &acc[..mr], s, o.get()) };
                }
            }
        });
        out
    }

    /// [`Self::matmul`] on AMX tiles: tasks of a block of rows by a run of strips; in a task,
    /// each strip against every 32-row group of the block (the strip stays in L2).
    fn matmul_amx(&self, a: &QuantizedRows, m: usize, out: &mut [f32]) {
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        {
            let kq = self.kp / 4;
            let chunks = self.kp / K_ALIGN;
            let strips = self.n.div_ceil(STRIP);
            let max_rows = (AMX_A_BLOCK_BYTES / self.kp).max(AMX_GROUP) / AMX_GROUP * AMX_GROUP;
            let blocks = m.div_ceil(max_rows);
            let block_rows = m.div_ceil(blocks).next_multiple_of(AMX_GROUP);
            let blocks = m.div_ceil(block_rows);
            let runs = strips.div_ceil(AMX_STRIPS_PER_TASK);
            let optr = SendPtr(out.as_mut_ptr());
            (0..blocks * runs).into_par_iter().for_each(|t| {
                let o = optr;
                let (blk, run) = (t / runs, t % runs);
                let (r0, r1) = (blk * block_rows, ((blk + 1) * block_rows).min(m));
                #[repr(C, align(64))]
                struct Sums([[i32; STRIP]; AMX_GROUP]);
                let mut sums = Sums([[0; STRIP]; AMX_GROUP]);
                // SAFETY: `int8_available` held at `with_amx`.
                unsafe { super::amx::configure() };
                let s_end = ((run + 1) * AMX_STRIPS_PER_TASK).min(strips);
                for s in run * AMX_STRIPS_PER_TASK..s_end {
                    let panel = self.panels[s * PANELS * kq * 64..].as_ptr();
                    for g in (r0..r1).step_by(AMX_GROUP) {
                        let groups = if r1 - g > 16 { 2 } else { 1 };
                        // SAFETY: rows g..g + 16 * groups are inside the padded rows (g is a
                        // multiple of 32, the rows a multiple of 16 past r1 - 1); both panels
                        // hold `chunks` chunks; `sums` holds 32 rows of 32.
                        unsafe {
                            super::amx::int8_tiles(
                                groups,
                                chunks,
                                a.data[g * self.kp..].as_ptr(),
                                self.kp,
                                panel,
                                kq * 64,
                                sums.0.as_mut_ptr() as *mut i32,
                                STRIP,
                                g == r0,
                            );
                            // SAFETY: this task alone writes strip s's columns of these rows.
                            self.store(a, g, &sums.0[..AMX_GROUP.min(r1 - g)], s, o.get());
                        }
                    }
                }
            });
        }
        #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
        unreachable!("AMX off this platform: {a:p} {m} {out:p}");
    }

    fn tile(
        &self,
        a: &QuantizedRows,
        m0: usize,
        mr: usize,
        s: usize,
        acc: &mut [[i32; STRIP]; MR],
    ) {
        let kq = self.kp / 4;
        let panel = &self.panels[s * PANELS * kq * 64..(s + 1) * PANELS * kq * 64];
        let rows = &a.data[m0 * self.kp..(m0 + mr) * self.kp];
        #[cfg(target_arch = "x86_64")]
        if self.vnni {
            // SAFETY: VNNI checked at construction; slices cover what the tile reads.
            unsafe { x86::tile(rows, self.kp, mr, panel, kq, acc) };
            return;
        }
        for (i, row) in rows.chunks_exact(self.kp).enumerate() {
            for t in 0..kq {
                for (pi, p) in panel.chunks_exact(kq * 64).enumerate() {
                    let w = &p[t * 64..(t + 1) * 64];
                    for lane in 0..NR {
                        let mut sum = 0i32;
                        for j in 0..4 {
                            sum += row[t * 4 + j] as i32 * w[lane * 4 + j] as i32;
                        }
                        acc[i][pi * NR + lane] += sum;
                    }
                }
            }
        }
    }

    /// Rows `m0..m0 + acc.len()` of strip `s`: the sums corrected for the +128 offset and
    /// scaled, into `out`.
    ///
    /// # Safety
    /// `out` points to (m, n) f32, those rows are < m, and no other task writes strip `s`'s
    /// columns of them.
    unsafe fn store(
        &self,
        a: &QuantizedRows,
        m0: usize,
        acc: &[[i32; STRIP]],
        s: usize,
        out: *mut f32,
    ) {
        let c0 = s * STRIP;
        let width = STRIP.min(self.n - c0);
        let (sums, scales) = (&self.sums[c0..c0 + width], &self.scales[c0..c0 + width]);
        #[cfg(target_arch = "x86_64")]
        if self.vnni && width == STRIP {
            for (i, row) in acc.iter().enumerate() {
                let r = m0 + i;
                // SAFETY: AVX512 checked at construction (VNNI implies it); r < m and the
                // strip's 32 columns are inside `out`.
                unsafe { x86::store_row(row, sums, scales, a.scales[r], out.add(r * self.n + c0)) };
            }
            return;
        }
        for (i, row) in acc.iter().enumerate() {
            let r = m0 + i;
            let sa = a.scales[r];
            // SAFETY: r < m, c0 + width <= n: inside `out`.
            let o = unsafe { std::slice::from_raw_parts_mut(out.add(r * self.n + c0), width) };
            for (((o, &sum), &ws), &w) in o.iter_mut().zip(row).zip(sums).zip(scales) {
                // The activations were stored + 128: take off 128 * sum(w row).
                *o = (sum - 128 * ws) as f32 * (sa * w);
            }
        }
    }
}

/// Activation rows as u8 (`q + 128`), `kp` per row on cache lines (the tiles' A), with
/// their scales; rows past the input's are zeros (128).
struct QuantizedRows {
    data: Aligned<u8>,
    scales: Vec<f32>,
}

impl QuantizedRows {
    fn new(x: &[f32], m: usize, rows: usize, k: usize, kp: usize, simd: bool) -> QuantizedRows {
        let mut data = Aligned::<u8>::zeroed(rows * kp);
        data.fill(128);
        let mut scales = vec![0f32; m];
        let one = |((row, out), scale): ((&[f32], &mut [u8]), &mut f32)| {
            *scale = quantize_row(row, &mut out[..k], simd);
        };
        // A decode row is not worth waking the other threads for.
        if m >= 8 {
            x.par_chunks_exact(k)
                .zip(data.par_chunks_exact_mut(kp))
                .zip(scales.par_iter_mut())
                .for_each(one);
        } else {
            x.chunks_exact(k)
                .zip(data.chunks_exact_mut(kp))
                .zip(scales.iter_mut())
                .for_each(one);
        }
        QuantizedRows { data, scales }
    }
}

/// One activation row -> `out` (u8, offset by 128); returns the row's scale. vLLM's
/// `dynamic_scaled_int8_quant`: `scale = max|x| / 127`, `q = round_half_even(x * (127 /
/// max|x|))`; a zero row has scale 0, a row with a NaN or infinity scale NaN (its outputs NaN,
/// as the float product's would be).
fn quantize_row(row: &[f32], out: &mut [u8], simd: bool) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if simd && row.len().is_multiple_of(16) {
        // SAFETY: `simd` is only set where AVX512 was detected; lengths checked.
        if let Some(s) = unsafe { x86::quantize_row(row, out) } {
            return s;
        }
    }
    let amax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
    if amax == 0.0 || !amax.is_finite() || row.iter().any(|v| v.is_nan()) {
        out.fill(128);
        return if amax == 0.0 { 0.0 } else { f32::NAN };
    }
    let inv = 127.0 / amax;
    for (o, v) in out.iter_mut().zip(row) {
        let q = (v * inv).round_ties_even().clamp(-128.0, 127.0) as i32;
        *o = (q + 128) as u8;
    }
    amax / 127.0
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{MR, NR, PANELS, STRIP};
    use std::arch::x86_64::*;

    /// [`super::quantize_row`] in 16-lane steps (`vcvtps2dq` rounds half to even, as the
    /// scalar code); `None` for a row with a NaN, an infinity or only zeros (the scalar code
    /// handles those).
    ///
    /// # Safety
    /// The CPU has AVX512F; `row.len()` is a multiple of 16 and `out` as long.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn quantize_row(row: &[f32], out: &mut [u8]) -> Option<f32> {
        debug_assert!(row.len().is_multiple_of(16) && out.len() >= row.len());
        let mut vmax = _mm512_setzero_ps();
        let mut unordered = 0u16;
        for c in row.chunks_exact(16) {
            // SAFETY: 16 f32 in `c`.
            let v = unsafe { _mm512_loadu_ps(c.as_ptr()) };
            unordered |= _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
            vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
        }
        let amax = _mm512_reduce_max_ps(vmax);
        if unordered != 0 || amax == 0.0 || !amax.is_finite() {
            return None;
        }
        let inv = _mm512_set1_ps(127.0 / amax);
        let (lo, hi, off) = (
            _mm512_set1_epi32(-128),
            _mm512_set1_epi32(127),
            _mm512_set1_epi32(128),
        );
        for (c, o) in row.chunks_exact(16).zip(out.chunks_exact_mut(16)) {
            // SAFETY: 16 values in and out.
            unsafe {
                let q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(c.as_ptr()), inv));
                let q = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(q, lo), hi), off);
                _mm_storeu_si128(o.as_mut_ptr() as *mut __m128i, _mm512_cvtepi32_epi8(q));
            }
        }
        Some(amax / 127.0)
    }

    /// [`super::Int8Weight::store`]'s row of 32 sums in two 16-lane steps, the same operations
    /// in the same order (`vcvtdq2ps` rounds as `as f32`), so the same bits.
    ///
    /// # Safety
    /// The CPU has AVX512F; `sums` and `scales` hold 32 values, `out` 32 writable f32.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn store_row(
        row: &[i32; STRIP],
        sums: &[i32],
        scales: &[f32],
        sa: f32,
        out: *mut f32,
    ) {
        debug_assert!(sums.len() >= STRIP && scales.len() >= STRIP);
        let (off, sa) = (_mm512_set1_epi32(128), _mm512_set1_ps(sa));
        for h in 0..2 {
            // SAFETY: 16 values at 16 * h of each operand (see the contract).
            unsafe {
                let sum = _mm512_loadu_si512(row[16 * h..].as_ptr() as *const _);
                let ws = _mm512_loadu_si512(sums[16 * h..].as_ptr() as *const _);
                let exact = _mm512_sub_epi32(sum, _mm512_mullo_epi32(off, ws));
                let scale = _mm512_mul_ps(sa, _mm512_loadu_ps(scales[16 * h..].as_ptr()));
                let v = _mm512_mul_ps(_mm512_cvtepi32_ps(exact), scale);
                _mm512_storeu_ps(out.add(16 * h), v);
            }
        }
    }

    /// The register tile: `mr` rows of `a` (u8, stride `kp`) times the two panels of
    /// `panel`, sums into `acc`.
    ///
    /// # Safety
    /// The CPU has AVX512F/BW/VNNI; `a` holds `mr * kp` bytes, `panel` 2 * `kq` * 64.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn tile(
        a: &[u8],
        kp: usize,
        mr: usize,
        panel: &[i8],
        kq: usize,
        acc: &mut [[i32; STRIP]; MR],
    ) {
        match mr {
            1 => unsafe { tile_n::<1>(a, kp, panel, kq, acc) },
            2 => unsafe { tile_n::<2>(a, kp, panel, kq, acc) },
            3 => unsafe { tile_n::<3>(a, kp, panel, kq, acc) },
            4 => unsafe { tile_n::<4>(a, kp, panel, kq, acc) },
            5 => unsafe { tile_n::<5>(a, kp, panel, kq, acc) },
            6 => unsafe { tile_n::<6>(a, kp, panel, kq, acc) },
            7 => unsafe { tile_n::<7>(a, kp, panel, kq, acc) },
            _ => unsafe { tile_n::<8>(a, kp, panel, kq, acc) },
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn tile_n<const R: usize>(
        a: &[u8],
        kp: usize,
        panel: &[i8],
        kq: usize,
        acc: &mut [[i32; STRIP]; MR],
    ) {
        debug_assert!(a.len() >= R * kp && panel.len() >= PANELS * kq * 64);
        let mut c0 = [_mm512_setzero_si512(); R];
        let mut c1 = [_mm512_setzero_si512(); R];
        // Few rows (decode): a second set of sums over every other group of 4 columns, so
        // that 4R chains hide `vpdpbusd`'s latency and more weight loads are in flight.
        let mut d0 = [_mm512_setzero_si512(); R];
        let mut d1 = [_mm512_setzero_si512(); R];
        let (ap, p0) = (a.as_ptr(), panel.as_ptr());
        let p1 = unsafe { p0.add(kq * 64) };
        let step = |t: usize, c0: &mut [__m512i; R], c1: &mut [__m512i; R]| {
            // SAFETY: t < kq, within both panels and every row (see the contract).
            unsafe {
                let w0 = _mm512_loadu_si512(p0.add(t * 64) as *const _);
                let w1 = _mm512_loadu_si512(p1.add(t * 64) as *const _);
                for i in 0..R {
                    let q = (ap.add(i * kp + t * 4) as *const i32).read_unaligned();
                    let x = _mm512_set1_epi32(q);
                    c0[i] = _mm512_dpbusd_epi32(c0[i], x, w0);
                    c1[i] = _mm512_dpbusd_epi32(c1[i], x, w1);
                }
            }
        };
        let mut t = 0;
        if R <= 4 {
            while t + 2 <= kq {
                step(t, &mut c0, &mut c1);
                step(t + 1, &mut d0, &mut d1);
                t += 2;
            }
        }
        while t < kq {
            step(t, &mut c0, &mut c1);
            t += 1;
        }
        if R <= 4 {
            for i in 0..R {
                c0[i] = _mm512_add_epi32(c0[i], d0[i]);
                c1[i] = _mm512_add_epi32(c1[i], d1[i]);
            }
        }
        for i in 0..R {
            // SAFETY: acc[i] holds 2 * NR i32.
            unsafe {
                _mm512_storeu_si512(acc[i].as_mut_ptr() as *mut _, c0[i]);
                _mm512_storeu_si512(acc[i][NR..].as_mut_ptr() as *mut _, c1[i]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: u64) -> impl FnMut() -> f32 {
        let mut s = seed;
        move || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
        }
    }

    /// The scheme written out: per-row int8 of x, exact integer sums, the two scales.
    fn reference(x: &[f32], m: usize, k: usize, w: &[i8], ws: &[f32], n: usize) -> Vec<f32> {
        let mut out = vec![0f32; m * n];
        for r in 0..m {
            let row = &x[r * k..(r + 1) * k];
            let amax = row.iter().fold(0f32, |a, v| a.max(v.abs()));
            let (q, s): (Vec<i64>, f32) = if amax == 0.0 {
                (vec![0; k], 0.0)
            } else {
                let inv = 127.0 / amax;
                (
                    row.iter()
                        .map(|v| (v * inv).round_ties_even().clamp(-128.0, 127.0) as i64)
                        .collect(),
                    amax / 127.0,
                )
            };
            for c in 0..n {
                let sum: i64 = (0..k).map(|j| q[j] * w[c * k + j] as i64).sum();
                out[r * n + c] = sum as i32 as f32 * (s * ws[c]);
            }
        }
        out
    }

    fn case(m: usize, n: usize, k: usize, simd: bool, amx: bool) {
        let mut g = lcg((m * 1000 + n * 10 + k) as u64);
        let x: Vec<f32> = (0..m * k).map(|_| g() * 3.0).collect();
        let w: Vec<i8> = (0..n * k).map(|_| (g() * 127.5) as i8).collect();
        let ws: Vec<f32> = (0..n).map(|_| (g().abs() + 0.1) * 0.01).collect();
        let packed = Int8Weight::new(n, k, &w, &ws).with_simd(simd).with_amx(amx);
        assert_eq!(packed.amx(), amx);
        let got = packed.matmul(&x, m);
        let want = reference(&x, m, k, &w, &ws, n);
        assert_eq!(got, want, "m {m} n {n} k {k} simd {simd} amx {amx}");
    }

    #[test]
    fn amx_tiles_equal_the_scheme_exactly() {
        if !crate::kernels::amx::int8_available() {
            vlm_test_support::skip!("no AMX-INT8 tiles on this CPU");
            return;
        }
        // Row counts around the tile groups (16, 32) and past a block; k with and without a
        // partial 64-column step; n with a partial strip.
        for (m, n, k) in [
            (16, 32, 64),
            (17, 48, 130),
            (33, 64, 256),
            (48, 96, 2048),
            (70, 70, 192),
            (400, 64, 2048),
        ] {
            case(m, n, k, true, true);
        }
        assert_eq!(Int8Weight::kernel_name(true, true), "int8-amx");
        // A row alone (the VNNI tile) equals the same row among 40 (the AMX tiles).
        let (m, n, k) = (40, 64, 320);
        let mut g = lcg(3);
        let x: Vec<f32> = (0..m * k).map(|_| g()).collect();
        let w: Vec<i8> = (0..n * k).map(|_| (g() * 100.0) as i8).collect();
        let p = Int8Weight::new(n, k, &w, &vec![0.02f32; n]).with_amx(true);
        let all = p.matmul(&x, m);
        for r in [0, 17, 39] {
            assert_eq!(p.matmul(&x[r * k..(r + 1) * k], 1), all[r * n..(r + 1) * n]);
        }
    }

    #[test]
    fn products_equal_the_scheme_exactly_at_every_shape() {
        for simd in [false, true] {
            for (m, n, k) in [
                (1, 32, 64),
                (1, 48, 130),
                (3, 64, 256),
                (8, 96, 64),
                (9, 32, 100),
                (17, 70, 2048),
            ] {
                case(m, n, k, simd, false);
            }
        }
    }

    #[test]
    fn a_row_alone_equals_the_same_row_in_a_batch() {
        let (m, n, k) = (12, 64, 192);
        let mut g = lcg(7);
        let x: Vec<f32> = (0..m * k).map(|_| g()).collect();
        let w: Vec<i8> = (0..n * k).map(|_| (g() * 100.0) as i8).collect();
        let ws = vec![0.02f32; n];
        let p = Int8Weight::new(n, k, &w, &ws);
        let all = p.matmul(&x, m);
        for r in 0..m {
            assert_eq!(p.matmul(&x[r * k..(r + 1) * k], 1), all[r * n..(r + 1) * n]);
        }
    }

    #[test]
    fn zero_and_nan_rows_on_both_paths() {
        let (n, k) = (32, 64);
        let w: Vec<i8> = (0..n * k).map(|i| (i % 97) as i8 - 48).collect();
        for simd in [false, true] {
            let p = Int8Weight::new(n, k, &w, &[0.1; 32]).with_simd(simd);
            let mut x = vec![0f32; 2 * k];
            x[k + 5] = f32::NAN;
            x[k + 6] = 1.0;
            let y = p.matmul(&x, 2);
            assert!(y[..n].iter().all(|v| *v == 0.0), "simd {simd}: {y:?}");
            assert!(y[n..].iter().all(|v| v.is_nan()), "simd {simd}: {y:?}");
        }
    }

    #[test]
    fn zero_rows_and_concat_and_rows_read_back() {
        let (n, k) = (32, 8);
        let w: Vec<i8> = (0..n * k).map(|i| (i % 251) as i8).collect();
        let ws: Vec<f32> = (0..n).map(|i| 0.5 + i as f32).collect();
        let a = Int8Weight::new(n, k, &w, &ws);
        assert_eq!(a.matmul(&[0.0; 8], 1), vec![0.0; n]);
        let b = Int8Weight::new(n, k, &w, &ws);
        let ab = Int8Weight::concat(&[&a, &b]).unwrap();
        assert_eq!(ab.dims(), (64, 8));
        let x: Vec<f32> = (0..k).map(|i| i as f32 - 3.0).collect();
        let one = a.matmul(&x, 1);
        assert_eq!(ab.matmul(&x, 1), [one.clone(), one].concat());
        let mut row = vec![0f32; k];
        ab.row_f32(33, &mut row);
        let want: Vec<f32> = w[k..2 * k].iter().map(|&v| v as f32 * ws[1]).collect();
        assert_eq!(row, want);
        assert!(Int8Weight::concat(&[&Int8Weight::new(3, k, &w[..3 * k], &ws[..3])]).is_none());
    }
}
