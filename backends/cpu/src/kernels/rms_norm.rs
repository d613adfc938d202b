//! RMSNorm over rows (`Qwen3VLTextRMSNorm`): out = x / sqrt(mean(x²) + eps) * w in f32.
//!
//! The same formula as candle's `rms_norm` (what the candle backend runs), whose sum of
//! squares is one serial f32 chain per row (each add waits for the one before: a 273-token
//! prefill spent ~24 ms of its ~970 in the 2B model's norms); here 16 running sums, so the row
//! is summed at vector width. Only the summation order differs (a few ulp on the norm; the
//! reference, `hidden_states.pow(2).mean(-1)` in torch, sums in its own blocked order too).
use multiversion::multiversion;
use rayon::prelude::*;

/// Values per parallel task: below this a call stays on the calling thread (a decode step's
/// few rows).
const PAR_VALUES: usize = 16 * 1024;

/// One row: out = x / sqrt(mean(x²) + eps) * w.
#[multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512dq+avx512vl+avx2+fma",
    "x86_64+avx2+fma"
))]
pub fn rms_norm_row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let mut s = [0f32; 16];
    let mut chunks = x.chunks_exact(16);
    for c in &mut chunks {
        for i in 0..16 {
            s[i] += c[i] * c[i];
        }
    }
    let mut sum: f32 = s.iter().sum();
    sum += chunks.remainder().iter().map(|v| v * v).sum::<f32>();
    let m = (sum / x.len() as f32 + eps).sqrt();
    for ((o, &v), &wi) in out.iter_mut().zip(x).zip(w) {
        *o = v / m * wi;
    }
}

/// Every row of `x` (rows of `w.len()` values) into `out`, in parallel on the current rayon
/// pool from [`PAR_VALUES`] values on.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    assert!(
        d > 0 && x.len().is_multiple_of(d) && out.len() == x.len(),
        "rms_norm: {} values, rows of {d}, {} out",
        x.len(),
        out.len()
    );
    let rows_per_task = (PAR_VALUES / d).max(1);
    if x.len() <= PAR_VALUES {
        for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
            rms_norm_row(xr, w, eps, or);
        }
        return;
    }
    x.par_chunks(d * rows_per_task)
        .zip(out.par_chunks_mut(d * rows_per_task))
        .for_each(|(xc, oc)| {
            for (xr, or) in xc.chunks_exact(d).zip(oc.chunks_exact_mut(d)) {
                rms_norm_row(xr, w, eps, or);
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The row in f64: ours (and candle's serial f32 sum) may differ from it only by the f32
    /// rounding of the sum and of the three operations after it.
    fn exact_row(x: &[f32], w: &[f32], eps: f32) -> Vec<f64> {
        let sum2: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
        let m = (sum2 / x.len() as f64 + eps as f64).sqrt();
        x.iter()
            .zip(w)
            .map(|(&v, &wi)| v as f64 / m * wi as f64)
            .collect()
    }

    #[test]
    fn matches_the_formula_to_f32_rounding() {
        let val = |i: usize| ((i * 2654435761) % 2003) as f32 / 1001.0 - 1.0;
        // head_dim rows (q/k norm), hidden rows, an odd width (the remainder), serial and
        // parallel calls.
        for (rows, d) in [
            (3usize, 128usize),
            (300, 128),
            (5, 2048),
            (40, 2048),
            (7, 37),
        ] {
            let x: Vec<f32> = (0..rows * d).map(val).collect();
            let w: Vec<f32> = (0..d).map(|i| 0.5 + val(i + 11)).collect();
            let mut got = vec![0f32; rows * d];
            rms_norm(&x, &w, 1e-6, &mut got);
            for r in 0..rows {
                let want = exact_row(&x[r * d..(r + 1) * d], &w, 1e-6);
                for (&g, &e) in got[r * d..(r + 1) * d].iter().zip(&want) {
                    assert!(
                        (g as f64 - e).abs() <= 1e-6 * e.abs().max(1e-6),
                        "row {r} of {rows}x{d}: {g} vs {e}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_row_alone_equals_the_same_row_among_many() {
        let d = 2048;
        let x: Vec<f32> = (0..64 * d)
            .map(|i| ((i % 97) as f32 - 48.0) / 17.0)
            .collect();
        let w = vec![1.25f32; d];
        let mut all = vec![0f32; x.len()];
        rms_norm(&x, &w, 1e-6, &mut all);
        let mut one = vec![0f32; d];
        rms_norm(&x[9 * d..10 * d], &w, 1e-6, &mut one);
        assert_eq!(one, all[9 * d..10 * d]);
    }
}
