//! Dot product and axpy on f32 slices, with 16 independent lanes so that the compiler
//! vectorises them; compiled a second time with AVX-512 and picked at run time.

macro_rules! dispatch {
    ($name:ident, $portable:ident, $fast:ident, ($($arg:ident: $ty:ty),*) -> $ret:ty) => {
        #[inline]
        pub fn $name($($arg: $ty),*) -> $ret {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                unsafe fn $fast($($arg: $ty),*) -> $ret {
                    $portable($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the feature was detected on this CPU.
                    return unsafe { $fast($($arg),*) };
                }
            }
            $portable($($arg),*)
        }
    };
}

#[inline(always)]
fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..16 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

#[inline(always)]
fn axpy_portable(y: &mut [f32], a: f32, x: &[f32]) {
    for (o, v) in y.iter_mut().zip(x) {
        *o += a * v;
    }
}

dispatch!(dot, dot_portable, dot_avx512, (a: &[f32], b: &[f32]) -> f32);
dispatch!(axpy, axpy_portable, axpy_avx512, (y: &mut [f32], a: f32, x: &[f32]) -> ());

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
}
