//! The candle backend: `vlm-model`'s forward in candle's own ops, on any device candle runs
//! (the CPU; a CUDA GPU with the `cuda` feature). The generic path: no hand-written kernels,
//! every buffer per op. A device of this backend holds its own copy of the weights.
pub mod lm;
pub mod ops;
pub mod sizing;
pub mod vision;

pub use ops::CandleKernels;
