//! CPU kernels shared by the ViT and the decoder: the bf16 GEMM (AMX tiles or AVX512-BF16) and
//! the packed weight layout it reads.
pub mod amx;
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
pub mod attention_amx;
pub mod bf16_gemm;
mod candle_op;
pub(crate) mod cpu_view;
pub mod packed;
pub mod softmax;
pub mod vec;

pub use bf16_gemm::{available as bf16_dot_available, BView};
pub use candle_op::matmul_packed;
pub use packed::PackedB;
