//! The nested deployment config of the system (top level = LM, `"visual"` = ViT), its rules,
//! bucket choice, and the image geometry the buckets are measured in.
//!
//! ```
//! let cfg = vlm_config::DeployConfig::from_json(r#"{
//!     "visual": {"max_seq_len": [1024, 3136, 16384]},
//!     "max_seq_len": 8192, "kvcache_partition_len": 4096,
//!     "batch_size": 8, "decoder_batch_sizes": [1, 2, 4, 8]
//! }"#).unwrap();
//! assert_eq!(cfg.config.visual.bucket_for(2000).unwrap(), 3136);
//! assert_eq!(cfg.config.decoder_graph_for(3).unwrap(), 4);
//! ```

pub mod bucket;
pub mod dtype_auto;
pub mod error;
pub mod file;
pub mod geometry;
pub mod keys;
mod parse;
pub mod plan;
mod rules;
pub mod types;
pub mod video;

pub use bucket::{ImagePlanError, PixelBudget, PlannedImage};
pub use dtype_auto::DtypeFacts;
pub use error::{BucketError, ConfigError};
pub use file::Format;
pub use geometry::{image_geometry, smart_resize, GeometryError, ImageGeometry};
pub use parse::{
    DEFAULT_BATCH_SIZE, DEFAULT_KVCACHE_PARTITION_LEN, DEFAULT_MAX_SEQ_LEN,
    DEFAULT_PREFILL_CHUNK_SIZE, DEFAULT_VIT_BUCKETS, MIN_ATTENTION_TILE,
};
pub use rules::{PREFILL_CHUNK_MULTIPLE, VIT_BUCKET_MULTIPLE};
pub use types::{
    BackendChoice, DeployConfig, Dtype, KernelConfig, KvCacheDtype, KvDtype, Oversize, Toggle,
    VisualConfig, DEFAULT_ATTENTION_TILES,
};

use std::path::Path;

/// A valid config and the warnings its normalization produced.
#[derive(Debug, Clone, PartialEq)]
pub struct Loaded {
    pub config: DeployConfig,
    pub warnings: Vec<String>,
}

impl DeployConfig {
    /// Validates a parsed document: unknown keys, both spellings, types, then every rule.
    pub fn from_value(doc: &serde_json::Value) -> Result<Loaded, ConfigError> {
        let mut config = parse::parse(doc)?;
        let warnings = rules::apply(&mut config)?;
        Ok(Loaded { config, warnings })
    }

    /// Reads a JSON, YAML or TOML file (by extension; YAML otherwise).
    pub fn from_path(path: &Path) -> Result<Loaded, ConfigError> {
        Self::from_value(&file::read_document(path)?)
    }

    pub fn from_json(text: &str) -> Result<Loaded, ConfigError> {
        Self::from_value(&file::parse_document(text, Format::Json, "<json>")?)
    }

    pub fn from_str_as(text: &str, format: Format) -> Result<Loaded, ConfigError> {
        Self::from_value(&file::parse_document(text, format, "<config>")?)
    }

    /// The config with every default, as the services would run it.
    pub fn default_config() -> DeployConfig {
        Self::from_value(&serde_json::json!({}))
            .expect("the defaults satisfy every rule")
            .config
    }
}
