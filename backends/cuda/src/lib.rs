//! The CUDA backend: `vlm-model`'s Qwen3-VL forward on NVIDIA GPUs through candle's CUDA
//! device, with this crate's kernels where candle has none.
//!
//! * Weights resident in their storage dtype (bf16), every linear one cuBLAS GEMM (fused
//!   q/k/v and gate/up); RMSNorm and rope in candle's fused kernels; SiLU·mul fused.
//! * Decode attention reads the paged KV cache through the block tables inside the kernel,
//!   split over the context when the batch is small (flash-decoding) — [`select`] decides the
//!   kernel and launch, [`layout`] the tables; prefill attention is cuBLAS products per block.
//! * The KV pool is allocated once at load in device memory, sized by the plan from the GPU's
//!   free memory ([`plan`], `cuMemGetInfo`).
//!
//! Everything but `gpu` is host code, built and tested without a GPU or a toolkit; `gpu` needs
//! the `cuda` feature (nvcc at build time: `scripts/cuda-toolkit.sh`).
pub mod layout;
pub mod plan;
pub mod reference;
pub mod select;
pub mod sizing;

#[cfg(feature = "cuda")]
pub mod gpu;

pub use sizing::CudaSizing;
