//! `y = x · Wᵀ` for many rows of `x` (prefill) with half-precision weights, CPU only.
//!
//! The weight is widened to f32 a tile of output rows at a time into a per-thread buffer that
//! stays in L2, and each tile is multiplied with the `gemm` crate's f32 kernel. Compared with
//! widening the whole matrix first, this never allocates a full f32 copy (tens of MB per call
//! for the 2B model, page-faulted in every time) and the widening runs on every core.
use super::ptr::SendPtr;
use half::{bf16, f16};
use std::cell::RefCell;

/// Output rows per tile: 128 rows x 2048 inputs x 4 bytes = 1 MiB, half of a Zen 4 L2.
const TILE_ROWS: usize = 128;

/// A weight element that can be widened a slice at a time.
pub(crate) trait Widen: Copy + Send + Sync + 'static {
    fn widen(src: &[Self], dst: &mut [f32]);
}

impl Widen for f16 {
    fn widen(src: &[Self], dst: &mut [f32]) {
        use half::slice::HalfFloatSliceExt;
        src.convert_to_f32_slice(dst); // F16C when the CPU has it
    }
}

impl Widen for bf16 {
    fn widen(src: &[Self], dst: &mut [f32]) {
        // bf16 is the top half of an f32: a shift, which the compiler vectorises.
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits((s.to_bits() as u32) << 16);
        }
    }
}

thread_local! {
    static TILE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// `out[r*n + j] = sum_i x[r*k + i] * w[j*k + i]`; x: (m, k) f32, w: (n, k), out: (m, n).
pub(crate) fn matmul_widening<W: Widen>(
    x: &[f32],
    m: usize,
    k: usize,
    w: &[W],
    n: usize,
    out: &mut [f32],
) {
    assert!(
        x.len() >= m * k && w.len() >= n * k && out.len() >= m * n,
        "matmul_widening: slice sizes"
    );
    let optr = SendPtr(out.as_mut_ptr());
    let tile = |t: usize| {
        let j0 = t * TILE_ROWS;
        let rows = TILE_ROWS.min(n - j0);
        TILE.with(|buf| {
            let mut buf = buf.borrow_mut();
            if buf.len() < rows * k {
                buf.resize(rows * k, 0.0);
            }
            W::widen(&w[j0 * k..(j0 + rows) * k], &mut buf[..rows * k]);
            // SAFETY: lhs is x (m, k) row-major; rhs is the tile transposed, (k, rows) with
            // column stride k; dst is out[:, j0..j0+rows] with row stride n. Tiles write
            // disjoint columns.
            unsafe {
                gemm::gemm(
                    m,
                    rows,
                    k,
                    optr.get().add(j0),
                    1,
                    n as isize,
                    false,
                    x.as_ptr(),
                    1,
                    k as isize,
                    buf.as_ptr(),
                    k as isize,
                    1,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
            }
        });
    };
    let tiles = n.div_ceil(TILE_ROWS);
    if rayon::current_num_threads() <= 1 || tiles == 1 {
        (0..tiles).for_each(tile);
    } else {
        use rayon::prelude::*;
        (0..tiles).into_par_iter().for_each(tile);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_a_plain_loop_on_rounded_weights() {
        let (m, k, n) = (19, 70, 300);
        let x: Vec<f32> = (0..m * k)
            .map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0)
            .collect();
        let wf: Vec<f32> = (0..n * k)
            .map(|i| ((i * 53) % 97) as f32 / 48.0 - 1.0)
            .collect();
        let wb: Vec<bf16> = wf.iter().map(|&v| bf16::from_f32(v)).collect();
        let wh: Vec<f16> = wf.iter().map(|&v| f16::from_f32(v)).collect();
        let mut out = vec![0f32; m * n];
        for (name, wr) in [
            ("bf16", wb.iter().map(|v| v.to_f32()).collect::<Vec<_>>()),
            ("f16", wh.iter().map(|v| v.to_f32()).collect::<Vec<_>>()),
        ] {
            if name == "bf16" {
                matmul_widening(&x, m, k, &wb, n, &mut out);
            } else {
                matmul_widening(&x, m, k, &wh, n, &mut out);
            }
            for r in 0..m {
                for j in 0..n {
                    let want: f64 = (0..k)
                        .map(|i| x[r * k + i] as f64 * wr[j * k + i] as f64)
                        .sum();
                    let got = out[r * n + j] as f64;
                    assert!(
                        (got - want).abs() < 1e-4 * (1.0 + want.abs()),
                        "{name} ({r},{j}): {got} vs {want}"
                    );
                }
            }
        }
    }
}
