//! `dtype: auto` (the default of both parts): the compute dtype taken from the checkpoint and
//! the machine, as vLLM's `--dtype auto` takes the checkpoint's `dtype`.
//!
//! A bf16 checkpoint runs in bf16 where bf16 products are native (a CPU with AVX512-BF16, or
//! the CUDA backend). On a CPU without them the LM still keeps its bf16 weights (f32 math on
//! them: decode reads every weight per token, so half the bytes is the faster decode) and the
//! ViT runs f32 (its engine's bf16 path is the AVX512-BF16 kernel). Any other checkpoint runs
//! f32 (exact).
use crate::types::{BackendChoice, DeployConfig, Dtype};
use std::path::Path;

/// What `auto` is resolved against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DtypeFacts {
    /// The checkpoint's weight dtype as its config.json names it (`bfloat16`, `float32`, ...).
    pub checkpoint: Option<String>,
    /// The CPU has AVX512-BF16.
    pub cpu_bf16: bool,
}

impl DtypeFacts {
    /// The checkpoint's dtype from `dir/config.json` (`torch_dtype`, or `dtype` as newer
    /// transformers write it, at the top or in `text_config`).
    pub fn for_checkpoint(dir: &Path, cpu_bf16: bool) -> DtypeFacts {
        DtypeFacts {
            checkpoint: checkpoint_dtype(dir),
            cpu_bf16,
        }
    }

    fn checkpoint_is_bf16(&self) -> bool {
        matches!(self.checkpoint.as_deref(), Some("bfloat16" | "bf16"))
    }
}

fn checkpoint_dtype(dir: &Path) -> Option<String> {
    let text = std::fs::read_to_string(dir.join("config.json")).ok()?;
    let c: serde_json::Value = serde_json::from_str(&text).ok()?;
    let pick = |v: &serde_json::Value| {
        ["torch_dtype", "dtype"]
            .iter()
            .find_map(|k| v.get(*k).and_then(|d| d.as_str()).map(str::to_string))
    };
    pick(&c).or_else(|| c.get("text_config").and_then(pick))
}

impl DeployConfig {
    /// The config written out as a document that loads as the same config (what `vlm config
    /// check` prints): a part whose dtype is still `auto` says `auto`, not the f32 it reads as
    /// until resolved.
    pub fn to_document(&self) -> serde_json::Value {
        let mut v = serde_json::to_value(self).expect("a config serializes");
        if self.dtype_auto {
            v["dtype"] = "auto".into();
        }
        if self.visual.dtype_auto {
            v["visual"]["dtype"] = "auto".into();
        }
        v
    }

    /// Resolves each part whose dtype is `auto` against `facts`; returns one line per part
    /// saying what it runs and why (the services log it, `vlm up` prints it). A part whose
    /// config names a dtype keeps it.
    pub fn resolve_auto_dtype(&mut self, facts: &DtypeFacts) -> Vec<String> {
        let bf16 = facts.checkpoint_is_bf16();
        let weights = match &facts.checkpoint {
            Some(w) => format!("the checkpoint's weights are {w}"),
            None => "the checkpoint names no dtype".to_string(),
        };
        let mut lines = Vec::new();
        if self.dtype_auto {
            self.dtype = if bf16 { Dtype::Bf16 } else { Dtype::F32 };
            self.dtype_auto = false;
            let how = match (
                bf16,
                facts.cpu_bf16 || self.kernels.backend == BackendChoice::Cuda,
            ) {
                (true, true) => "bf16",
                (true, false) => "bf16 weights with f32 math (this CPU has no AVX512-BF16)",
                (false, _) => "f32",
            };
            lines.push(format!("dtype auto: LM {how} ({weights})"));
        }
        let v = &mut self.visual;
        if v.dtype_auto {
            let native = facts.cpu_bf16 || v.kernels.backend == BackendChoice::Cuda;
            v.dtype = if bf16 && native {
                Dtype::Bf16
            } else {
                Dtype::F32
            };
            v.dtype_auto = false;
            let why = if bf16 && !native {
                format!("{weights}; this CPU has no AVX512-BF16")
            } else {
                weights
            };
            lines.push(format!("dtype auto: ViT {} ({why})", v.dtype.as_str()));
        }
        lines
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(checkpoint: Option<&str>, cpu_bf16: bool) -> DtypeFacts {
        DtypeFacts {
            checkpoint: checkpoint.map(str::to_string),
            cpu_bf16,
        }
    }

    #[test]
    fn auto_takes_the_checkpoint_and_the_cpu() {
        let cases = [
            (Some("bfloat16"), true, Dtype::Bf16, Dtype::Bf16),
            (Some("bfloat16"), false, Dtype::Bf16, Dtype::F32),
            (Some("float32"), true, Dtype::F32, Dtype::F32),
            (Some("float16"), true, Dtype::F32, Dtype::F32),
            (None, true, Dtype::F32, Dtype::F32),
        ];
        for (ckpt, cpu, lm, vit) in cases {
            let mut c = DeployConfig::default_config();
            assert!(c.dtype_auto && c.visual.dtype_auto, "auto is the default");
            let lines = c.resolve_auto_dtype(&facts(ckpt, cpu));
            assert_eq!(
                (c.dtype, c.visual.dtype),
                (lm, vit),
                "{ckpt:?} {cpu}: {lines:?}"
            );
            assert_eq!(lines.len(), 2, "{lines:?}");
            assert!(!c.dtype_auto && !c.visual.dtype_auto);
        }
    }

    #[test]
    fn a_named_dtype_is_kept() {
        let mut c = DeployConfig::from_json(r#"{"dtype": "f32", "visual": {"dtype": "auto"}}"#)
            .unwrap()
            .config;
        assert!(!c.dtype_auto && c.visual.dtype_auto);
        let lines = c.resolve_auto_dtype(&facts(Some("bfloat16"), true));
        assert_eq!((c.dtype, c.visual.dtype), (Dtype::F32, Dtype::Bf16));
        assert_eq!(
            lines,
            ["dtype auto: ViT bf16 (the checkpoint's weights are bfloat16)"]
        );
    }

    #[test]
    fn the_checkpoint_dtype_is_read_at_the_top_or_in_text_config() {
        let dir = std::env::temp_dir().join(format!("vlm-dtype-auto-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (json, want) in [
            (r#"{"torch_dtype": "bfloat16"}"#, Some("bfloat16")),
            (r#"{"text_config": {"dtype": "float32"}}"#, Some("float32")),
            (r#"{"architectures": []}"#, None),
        ] {
            std::fs::write(dir.join("config.json"), json).unwrap();
            let f = DtypeFacts::for_checkpoint(&dir, false);
            assert_eq!(f.checkpoint.as_deref(), want, "{json}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
