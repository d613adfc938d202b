//! From a generic document (JSON, YAML or TOML, read into a `serde_json::Value`) to a
//! [`DeployConfig`]: unknown keys, both spellings, types and ranges. Cross-field rules are in
//! `rules.rs`.
use crate::error::ConfigError;
use crate::geometry::{DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS};
use crate::keys::{canonical, suggest, LM_KEYS, VISUAL_KEYS};
use crate::types::{DeployConfig, Dtype, KvCacheDtype, Oversize, VisualConfig};
use serde_json::{Map, Value};

/// Devices one part (LM or ViT) may list: more than any node holds, few enough to list.
pub const MAX_DEVICES: u32 = 4096;

mod kernels;

pub use kernels::MIN_ATTENTION_TILE;

/// Defaults of the top level. They suit the embedded tiny checkpoint; production configs set
/// their own.
pub const DEFAULT_MAX_SEQ_LEN: u32 = 4096;
pub const DEFAULT_KVCACHE_PARTITION_LEN: u32 = 1024;
pub const DEFAULT_BATCH_SIZE: u32 = 1;
pub const DEFAULT_PREFILL_CHUNK_SIZE: u32 = 128;
/// Default ViT buckets (raw patches): 512x512, 1024x1024 and 2048x2048 images.
pub const DEFAULT_VIT_BUCKETS: [u32; 3] = [1024, 4096, 16384];

/// A section with its keys resolved to canonical names.
pub(crate) struct Section<'a> {
    prefix: &'static str,
    map: Vec<(&'static str, &'a Value)>,
}

impl<'a> Section<'a> {
    /// Checks every key against `known` (accepting older spellings), refusing unknown keys and
    /// a key given under both spellings.
    pub(crate) fn new(
        prefix: &'static str,
        obj: &'a Map<String, Value>,
        known: &[&'static str],
    ) -> Result<Self, ConfigError> {
        let mut map: Vec<(&'static str, &'a Value)> = Vec::new();
        let mut spelled: Vec<(&'static str, &'a str)> = Vec::new();
        for (key, value) in obj {
            let canon = canonical(key);
            let Some(&k) = known.iter().find(|k| **k == canon) else {
                return Err(ConfigError::UnknownKey {
                    key: format!("{prefix}{key}"),
                    suggestion: suggest(key, known).map(|s| format!("{prefix}{s}")),
                });
            };
            if let Some((_, first)) = spelled.iter().find(|(c, _)| *c == k) {
                return Err(ConfigError::invalid(
                    &format!("{prefix}{key}"),
                    value,
                    format!("given twice, as `{prefix}{first}` and `{prefix}{key}`; keep only `{prefix}{k}`"),
                ));
            }
            spelled.push((k, key.as_str()));
            map.push((k, value));
        }
        Ok(Section { prefix, map })
    }

    fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.iter().find(|(k, _)| *k == key).map(|(_, v)| *v)
    }

    fn path(&self, key: &str) -> String {
        format!("{}{}", self.prefix, key)
    }

