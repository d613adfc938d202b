//! Every CPU kernel, in one place: the bf16 GEMM (AMX tiles or the AVX512-BF16 register tile)
//! and the packed weight layout it reads, the decode gemv, the widening prefill matmul, the
//! paged attention forms (chunked prefill, decode), the ViT's fused AMX attention, the softmax,
//! RMSNorm and the vector and elementwise passes. Which of them runs is decided once, at load, from the
//! backend's options ([`crate::CpuOptions`]); nothing here reads the environment.
pub mod aligned;
pub mod amx;
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
pub mod attention_amx;
pub mod bf16_gemm;
pub(crate) mod candle_op;
pub mod chunk_attention;
pub(crate) mod cpu_view;
pub mod decode_attention;
pub mod dequant_gemm;
pub mod e4m3;
pub mod gemv;
pub mod int8_gemm;
pub mod kquant_gemv;
pub mod packed;
pub mod peak;
pub mod ptr;
pub mod q8k_act;
pub mod quantized;
pub mod rms_norm;
pub mod softmax;
#[cfg(test)]
mod test_data;
pub mod tiled;
pub mod vec;
pub mod vit_ops;

pub use aligned::{Aligned, AlignedU16};
pub use bf16_gemm::{available as bf16_dot_available, BView};
pub use candle_op::matmul_packed;
pub use packed::PackedB;
pub use ptr::SendPtr;
