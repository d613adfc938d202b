//! Activation rows quantized to Q8_K for the k-quant decode gemvs ([`super::kquant_gemv`]):
//! per 256 values one f32 scale, 256 int8 values and the sums of each 16 of them (the min and
//! offset terms of Q4_K / Q6_K come out of those sums). Quantized once per product and shared
//! by every row slice of the weight.
//!
//! The rounding is candle's `BlockQ8K::from_float` (ggml's `quantize_row_q8_K`, with
//! `f32::round`, ties away from zero): `iscale = -127 / max`, where `max` is the value of
//! largest magnitude, `q = round(iscale * x)`, `d = 1 / iscale`. So the integer products are
//! those of candle's `k_quants::matmul` on the same weight, and the results agree with it up
//! to f32 summation order. (Which of `max` and `-max` is picked when both occur does not
//! matter: it negates `d` and every `q`, exactly.)

/// Values per superblock (ggml's `QK_K`).
pub const QK_K: usize = 256;

/// One superblock of one activation row.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub struct Q8KBlock {
    /// In [`Order`] of the weight type the rows are quantized for.
    pub qs: [i8; QK_K],
    /// Sums of the values `16 j .. 16 j + 16` in natural order.
    pub bsums: [i16; QK_K / 16],
    pub d: f32,
}

/// The order of `qs` within a superblock: the one in which the weight type's values come out
/// of a 64-byte load, so that a register of weights meets a register of activations.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Order {
    /// Values 0..256 (Q6_K).
    Natural,
    /// Q4_K's nibble order: byte `i` of each 64-byte half of `qs` (128 bytes, values
    /// `64 c .. 64 c + 64` in the low nibbles of bytes `32 c ..`, the high nibbles of the same
    /// bytes holding the next 32): `[0..32, 64..96, 32..64, 96..128]` then the same + 128.
    Q4K,
}

/// `m` rows of `k` values (k a multiple of [`QK_K`]), `k / QK_K` blocks per row.
pub struct Q8KRows {
    pub blocks: Vec<Q8KBlock>,
    pub m: usize,
    pub k: usize,
}

impl Q8KRows {
    /// `x`: (m, k) row-major.
    pub fn quantize(x: &[f32], m: usize, k: usize, order: Order) -> Q8KRows {
        assert!(
            k.is_multiple_of(QK_K) && x.len() >= m * k,
            "q8k: {m}x{k} from {} values",
            x.len()
        );
        let zero = Q8KBlock {
            qs: [0; QK_K],
            bsums: [0; QK_K / 16],
            d: 0.0,
        };
        let mut blocks = vec![zero; m * k / QK_K];
        for (xs, b) in x[..m * k].chunks_exact(QK_K).zip(blocks.iter_mut()) {
            quantize_block(xs.try_into().unwrap(), order, b);
        }
        Q8KRows { blocks, m, k }
    }

    /// The blocks of row `r`.
    pub fn row(&self, r: usize) -> &[Q8KBlock] {
        let kb = self.k / QK_K;
        &self.blocks[r * kb..(r + 1) * kb]
    }
}

/// Where value `i` (natural order) goes in `qs` for `order`.
#[inline(always)]
fn position(order: Order, i: usize) -> usize {
    match order {
        Order::Natural => i,
        Order::Q4K => {
            // i = 128 h + 64 c + 32 n + j (h: half, c: 32-byte chunk, n: nibble): the chunk's
            // bytes sit at 32 c of the half's 64-byte load, low nibbles first.
            let (h, c, n, j) = (i / 128, (i / 64) % 2, (i / 32) % 2, i % 32);
            128 * h + 64 * n + 32 * c + j
        }
    }
}

macro_rules! quantize_body {
    ($xs:ident, $order:ident, $out:ident) => {{
        let mut amax = 0f32;
        let mut max = 0f32;
        for &x in $xs.iter() {
            amax = amax.max(x.abs());
        }
        if amax > 0.0 {
            // Any value of that magnitude (see the module doc).
            max = *$xs.iter().find(|x| x.abs() == amax).unwrap();
        }
        if amax == 0.0 {
            $out.qs = [0; QK_K];
            $out.bsums = [0; QK_K / 16];
            $out.d = 0.0;
        } else {
            let iscale = -127f32 / max;
            let mut q = [0i8; QK_K];
            for (q, &x) in q.iter_mut().zip($xs.iter()) {
                *q = (iscale * x).round().clamp(-128.0, 127.0) as i8;
            }
            for (s, c) in $out.bsums.iter_mut().zip(q.chunks_exact(16)) {
                *s = c.iter().map(|&v| v as i16).sum();
            }
            match $order {
                Order::Natural => $out.qs = q,
                Order::Q4K => {
                    for (i, &v) in q.iter().enumerate() {
                        $out.qs[position(Order::Q4K, i)] = v;
                    }
                }
            }
            $out.d = 1.0 / iscale;
        }
    }};
}

/// candle's `BlockQ8K::from_float` for one block, values placed in `order`.
fn quantize_block(xs: &[f32; QK_K], order: Order, out: &mut Q8KBlock) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
        unsafe fn fast(xs: &[f32; QK_K], order: Order, out: &mut Q8KBlock) {
            quantize_body!(xs, order, out)
        }
        if super::kquant_gemv::available() {
            // SAFETY: `available` checked the features (a superset of these).
            return unsafe { fast(xs, order, out) };
        }
    }
    quantize_body!(xs, order, out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::k_quants::{BlockQ8K, GgmlType};

    #[test]
    fn matches_candles_q8k_values() {
        // Values that hit .5 ties after scaling, zeros, and a block of zeros.
        let mut x: Vec<f32> = (0..4 * QK_K)
            .map(|i| ((i * 7919 % 509) as f32 - 254.0) / 127.0)
            .collect();
        x[QK_K..2 * QK_K].fill(0.0);
        x[3 * QK_K + 5] = -3.0;
        let rows = Q8KRows::quantize(&x, 2, 2 * QK_K, Order::Natural);
        let mut theirs = vec![BlockQ8K::zeros(); 4];
        BlockQ8K::from_float(&x, &mut theirs);
        let mut want = vec![0f32; x.len()];
        BlockQ8K::to_float(&theirs, &mut want);
        for (b, (blk, want)) in rows.blocks.iter().zip(want.chunks_exact(QK_K)).enumerate() {
            for (i, (q, w)) in blk.qs.iter().zip(want).enumerate() {
                assert_eq!(blk.d * *q as f32, *w, "block {b} value {i}");
            }
            for (s, c) in blk.bsums.iter().zip(blk.qs.chunks_exact(16)) {
                assert_eq!(*s, c.iter().map(|&v| v as i16).sum::<i16>());
            }
        }
        // The Q4_K order is a permutation of the same values.
        let q4 = Q8KRows::quantize(&x, 2, 2 * QK_K, Order::Q4K);
        for (a, b) in rows.blocks.iter().zip(&q4.blocks) {
            for (i, q) in a.qs.iter().enumerate() {
                assert_eq!(*q, b.qs[position(Order::Q4K, i)]);
            }
            assert_eq!(a.bsums, b.bsums);
            assert_eq!(a.d, b.d);
        }
        let mut seen = [false; QK_K];
        for i in 0..QK_K {
            seen[position(Order::Q4K, i)] = true;
        }
        assert!(seen.iter().all(|&s| s));
    }
}
