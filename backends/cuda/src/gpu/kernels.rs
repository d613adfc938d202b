//! [`CudaKernels`]: `vlm-model`'s forward on one GPU. Linear weights stay resident in their
//! storage dtype (bf16 for the 2B checkpoint) and every product is one cuBLAS GEMM in that
//! dtype (f32 accumulation), the activations cast to it on the way in and back to f32 on the
//! way out; q/k/v and gate/up are one GEMM each (fused weights). RMSNorm and rope are candle's
//! fused CUDA kernels (`candle_nn::ops::rms_norm`, `rotary_emb::rope_thd`, called by the
//! model); SiLU·mul and the paged attention are this crate's kernels (`attention.rs`).
use super::attention::{self, DecodeInputs};
use super::{MODULE, PTX};
use crate::layout::{chunk_slots, decode_layout, DecodeLayout};
use crate::select::{self, elementwise_blocks, CacheDtype, ELEMENTWISE_THREADS};
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Shape, Tensor};
use std::sync::{Arc, Mutex};
use vlm_model::text::{paged_attention, AttnCall, AttnRows};
use vlm_model::{Kernels, Result};

#[derive(Debug, Clone)]
pub struct CudaKernels {
    device: Device,
    multiprocessors: usize,
    /// The last step's uploads (a decode step's layout, a prefill chunk's slots): every layer
    /// of a step has the same rows, so the host-to-device copy happens once per step, not once
    /// per layer.
    decode: Arc<Last<DecodeLayout, DecodeInputs>>,
    chunk_slots: Arc<Last<Vec<u32>, Tensor>>,
}

impl CudaKernels {
    pub fn new(device: Device, multiprocessors: usize) -> CudaKernels {
        CudaKernels {
            device,
            multiprocessors,
            decode: Arc::new(Mutex::new(None)),
            chunk_slots: Arc::new(Mutex::new(None)),
        }
    }
}

impl Kernels for CudaKernels {
    /// (out, in) in the storage dtype, resident on the GPU.
    type Weight = Tensor;

    fn name(&self) -> &'static str {
        "cuda"
    }
    fn device(&self) -> &Device {
        &self.device
    }
    fn weight(&self, w: Tensor) -> Result<Tensor> {
        Ok(w.contiguous()?)
    }
    fn weight_dims(&self, w: &Tensor) -> (usize, usize) {
        let d = w.dims();
        (d[0], d[1])
    }
    fn fuse(&self, parts: &[&Tensor]) -> Option<Tensor> {
        Tensor::cat(parts, 0).ok()
    }
    fn matmul(&self, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        let x = if x.dtype() == w.dtype() {
            x.clone()
        } else {
            x.to_dtype(w.dtype())?
        };
        // (rows, in) x (in, out): cuBLAS takes the transposed weight as is (no copy).
        Ok(x.matmul(&w.t()?)?.to_dtype(DType::F32)?)
    }
    fn rows_of(&self, w: &Tensor, ids: &[u32]) -> Result<Tensor> {
        let idx = Tensor::new(ids, w.device())?;
        Ok(w.index_select(&idx, 0)?.to_dtype(DType::F32)?)
    }
    fn silu_mul(&self, y: &Tensor, inter: usize) -> Result<Tensor> {
        Ok(y.to_dtype(DType::F32)?
            .contiguous()?
            .apply_op1_no_bwd(&SiluMul { inter })?)
    }
    fn kv_dtype(&self, weights: DType) -> DType {
        vlm_model::dtype::kv_dtype(weights)
    }
    fn attention(&self, call: &AttnCall) -> Result<Tensor> {
        let kv = call.kv;
        let (_, heads, head_dim) = call.q.dims3()?;
        let cache = match kv.dtype() {
            DType::BF16 => CacheDtype::Bf16,
            _ => CacheDtype::F32,
        };
        match call.rows {
            AttnRows::Chunk { start, table, mask } => {
                let n = call.k.dim(0)?;
                let slots = chunk_slots(table, *start, n, kv.block_len())?;
                let slots = reuse(&self.chunk_slots, slots, |s| {
                    Ok(Tensor::from_vec(s.clone(), n, &self.device)?)
                })?;
                attention::write_kv(kv, call.layer, call.k, call.v, &slots)?;
                // Prefill: cuBLAS batched products per cached block, softmax in f32.
                paged_attention::attend(call.q, kv, call.layer, table, *start, *mask, call.scale)
            }
            AttnRows::Decode(rows) => {
                let Some(kernel) = select::decode_kernel(heads, kv.kv_heads(), head_dim, cache)
                else {
                    return paged_attention::attention(call);
                };
                let layout = decode_layout(rows, kv.block_len(), kv.dummy_block())?;
                let inputs = reuse(&self.decode, layout, |l| {
                    DecodeInputs::upload(l.clone(), &self.device)
                })?;
                attention::write_kv(kv, call.layer, call.k, call.v, &inputs.slots)?;
                let launch = select::decode_launch(
                    heads,
                    rows.len(),
                    inputs.layout.max_ctx,
                    self.multiprocessors,
                )?;
                attention::decode(call, &kernel, &inputs, launch)
            }
        }
    }
}

/// The last upload of a kind: its host key and device value.
type Last<K, V> = Mutex<Option<(K, V)>>;

/// The device copy of `key` from the last call with an equal key, else `upload(&key)` (kept).
fn reuse<K: PartialEq, V: Clone>(
    slot: &Last<K, V>,
    key: K,
    upload: impl FnOnce(&K) -> Result<V>,
) -> Result<V> {
    let mut last = slot.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((k, t)) = last.as_ref() {
        if *k == key {
            return Ok(t.clone());
        }
    }
    let t = upload(&key)?;
    *last = Some((key, t.clone()));
    Ok(t)
}

/// silu(gate) * up of y (n, 2*inter) f32 contiguous -> (n, inter).
struct SiluMul {
    inter: usize,
}

impl CustomOp1 for SiluMul {
    fn name(&self) -> &'static str {
        "silu_mul"
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("silu_mul: the cuda backend's kernel runs on the GPU only")
    }
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (n, two) = l.shape().dims2()?;
        if two != 2 * self.inter {
            candle_core::bail!(
                "silu_mul: input is ({n}, {two}), expected (n, {})",
                2 * self.inter
            );
        }
        let dev = s.device.clone();
        let src = s.as_cuda_slice::<f32>()?;
        let (o1, o2) = l
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("silu_mul: input not contiguous".into()))?;
        let src = src.slice(o1..o2);
        let total = n * self.inter;
        // SAFETY: every element is written by the kernel.
        let out = unsafe { dev.alloc::<f32>(total)? };
        let func = dev.get_or_load_custom_func("silu_mul_f32", MODULE, PTX)?;
        let cfg = LaunchConfig {
            grid_dim: (elementwise_blocks(total).map_err(candle_err)?, 1, 1),
            block_dim: (ELEMENTWISE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (n32, inter32) = (n as u32, self.inter as u32);
        let mut b = func.builder();
        b.arg(&src);
        b.arg(&out);
        b.arg(&n32);
        b.arg(&inter32);
        // SAFETY: argument types match the kernel's signature.
        unsafe { b.launch(cfg) }.w()?;
        Ok((
            candle_core::CudaStorage::wrap_cuda_slice(out, dev),
            Shape::from((n, self.inter)),
        ))
    }
}

pub(crate) fn candle_err(e: vlm_compute::ComputeError) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}
