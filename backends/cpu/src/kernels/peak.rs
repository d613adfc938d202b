//! The AVX512-BF16 product's peak on this machine, measured: `vdpbf16ps` back to back on twelve
//! independent accumulators, no loads, on every thread of the current rayon pool at once. The
//! benches print it so that a kernel's GFLOP/s reads as a share of what the cores can do right
//! now (a VM's clock moves), and the README's bounds (the fewest seconds a request's products
//! can take) are computed from it instead of from a data sheet.

/// FLOP of one loop step on one thread: 12 instructions x 16 lanes x 2 products x 2 FLOP.
const FLOP_PER_STEP: f64 = 12.0 * 16.0 * 2.0 * 2.0;
/// Steps per timed run (~10 ms at 3.6 GHz, one instruction per cycle).
const STEPS: u64 = 3_000_000;

/// GFLOP/s of back-to-back `vdpbf16ps` on all threads of the current rayon pool together (the
/// best of `runs`), or None where the CPU has no AVX512-BF16.
pub fn bf16_peak_gflops(runs: usize) -> Option<f64> {
    if !super::bf16_gemm::available() {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX512-BF16 (and AVX512F) were detected above; the loop touches only registers.
    return Some(best_rate(runs, FLOP_PER_STEP, || unsafe {
        x86::dpbf16_loop(STEPS)
    }));
    #[cfg(not(target_arch = "x86_64"))]
    None
}

/// The best of `runs` of `one` (STEPS loop steps of `per_step` operations) on every thread of
/// the pool at once, in G operations/s.
#[cfg(target_arch = "x86_64")]
fn best_rate(runs: usize, per_step: f64, one: impl Fn() + Sync) -> f64 {
    let threads = rayon::current_num_threads();
    let mut best = 0f64;
    for _ in 0..runs.max(1) {
        let t = std::time::Instant::now();
        rayon::broadcast(|_| one());
        let s = t.elapsed().as_secs_f64();
        best = best.max(STEPS as f64 * per_step * threads as f64 / s / 1e9);
    }
    best
}

/// Integer ops/s (GOP/s, a multiply and an add each) of back-to-back `vpdpbusd` (AVX512-VNNI:
/// 16 lanes x 4 u8 x s8 products) on all threads of the pool, the best of `runs`; None where
/// the CPU has no AVX512-VNNI. What the W8A8 products ([`super::int8_gemm`]) are measured
/// against.
pub fn int8_peak_gops(runs: usize) -> Option<f64> {
    if !super::int8_gemm::vnni_available() {
        return None;
    }
    // 12 instructions x 16 lanes x 4 products x 2 ops.
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX512-VNNI was detected above; the loop touches only registers.
    return Some(best_rate(runs, 12.0 * 16.0 * 4.0 * 2.0, || unsafe {
        x86::dpbusd_loop(STEPS)
    }));
    #[cfg(not(target_arch = "x86_64"))]
    None
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::asm;

    /// `steps` x 12 `vpdpbusd` on zmm0-zmm11, as [`dpbf16_loop`].
    #[target_feature(enable = "avx512f,avx512vnni")]
    pub(super) unsafe fn dpbusd_loop(steps: u64) {
        let ones = std::arch::x86_64::_mm512_set1_epi32(0x0101_0101);
        // SAFETY: registers only; the flags and zmm0-11 are declared clobbered.
        unsafe {
            asm!(
                "2:",
                "vpdpbusd zmm0, {a}, {a}",
                "vpdpbusd zmm1, {a}, {a}",
                "vpdpbusd zmm2, {a}, {a}",
                "vpdpbusd zmm3, {a}, {a}",
                "vpdpbusd zmm4, {a}, {a}",
                "vpdpbusd zmm5, {a}, {a}",
                "vpdpbusd zmm6, {a}, {a}",
                "vpdpbusd zmm7, {a}, {a}",
                "vpdpbusd zmm8, {a}, {a}",
                "vpdpbusd zmm9, {a}, {a}",
                "vpdpbusd zmm10, {a}, {a}",
                "vpdpbusd zmm11, {a}, {a}",
                "dec {n}",
                "jnz 2b",
                a = in(zmm_reg) ones,
                n = inout(reg) steps => _,
                out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _,
                out("zmm4") _, out("zmm5") _, out("zmm6") _, out("zmm7") _,
                out("zmm8") _, out("zmm9") _, out("zmm10") _, out("zmm11") _,
                options(nostack, nomem),
            );
        }
    }

    /// `steps` x 12 `vdpbf16ps` on zmm0-zmm11 (independent chains: the instruction's latency
    /// is hidden), operands in two other registers.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn dpbf16_loop(steps: u64) {
        let ones = std::arch::x86_64::_mm512_set1_epi32(0x3f80_3f80);
        // SAFETY: registers only; the flags and zmm0-11 are declared clobbered.
        unsafe {
            asm!(
                "2:",
                "vdpbf16ps zmm0, {a}, {a}",
                "vdpbf16ps zmm1, {a}, {a}",
                "vdpbf16ps zmm2, {a}, {a}",
                "vdpbf16ps zmm3, {a}, {a}",
                "vdpbf16ps zmm4, {a}, {a}",
                "vdpbf16ps zmm5, {a}, {a}",
                "vdpbf16ps zmm6, {a}, {a}",
                "vdpbf16ps zmm7, {a}, {a}",
                "vdpbf16ps zmm8, {a}, {a}",
                "vdpbf16ps zmm9, {a}, {a}",
                "vdpbf16ps zmm10, {a}, {a}",
                "vdpbf16ps zmm11, {a}, {a}",
                "dec {n}",
                "jnz 2b",
                a = in(zmm_reg) ones,
                n = inout(reg) steps => _,
                out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _,
                out("zmm4") _, out("zmm5") _, out("zmm6") _, out("zmm7") _,
                out("zmm8") _, out("zmm9") _, out("zmm10") _, out("zmm11") _,
                options(nostack, nomem),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_probe_measures_a_rate_where_the_cpu_has_the_instruction() {
        match super::bf16_peak_gflops(1) {
            Some(g) => assert!(g.is_finite() && g > 0.0, "{g}"),
            None => assert!(!super::super::bf16_gemm::available()),
        }
    }
}
