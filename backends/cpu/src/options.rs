//! The CPU backend's kernel choices: resolved once, at load, from the part's `kernels` config
//! (`auto` = the best this CPU has) and carried by the kernels that need them. Logged at start
//! and reported by `Lm.Info` / `Vision.Info` ([`CpuOptions::describe`]).
use crate::kernels::{amx, bf16_dot_available, gemv::Isa};
use vlm_compute::{ComputeError, Result};
use vlm_config::{KernelConfig, Toggle};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuOptions {
    /// bf16 weights are packed for the bf16 GEMM (AVX512-BF16: bf16 products, f32 sums — the
    /// reference's bf16 math) and every product of such a model runs on it.
    pub bf16_dot: bool,
    /// Those products on AMX tiles.
    pub amx: bool,
    /// The decode gemv's instruction set (f32/f16 weights, and bf16 ones without `bf16_dot`).
    pub gemv: Isa,
    /// ViT attention tile: query rows per task, keys per tile.
    pub attention_tiles: (usize, usize),
    /// Log the ViT engine's per-phase wall time for every run.
    pub profile: bool,
}

impl CpuOptions {
    /// Everything `auto`.
    pub fn detect() -> CpuOptions {
        CpuOptions::resolve(&KernelConfig::default()).expect("auto options always resolve")
    }

    /// The options `cfg` asks for on this CPU; `on` for something the CPU lacks is an error
    /// naming the option.
    pub fn resolve(cfg: &KernelConfig) -> Result<CpuOptions> {
        let has_bf16 = bf16_dot_available();
        let bf16_dot = match cfg.bf16_dot {
            Toggle::Auto => has_bf16,
            Toggle::Off => false,
            Toggle::On if has_bf16 => true,
            Toggle::On => {
                return Err(ComputeError::options(
                    "kernels.bf16_dot is on, but this CPU has no AVX512-BF16 (avx512f + \
                     avx512_bf16); use auto or off",
                ))
            }
        };
        let has_amx = amx::available();
        let amx = match cfg.amx {
            Toggle::Auto => has_amx && bf16_dot,
            Toggle::Off => false,
            Toggle::On if !has_amx => {
                return Err(ComputeError::options(
                    "kernels.amx is on, but this CPU has no AMX-BF16 tiles (or the kernel did \
                     not grant them); use auto or off",
                ))
            }
            Toggle::On if !bf16_dot => {
                return Err(ComputeError::options(
                    "kernels.amx is on, but kernels.bf16_dot is off: the tiles run the bf16 \
                     products",
                ))
            }
            Toggle::On => true,
        };
        let gemv = match cfg.simd {
            Toggle::Off => Isa::Scalar,
            Toggle::Auto | Toggle::On => Isa::detect(),
        };
        let [q, k] = cfg.attention_tiles;
        if q < 8 || k < 8 {
            return Err(ComputeError::options(format!(
                "kernels.attention_tiles is [{q}, {k}]; each must be at least 8"
            )));
        }
        Ok(CpuOptions {
            bf16_dot,
            amx,
            gemv,
            attention_tiles: (q as usize, k as usize),
            profile: cfg.profile,
        })
    }

    /// The choices as (what, which), for logs and `Info`.
    pub fn describe(&self) -> Vec<(String, String)> {
        let products = match (self.bf16_dot, self.amx) {
            (true, true) => "bf16-amx",
            (true, false) => "bf16-avx512",
            (false, _) => "f32",
        };
        // W8A8 products, as `CpuKernels::int8_weight` sets them up.
        let int8 =
            crate::kernels::int8_gemm::Int8Weight::kernel_name(self.gemv != Isa::Scalar, self.amx);
        // W4A16 and FP8 products, as `CpuKernels::int4_weight` and `fp8_weight` set them up.
        let weight_only =
            crate::kernels::dequant_gemm::kernel_name(self.gemv != Isa::Scalar, self.amx);
        vec![
            ("bf16_products".into(), products.into()),
            ("int8_products".into(), int8.into()),
            ("weight_only_products".into(), weight_only.into()),
            ("gemv".into(), self.gemv.name().into()),
            (
                "vit_attention_tiles".into(),
                format!("{}x{}", self.attention_tiles.0, self.attention_tiles.1),
            ),
            ("vit_profile".into(), self.profile.to_string()),
        ]
    }
}
