//! Deterministic test inputs the kernels' unit tests share.

/// `len` values in [-1, 1] from an xorshift seeded by `seed` (three decimals, so sums of
/// products are exact enough to compare kernels by).
pub fn data(len: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2654435761).wrapping_add(1);
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s % 2001) as f32 / 1000.0 - 1.0
        })
        .collect()
}
