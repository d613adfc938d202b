//! FP8 E4M3 (OCP e4m3fn: bias 7, no infinities, 0x7F/0xFF NaN) codes of an FP8 KV cache and
//! of FP8 checkpoints' weights: f32 to a code and a code to bf16 or f32, all exact where the
//! format allows.
//!
//! [`encode`] rounds to nearest even and saturates at +-448, as `float8::F8E4M3::from_f32`
//! (`SatFinite`) does (torch's cast does not saturate: the reference script clamps first); it
//! is ours because that one converts through f64 bit by bit (a KV write converts every cached
//! value of a prefill, ~57K values a token for the 2B). The tests check both agree.

/// The largest finite e4m3fn magnitude.
pub const MAX: f32 = 448.0;

/// The bf16 bits of each code's value (every e4m3 value is a bf16 value). The NaN codes read
/// as +-480, the value their bits would have as a finite number; no writer here makes them.
pub const BF16_BITS: [u16; 256] = bf16_table();

const fn bf16_table() -> [u16; 256] {
    let mut t = [0u16; 256];
    let mut c = 0;
    while c < 256 {
        let (s, e, m) = ((c as u16 >> 7) << 15, (c as u16 >> 3) & 15, c as u16 & 7);
        t[c] = s | if e > 0 {
            // 2^(e-7) (1 + m/8): bf16 exponent e - 7 + 127, mantissa m in its top 3 bits.
            ((e + 120) << 7) | (m << 4)
        } else if m == 0 {
            0
        } else {
            // Subnormal m 2^-9: the leading bit p of m sets the exponent, the rest the mantissa.
            let p = if m >= 4 {
                2
            } else if m >= 2 {
                1
            } else {
                0
            };
            ((p + 118) << 7) | ((m ^ (1 << p)) << (7 - p))
        };
        c += 1;
    }
    t
}

/// The value of a code.
#[inline(always)]
pub fn value(code: u8) -> f32 {
    f32::from_bits((BF16_BITS[code as usize] as u32) << 16)
}

/// The code nearest `x` (ties to even), +-448 for anything larger (infinities included), a NaN
/// code for NaN.
#[inline(always)]
pub fn encode(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let a = f32::from_bits(bits & 0x7FFF_FFFF);
    let mag = if a.is_nan() {
        0x7F
    } else if a >= MAX {
        0x7E
    } else if a < 1.0 / 64.0 {
        // Subnormals and zero are multiples of 2^-9; 8 * 2^-9 is the smallest normal, code 8.
        (a * 512.0).round_ties_even() as u8
    } else {
        // A normal: round f32's 23 mantissa bits to 3, ties to even (a carry moves the
        // exponent), then rebias the exponent from 127 to 7. Under 448 it stays <= 0x7E.
        let b = a.to_bits();
        let r = b + 0x7FFFF + ((b >> 20) & 1);
        ((r >> 20) - (120 << 3)) as u8
    };
    sign | mag
}

#[cfg(test)]
mod tests {
    use super::*;
    use float8::F8E4M3;

    #[test]
    fn every_code_reads_as_the_float8_crate_reads_it() {
        for c in 0..=255u8 {
            let want = F8E4M3::from_bits(c).to_f32();
            if want.is_nan() {
                assert_eq!(value(c).abs(), 480.0, "code {c:#04x}");
                continue;
            }
            assert_eq!(value(c).to_bits(), want.to_bits(), "code {c:#04x}");
        }
    }

    #[test]
    fn encoding_matches_the_float8_crate_on_a_sweep_of_f32() {
        // Every 65,537th f32 bit pattern (both signs, every exponent), plus the edges: the
        // ties between codes, the subnormal range, saturation and the non-finite values.
        let mut xs: Vec<f32> = (0..=u32::MAX / 65_537)
            .map(|i| f32::from_bits(i * 65_537))
            .collect();
        for c in 0..=0x7Eu8 {
            let (v, next) = (value(c), value(c + 1));
            xs.extend([
                v,
                (v + next) / 2.0,
                -(v + next) / 2.0,
                v * 1.0001,
                -v * 0.9999,
            ]);
        }
        xs.extend([
            448.0,
            449.0,
            464.0,
            470.0,
            1e9,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ]);
        xs.extend([
            1.0 / 1024.0,
            3.0 / 1024.0,
            1e-30,
            -0.0,
            f32::MIN_POSITIVE / 4.0,
        ]);
        for x in xs {
            if x.is_nan() {
                assert_eq!(encode(x) & 0x7F, 0x7F, "{x}");
                continue;
            }
            let want = F8E4M3::from_f32(x).to_bits();
            assert_eq!(encode(x), want, "{x:e} ({:#010x})", x.to_bits());
        }
    }

    #[test]
    fn codes_round_trip() {
        for c in (0..=0x7Eu8).chain(0x80..=0xFE) {
            assert_eq!(encode(value(c)), c, "code {c:#04x}");
        }
    }
}
