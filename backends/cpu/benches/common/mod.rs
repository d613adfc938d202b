//! What the product benches share: the 2B model's decoder shapes and the timing.
use std::time::Instant;

/// (name, n, k) of the 2B's decoder linears, q/k/v and gate/up fused as the model runs them.
pub const SHAPES: [(&str, usize, usize); 4] = [
    ("qkv", 4096, 2048),
    ("o", 2048, 2048),
    ("gate_up", 12288, 2048),
    ("down", 2048, 6144),
];

/// The best of `reps` timed calls of `f` (after one untimed), in seconds.
pub fn best<F: FnMut()>(reps: usize, mut f: F) -> f64 {
    f();
    let mut b = f64::MAX;
    for _ in 0..reps {
        let t = Instant::now();
        f();
        b = b.min(t.elapsed().as_secs_f64());
    }
    b
}
