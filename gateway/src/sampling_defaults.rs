//! The OpenAI API's sampling defaults: what a request that leaves `temperature`, `top_p`,
//! `top_k`, `min_p` or `repetition_penalty` out gets. As vLLM's `--generation-config auto`
//! (its default; `get_diff_sampling_param` reads these five keys), they come from the
//! checkpoint's `generation_config.json` (Qwen3-VL publishes temperature 0.7, top_p 0.8,
//! top_k 20), so a client gets the sampling the model was published with; `none` keeps
//! OpenAI's own (temperature 1, nothing truncated). A request's own values always win.
use crate::error::ServeError;
use std::path::Path;

/// Where the defaults come from (`--generation-config`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Default)]
pub enum GenerationConfig {
    /// The checkpoint's `generation_config.json` (none there: OpenAI's).
    #[default]
    Auto,
    /// OpenAI's defaults whatever the checkpoint says.
    None,
}

/// Values for fields a request leaves out (`None`: the API's own default).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SamplingDefaults {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
}

impl SamplingDefaults {
    /// The defaults `mode` takes from the checkpoint directory `dir`.
    pub fn read(dir: &Path, mode: GenerationConfig) -> Result<SamplingDefaults, ServeError> {
        if mode == GenerationConfig::None {
            return Ok(SamplingDefaults::default());
        }
        let path = dir.join("generation_config.json");
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(SamplingDefaults::default())
            }
            Err(e) => return Err(bad(&path, e.to_string())),
        };
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(&path, e.to_string()))?;
        let float = |k: &str| -> Result<Option<f32>, ServeError> {
            match v.get(k) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(x) => x
                    .as_f64()
                    .filter(|f| f.is_finite() && *f >= 0.0)
                    .map(|f| Some(f as f32))
                    .ok_or_else(|| bad(&path, format!("{k} is {x}, not a number >= 0"))),
            }
        };
        let top_k = match v.get("top_k") {
            None | Some(serde_json::Value::Null) => None,
            Some(x) => Some(
                x.as_i64()
                    .filter(|&k| k >= -1)
                    .ok_or_else(|| bad(&path, format!("top_k is {x}, not -1, 0 or a count")))?,
            ),
        };
        Ok(SamplingDefaults {
            temperature: float("temperature")?,
            top_p: float("top_p")?,
            top_k,
            min_p: float("min_p")?,
            repetition_penalty: float("repetition_penalty")?,
        })
    }
}

fn bad(path: &Path, message: String) -> ServeError {
    ServeError::Config(format!("{}: {message}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir_with(json: &str) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("generation_config.json"), json).unwrap();
        d
    }

    #[test]
    fn reads_the_five_keys_vllm_reads() {
        let d = dir_with(
            r#"{"do_sample": true, "temperature": 0.7, "top_k": 20, "top_p": 0.8,
                "repetition_penalty": 1.0, "eos_token_id": [1, 2]}"#,
        );
        let got = SamplingDefaults::read(d.path(), GenerationConfig::Auto).unwrap();
        assert_eq!(
            got,
            SamplingDefaults {
                temperature: Some(0.7),
                top_p: Some(0.8),
                top_k: Some(20),
                min_p: None,
                repetition_penalty: Some(1.0),
            }
        );
        let none = SamplingDefaults::read(d.path(), GenerationConfig::None).unwrap();
        assert_eq!(none, SamplingDefaults::default());
    }

    #[test]
    fn no_file_is_openai_and_a_bad_value_is_named() {
        let d = tempfile::tempdir().unwrap();
        let got = SamplingDefaults::read(d.path(), GenerationConfig::Auto).unwrap();
        assert_eq!(got, SamplingDefaults::default());
        let d = dir_with(r#"{"top_k": "twenty"}"#);
        let e = SamplingDefaults::read(d.path(), GenerationConfig::Auto).unwrap_err();
        assert!(e.to_string().contains("top_k"), "{e}");
    }
}
