//! Streams generated tensors into safetensors files, shard by shard, without holding a whole
//! tensor in memory, and writes `model.safetensors.index.json` for sharded checkpoints.
use super::init;
use super::manifest::TensorSpec;
use super::WeightDtype;
use serde_json::{json, Map, Value};
use std::io::Write;
use std::path::Path;
use std::sync::mpsc;
use vlm_compute::{ComputeError, Result};

/// Values generated per chunk (then written): bounds memory at 8 Mi values (32 MB in f32).
const CHUNK_VALUES: usize = 8 << 20;

/// Groups tensors (in order) into shards of at most `max_bytes` each, the way
/// transformers' `save_pretrained` does: a tensor that does not fit starts a new shard (a
/// tensor larger than the limit gets a shard of its own). `None`: one shard.
pub fn plan_shards(
    specs: &[TensorSpec],
    dtype: WeightDtype,
    max_bytes: Option<u64>,
) -> Vec<Vec<usize>> {
    let mut shards: Vec<Vec<usize>> = vec![Vec::new()];
    let mut size = 0u64;
    for (i, s) in specs.iter().enumerate() {
        let bytes = (s.numel() * dtype.size_in_bytes()) as u64;
        if let Some(max) = max_bytes {
            let current = shards.last().map_or(0, |v| v.len());
            if current > 0 && size + bytes > max {
                shards.push(Vec::new());
                size = 0;
            }
        }
        if let Some(last) = shards.last_mut() {
            last.push(i);
        }
        size += bytes;
    }
    shards
}

/// File names: `model.safetensors` when unsharded, else `model-0000k-of-0000n.safetensors`.
pub fn shard_names(count: usize, sharded: bool) -> Vec<String> {
    if !sharded {
        return vec!["model.safetensors".into()];
    }
    (1..=count)
        .map(|k| format!("model-{k:05}-of-{count:05}.safetensors"))
        .collect()
}

/// The safetensors header for `specs` in this order (data laid out contiguously), padded with
/// spaces to a multiple of 8 bytes as the reference writer does.
fn header(specs: &[&TensorSpec], dtype: WeightDtype) -> Result<Vec<u8>> {
    let mut text = String::from(r#"{"__metadata__":{"format":"pt"}"#);
    let mut offset = 0usize;
    for s in specs {
        let bytes = s.numel() * dtype.size_in_bytes();
        let name = serde_json::to_string(&s.name)
            .map_err(|e| ComputeError::Weights(format!("tensor name {:?}: {e}", s.name)))?;
        let shape = serde_json::to_string(&s.shape)
            .map_err(|e| ComputeError::Weights(format!("shape of {}: {e}", s.name)))?;
        text.push_str(&format!(
            r#",{name}:{{"dtype":"{}","shape":{shape},"data_offsets":[{offset},{}]}}"#,
            dtype.safetensors_name(),
            offset + bytes
        ));
        offset += bytes;
    }
    text.push('}');
    while (text.len() + 8) % 8 != 0 {
        text.push(' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(text.as_bytes());
    Ok(out)
}

/// Writes one safetensors file holding `specs`, values generated from `seed`. Returns the
/// number of data bytes written. Generation (on `threads` threads) and writing overlap: a
/// writer thread takes filled chunks while the next one is generated.
pub fn write_file(
    path: &Path,
    specs: &[&TensorSpec],
    dtype: WeightDtype,
    seed: u64,
    threads: usize,
) -> Result<u64> {
    let io = |e| ComputeError::io(path, e);
    let mut file = std::fs::File::create(path).map_err(io)?;
    file.write_all(&header(specs, dtype)?).map_err(io)?;
    let size = dtype.size_in_bytes();
    let largest = specs.iter().map(|s| s.numel()).max().unwrap_or(0);
    let cap = largest.min(CHUNK_VALUES) * size;
    let (full_tx, full_rx) = mpsc::sync_channel::<Vec<u8>>(1);
    let (empty_tx, empty_rx) = mpsc::channel::<Vec<u8>>();
    for _ in 0..2 {
        // cannot fail: the receiver is alive
        let _ = empty_tx.send(Vec::with_capacity(cap));
    }
    let mut written = 0u64;
    let written_ref = &mut written;
    std::thread::scope(|s| -> Result<()> {
        let writer = s.spawn(move || -> std::io::Result<()> {
            for chunk in full_rx {
                file.write_all(&chunk)?;
                // the generator may be gone already (it stops on our error only)
                let _ = empty_tx.send(chunk);
            }
            file.flush()
        });
        'gen: for spec in specs {
            let key = init::tensor_key(seed, &spec.name);
            let n = spec.numel();
            let mut start = 0usize;
            while start < n {
                let len = (n - start).min(CHUNK_VALUES);
                // a closed channel means the writer failed: its error is reported below
                let Ok(mut buf) = empty_rx.recv() else {
                    break 'gen;
                };
                buf.resize(len * size, 0);
                init::fill_parallel(&mut buf, key, start as u64, spec.init, dtype, threads);
                *written_ref += buf.len() as u64;
                if full_tx.send(buf).is_err() {
                    break 'gen;
                }
                start += len;
            }
        }
        drop(full_tx);
        match writer.join() {
            Ok(r) => r.map_err(io),
            Err(_) => Err(ComputeError::Weights(format!(
                "writer thread for {} panicked",
                path.display()
            ))),
        }
    })?;
    Ok(written)
}

/// `model.safetensors.index.json` for a sharded checkpoint.
pub fn index_json(
    specs: &[TensorSpec],
    shards: &[Vec<usize>],
    names: &[String],
    dtype: WeightDtype,
) -> Value {
    let mut map = Map::new();
    for (shard, file) in shards.iter().zip(names) {
        for &i in shard {
            map.insert(specs[i].name.clone(), json!(file));
        }
    }
    let params: usize = specs.iter().map(|s| s.numel()).sum();
    json!({
        "metadata": {
            "total_parameters": params,
            "total_size": params * dtype.size_in_bytes()
        },
        "weight_map": map
    })
}