    fn uint(&self, key: &str, default: u64, min: u64) -> Result<u64, ConfigError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => {
                let n = as_uint(v).ok_or_else(|| {
                    ConfigError::invalid(
                        &self.path(key),
                        v,
                        format!("expected an integer >= {min}"),
                    )
                })?;
                if n < min {
                    return Err(ConfigError::invalid(
                        &self.path(key),
                        v,
                        format!("must be >= {min}"),
                    ));
                }
                Ok(n)
            }
        }
    }

    fn u32(&self, key: &str, default: u32, min: u32) -> Result<u32, ConfigError> {
        let n = self.uint(key, default as u64, min as u64)?;
        u32::try_from(n).map_err(|_| {
            ConfigError::invalid(&self.path(key), n, format!("must be <= {}", u32::MAX))
        })
    }

    fn bool(&self, key: &str, default: bool) -> Result<bool, ConfigError> {
        match self.get(key) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(ConfigError::invalid(
                &self.path(key),
                v,
                "expected true or false",
            )),
        }
    }

    /// An int or a list of ints (`device`, `visual.max_seq_len`, `decoder_batch_sizes`).
    fn u32_list(&self, key: &str) -> Result<Option<Vec<u32>>, ConfigError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let bad = || {
            ConfigError::invalid(
                &self.path(key),
                v,
                "expected a non-negative integer or a non-empty list of them",
            )
        };
        let items: Vec<&Value> = match v {
            Value::Array(a) if !a.is_empty() => a.iter().collect(),
            Value::Number(_) | Value::String(_) => vec![v],
            _ => return Err(bad()),
        };
        items
            .into_iter()
            .map(|x| {
                as_uint(x)
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or_else(bad)
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }

    /// (dtype, auto): `auto`, or no key, is resolved later against the checkpoint and the
    /// machine (`dtype_auto`); until then it reads as the default, f32.
    fn dtype(&self, key: &str) -> Result<(Dtype, bool), ConfigError> {
        match self.get(key) {
            None => Ok((Dtype::default(), true)),
            Some(v) => match v.as_str().map(|s| s.to_ascii_lowercase()) {
                Some(s) if s == "auto" => Ok((Dtype::default(), true)),
                Some(s) if s == "f32" || s == "float32" => Ok((Dtype::F32, false)),
                Some(s) if s == "f16" || s == "float16" => Ok((Dtype::F16, false)),
                Some(s) if s == "bf16" || s == "bfloat16" => Ok((Dtype::Bf16, false)),
                _ => Err(ConfigError::invalid(
                    &self.path(key),
                    v,
                    "expected one of \"auto\", \"f32\", \"f16\", \"bf16\"",
                )),
            },
        }
    }

    /// `num_devices` and `device` together: either may be omitted; when both are given the
    /// list's length must equal the count.
    fn devices(&self) -> Result<(u32, Vec<u32>), ConfigError> {
        let n = match self.get("num_devices") {
            None => None,
            Some(_) => Some(self.u32("num_devices", 1, 1)?),
        };
        // The count becomes a list of ids: bound it before it is made.
        if let Some(n) = n.filter(|&n| n > MAX_DEVICES) {
            return Err(ConfigError::invalid(
                &self.path("num_devices"),
                n,
                format!("must be at most {MAX_DEVICES} devices per part"),
            ));
        }
        let list = self.u32_list("device")?;
        match (n, list) {
            (None, None) => Ok((1, vec![0])),
            (Some(n), None) => Ok((n, (0..n).collect())),
            (None, Some(l)) => Ok((l.len() as u32, l)),
            (Some(n), Some(l)) => {
                if l.len() as u32 != n {
                    return Err(ConfigError::invalid(
                        &self.path("num_devices"),
                        n,
                        format!(
                            "must equal the length of `{}` ({} ids: {:?}); set num_devices (or tensor_parallel_size) to {} or list {} devices",
                            self.path("device"),
                            l.len(),
                            l,
                            l.len(),
                            n
                        ),
                    ));
                }
                Ok((n, l))
            }
        }
    }
}

