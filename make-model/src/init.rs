//! Deterministic, fast random values for generated weights.
//!
//! Counter-based: value i of a tensor is a pure function of (seed, tensor name, i), so chunks
//! fill in parallel on any number of threads with the same result. Normal-ish values are the
//! sum of four 16-bit uniforms (Irwin–Hall, bell-shaped, bounded at ±3.46 std), one 64-bit
//! hash per value: about a nanosecond, so the 2B checkpoint's 2.1 G values take seconds.
use super::manifest::Init;
use super::WeightDtype;

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's output function.
#[inline]
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The stream key of one tensor: depends on the seed and the tensor's name only.
pub fn tensor_key(seed: u64, name: &str) -> u64 {
    // FNV-1a over the name, then mixed with the seed.
    let mut h: u64 = 0xCBF2_9CE4_8422_2325;
    for b in name.as_bytes() {
        h ^= *b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01B3);
    }
    mix(mix(seed ^ GOLDEN).wrapping_add(h))
}

/// Unit-variance, zero-mean value number `i` of stream `key`.
#[inline]
fn unit_normalish(key: u64, i: u64) -> f32 {
    let r = mix(key.wrapping_add(i.wrapping_add(1).wrapping_mul(GOLDEN)));
    let s = (r & 0xFFFF)
        .wrapping_add((r >> 16) & 0xFFFF)
        .wrapping_add((r >> 32) & 0xFFFF)
        .wrapping_add(r >> 48);
    // mean 4 * 65535/2, std 65536/sqrt(3) (four uniforms of variance 65536^2/12).
    const MEAN: f32 = 131_070.0;
    const INV_STD: f32 = 1.732_050_8 / 65_536.0;
    (s as f32 - MEAN) * INV_STD
}

/// Writes values `start..start + out.len()/dtype_size` of the tensor into `out` (little endian).
pub fn fill(out: &mut [u8], key: u64, start: u64, init: Init, dtype: WeightDtype) {
    match init {
        Init::Constant(c) => fill_with(out, dtype, start, |_| c),
        Init::Normal { std } => fill_with(out, dtype, start, |i| std * unit_normalish(key, i)),
        Init::Around { center, std } => {
            fill_with(out, dtype, start, |i| center + std * unit_normalish(key, i))
        }
    }
}

#[inline(always)]
fn fill_with(out: &mut [u8], dtype: WeightDtype, start: u64, value: impl Fn(u64) -> f32) {
    let mut i = start;
    match dtype {
        WeightDtype::F32 => {
            for o in out.chunks_exact_mut(4) {
                o.copy_from_slice(&value(i).to_le_bytes());
                i = i.wrapping_add(1);
            }
        }
        WeightDtype::F16 => {
            for o in out.chunks_exact_mut(2) {
                o.copy_from_slice(&half::f16::from_f32(value(i)).to_le_bytes());
                i = i.wrapping_add(1);
            }
        }
        WeightDtype::BF16 => {
            for o in out.chunks_exact_mut(2) {
                o.copy_from_slice(&bf16_bits(value(i)).to_le_bytes());
                i = i.wrapping_add(1);
            }
        }
    }
}

/// f32 -> bf16 with round-to-nearest-even (values here are finite: no NaN handling needed).
#[inline(always)]
fn bf16_bits(v: f32) -> u16 {
    let b = v.to_bits();
    (b.wrapping_add(0x7FFF).wrapping_add((b >> 16) & 1) >> 16) as u16
}

/// [`fill`] split over `threads` scoped threads.
pub fn fill_parallel(
    out: &mut [u8],
    key: u64,
    start: u64,
    init: Init,
    dtype: WeightDtype,
    threads: usize,
) {
    let size = dtype.size_in_bytes();
    let values = out.len() / size;
    if threads <= 1 || values < 1 << 16 {
        fill(out, key, start, init, dtype);
        return;
    }
    let per = values.div_ceil(threads);
    std::thread::scope(|s| {
        for (t, part) in out.chunks_mut(per * size).enumerate() {
            s.spawn(move || fill(part, key, start + (t * per) as u64, init, dtype));
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(key: u64, n: usize) -> Vec<f32> {
        let mut buf = vec![0u8; n * 4];
        fill(
            &mut buf,
            key,
            0,
            Init::Normal { std: 1.0 },
            WeightDtype::F32,
        );
        buf.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    #[test]
    fn unit_variance_and_zero_mean() {
        let v = values(tensor_key(0, "w"), 200_000);
        let n = v.len() as f64;
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
        let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var - 1.0).abs() < 0.02, "var {var}");
    }

    #[test]
    fn parallel_fill_matches_serial_and_keys_differ() {
        let key = tensor_key(7, "model.x.weight");
        let mut a = vec![0u8; 300_001 * 2];
        let mut b = a.clone();
        fill(&mut a, key, 5, Init::Normal { std: 0.5 }, WeightDtype::BF16);
        fill_parallel(
            &mut b,
            key,
            5,
            Init::Normal { std: 0.5 },
            WeightDtype::BF16,
            3,
        );
        assert_eq!(a, b);
        assert_ne!(tensor_key(7, "a"), tensor_key(8, "a"));
        assert_ne!(tensor_key(7, "a"), tensor_key(7, "b"));
    }

    #[test]
    fn bf16_rounding_matches_half() {
        // two exact ties (round to even: down, then up) among ordinary values
        let ties = [f32::from_bits(0x3F80_8000), f32::from_bits(0x3F81_8000)];
        for v in [0.0f32, -0.0, 1.0, 0.1, -3.3, 1e-30, 123456.7]
            .into_iter()
            .chain(ties)
        {
            assert_eq!(bf16_bits(v), half::bf16::from_f32(v).to_bits(), "{v}");
        }
    }
}
