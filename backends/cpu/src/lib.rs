//! The CPU backend: Qwen3-VL on the host's cores with hand-tuned kernels.
//!
//! * [`kernels`] — every CPU kernel, in one place (bf16 GEMM on AMX or AVX512-BF16, gemv,
//!   attention forms, softmax, vector ops).
//! * [`ops::CpuKernels`] — the kernels `vlm-model`'s one forward calls (the LM runs on it:
//!   [`lm::load`]).
//! * [`vit`] — the ViT bucket engine behind the seam's `VisionBackend`, one per core.
//! * [`options::CpuOptions`] — the kernel choices, from the config's `kernels` section.
//! * [`sizing`] — what it holds, for the planner.
//!
//! A device of this backend is a core: the LM pool is one engine whose rayon threads are pinned
//! one per core by the service; the vision pool is one ViT instance (one image at a time, one
//! thread) per core, all sharing one copy of the weights.
pub mod kernels;
mod kv_raw;
pub mod lm;
pub mod ops;
pub mod options;
pub mod sizing;
pub mod step_spin;
pub mod vit;

pub use ops::{CpuKernels, CpuWeight};
pub use options::CpuOptions;
