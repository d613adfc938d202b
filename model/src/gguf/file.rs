//! One GGUF file, opened with candle's reader (`candle_core::quantized::gguf_file`, which
//! follows ggml's `gguf.c`: header, metadata, tensor infos, aligned data): its metadata by key
//! and its tensors read on demand by GGUF name.
use crate::error::{ModelError, Result};
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Device;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The tensor types this server runs: what llama.cpp's `llama-quantize` writes for the
/// F16/BF16, Q8_0, Q4_0, Q4_K_M and Q5_K_M presets (k-quant mixes use Q4_K/Q5_K/Q6_K).
pub const SUPPORTED_TYPES: [GgmlDType; 10] = [
    GgmlDType::F32,
    GgmlDType::F16,
    GgmlDType::BF16,
    GgmlDType::Q8_0,
    GgmlDType::Q4_0,
    GgmlDType::Q4_1,
    GgmlDType::Q5_0,
    GgmlDType::Q4K,
    GgmlDType::Q5K,
    GgmlDType::Q6K,
];

#[derive(Debug)]
pub struct GgufFile {
    path: PathBuf,
    content: Content,
    file: Mutex<File>,
}

impl GgufFile {
    /// Reads the header, metadata and tensor table; refuses a tensor type outside
    /// [`SUPPORTED_TYPES`], naming the tensor.
    pub fn open(path: &Path) -> Result<Self> {
        let mut file = File::open(path).map_err(|e| ModelError::io(path, e))?;
        let content = Content::read(&mut file).map_err(|e| {
            ModelError::config(path, format!("not a GGUF file llama.cpp could load: {e}"))
        })?;
        let mut names: Vec<&String> = content.tensor_infos.keys().collect();
        names.sort();
        for name in names {
            let dtype = content.tensor_infos[name].ggml_dtype;
            if !SUPPORTED_TYPES.contains(&dtype) {
                return Err(ModelError::config(
                    path,
                    format!(
                        "tensor {name} has type {dtype:?}, which this server does not run \
                         (supported: {SUPPORTED_TYPES:?})"
                    ),
                ));
            }
        }
        Ok(GgufFile {
            path: path.to_path_buf(),
            content,
            file: Mutex::new(file),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn value(&self, key: &str) -> Option<&Value> {
        self.content.metadata.get(key)
    }

    /// A required metadata value, with an error naming the key and the file.
    pub fn require(&self, key: &str) -> Result<&Value> {
        self.value(key)
            .ok_or_else(|| ModelError::config(&self.path, format!("no metadata key {key}")))
    }

    pub fn string(&self, key: &str) -> Result<String> {
        self.require(key)?
            .to_string()
            .cloned()
            .map_err(|e| self.bad(key, e))
    }

    pub fn usize(&self, key: &str) -> Result<usize> {
        let v = self.require(key)?;
        let n = match v {
            Value::U64(_) | Value::I64(_) => v.to_u64().map(|n| n as usize),
            _ => v.to_u32().map(|n| n as usize),
        };
        n.map_err(|e| self.bad(key, e))
    }

    pub fn f64(&self, key: &str) -> Result<f64> {
        let v = self.require(key)?;
        match v {
            Value::F64(x) => Ok(*x),
            _ => v.to_f32().map(f64::from).map_err(|e| self.bad(key, e)),
        }
    }

    pub fn array(&self, key: &str) -> Result<&Vec<Value>> {
        self.require(key)?.to_vec().map_err(|e| self.bad(key, e))
    }

    fn bad(&self, key: &str, e: candle_core::Error) -> ModelError {
        ModelError::config(&self.path, format!("metadata {key}: {e}"))
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// The stored type of tensor `name`.
    pub fn tensor_type(&self, name: &str) -> Option<GgmlDType> {
        self.content.tensor_infos.get(name).map(|t| t.ggml_dtype)
    }

    /// Bytes the tensors take in the file (what the quantized weights take in memory).
    pub fn tensor_bytes(&self, filter: impl Fn(&str, GgmlDType) -> bool) -> u64 {
        self.content
            .tensor_infos
            .iter()
            .filter(|(n, t)| filter(n, t.ggml_dtype))
            .map(|(_, t)| {
                let d = t.ggml_dtype;
                (t.shape.elem_count() / d.block_size() * d.type_size()) as u64
            })
            .sum()
    }

    /// Reads tensor `name` (shape in PyTorch order: candle reverses ggml's `ne`).
    pub fn tensor(&self, name: &str) -> Result<QTensor> {
        let mut file = self
            .file
            .lock()
            .map_err(|_| ModelError::weights("a GGUF reader panicked"))?;
        self.content
            .tensor(&mut *file, name, &Device::Cpu)
            .map_err(|e| ModelError::config(&self.path, format!("tensor {name}: {e}")))
    }
}