/// Reads the document into a config, without the cross-field rules.
pub(crate) fn parse(doc: &Value) -> Result<DeployConfig, ConfigError> {
    let Value::Object(top) = doc else {
        return Err(ConfigError::invalid(
            "(root)",
            short(doc),
            "the config must be a mapping of keys to values",
        ));
    };
    if let Some(Value::Object(vis)) = top.get("visual") {
        if vis.contains_key("batch_size") {
            return Err(ConfigError::invalid(
                "visual.batch_size",
                &vis["batch_size"],
                "batch_size is one value for the whole model and cannot be set under `visual`; set the top-level `batch_size` instead",
            ));
        }
    }
    let lm = Section::new("", top, LM_KEYS)?;
    let empty = Map::new();
    let vis_obj = match lm.get("visual") {
        None => &empty,
        Some(Value::Object(o)) => o,
        Some(v) => {
            return Err(ConfigError::invalid(
                "visual",
                short(v),
                "expected a mapping (the ViT's section)",
            ))
        }
    };
    let vis = Section::new("visual.", vis_obj, VISUAL_KEYS)?;

    let (num_devices, device) = lm.devices()?;
    let batch_size = lm.u32("batch_size", DEFAULT_BATCH_SIZE, 1)?;
    let decoder_batch_sizes = lm
        .u32_list("decoder_batch_sizes")?
        .unwrap_or_else(|| vec![batch_size]);
    let (v_num_devices, v_device) = vis.devices()?;
    let oversize = match vis.get("oversize") {
        None => Oversize::default(),
        Some(v) => match v.as_str() {
            Some("reject") => Oversize::Reject,
            Some("downscale") => Oversize::Downscale,
            _ => {
                return Err(ConfigError::invalid(
                    "visual.oversize",
                    v,
                    "expected \"reject\" or \"downscale\"",
                ))
            }
        },
    };
    let (dtype, dtype_auto) = lm.dtype("dtype")?;
    let kv_cache_dtype = match lm.get("kv_cache_dtype") {
        None => KvCacheDtype::Auto,
        Some(v) => match v.as_str().map(|s| s.to_ascii_lowercase()).as_deref() {
            Some("auto") => KvCacheDtype::Auto,
            // vLLM's `--kv-cache-dtype` spellings of the same codes.
            Some("fp8_e4m3" | "fp8") => KvCacheDtype::Fp8E4m3,
            _ => {
                return Err(ConfigError::invalid(
                    "kv_cache_dtype",
                    v,
                    "expected \"auto\" or \"fp8_e4m3\" (\"fp8\")",
                ))
            }
        },
    };
    let (v_dtype, v_dtype_auto) = vis.dtype("dtype")?;
    Ok(DeployConfig {
        max_seq_len: lm.u32("max_seq_len", DEFAULT_MAX_SEQ_LEN, 1)?,
        kvcache_partition_len: lm.u32("kvcache_partition_len", DEFAULT_KVCACHE_PARTITION_LEN, 1)?,
        kvcache_num_blocks: lm.u32("kvcache_num_blocks", 0, 0)?,
        batch_size,
        decoder_batch_sizes,
        prefill_chunk_size: lm.u32("prefill_chunk_size", DEFAULT_PREFILL_CHUNK_SIZE, 0)?,
        num_devices,
        device,
        create_runtimes: lm.bool("create_runtimes", true)?,
        dtype,
        dtype_auto,
        kernels: kernels::parse(&lm, kernels::Part::Lm)?,
        prefix_caching: lm.bool("prefix_caching", true)?,
        kv_cache_dtype,
        visual: VisualConfig {
            max_seq_len: vis
                .u32_list("max_seq_len")?
                .unwrap_or_else(|| DEFAULT_VIT_BUCKETS.to_vec()),
            num_devices: v_num_devices,
            device: v_device,
            create_runtimes: vis.bool("create_runtimes", true)?,
            min_pixels: vis.uint("min_pixels", DEFAULT_MIN_PIXELS, 1)?,
            max_pixels: vis.uint("max_pixels", DEFAULT_MAX_PIXELS, 1)?,
            oversize,
            dtype: v_dtype,
            dtype_auto: v_dtype_auto,
            kernels: kernels::parse(&vis, kernels::Part::Visual)?,
        },
    })
}

/// A non-negative integer: a number, or a string of digits with `_` separators as Python
/// writes them (`262_144`), so an `rbln_config` dict pasted from the seeds reads as YAML.
fn as_uint(v: &Value) -> Option<u64> {
    match v {
        Value::Number(n) => n.as_u64(),
        Value::String(s) => {
            let groups: Vec<&str> = s.split('_').collect();
            if groups
                .iter()
                .all(|g| !g.is_empty() && g.bytes().all(|b| b.is_ascii_digit()))
            {
                groups.concat().parse().ok()
            } else {
                None
            }
        }
        _ => None,
    }
}

/// A value for a message, cut to a readable length.
fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.len() > 60 {
        format!("{}...", s.chars().take(60).collect::<String>())
    } else {
        s
    }
}
