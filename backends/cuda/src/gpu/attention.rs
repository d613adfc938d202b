//! The paged attention kernels' launches: K/V written into the cache at their slots in one
//! launch per tensor, and decode attention that reads the block tables in the kernel (no gather
//! into a contiguous copy), split over the context and combined (`vlm_kernels.cu`).
use super::kernels::candle_err;
use super::{cuda_of, MODULE, PTX};
use crate::layout::DecodeLayout;
use crate::select::{elementwise_blocks, DecodeLaunch, ELEMENTWISE_THREADS};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{
    CpuStorage, CudaStorage, CustomOp3, DType, Device, InplaceOp3, Layout, Shape, Tensor,
};
use vlm_model::text::{AttnCall, PagedKvCache};
use vlm_model::Result;

/// One decode step's layout and its device copies (u32 tensors).
#[derive(Debug, Clone)]
pub struct DecodeInputs {
    pub layout: DecodeLayout,
    pub tables: Tensor,
    pub ctx_lens: Tensor,
    pub slots: Tensor,
}

impl DecodeInputs {
    pub fn upload(layout: DecodeLayout, device: &Device) -> Result<DecodeInputs> {
        let rows = layout.ctx_lens.len();
        Ok(DecodeInputs {
            tables: Tensor::from_vec(layout.tables.clone(), (rows, layout.max_blocks), device)?,
            ctx_lens: Tensor::from_vec(layout.ctx_lens.clone(), rows, device)?,
            slots: Tensor::from_vec(layout.slots.clone(), rows, device)?,
            layout,
        })
    }
}

/// Writes k, v (n, kv_heads, head_dim) of `layer` at `slots` (n,) u32.
pub fn write_kv(
    kv: &PagedKvCache,
    layer: usize,
    k: &Tensor,
    v: &Tensor,
    slots: &Tensor,
) -> Result<()> {
    let (kc, vc) = kv.layer(layer);
    let op = KvWrite {
        kv_heads: kv.kv_heads() as u32,
        block_len: kv.block_len() as u32,
        head_dim: k.dim(2)? as u32,
    };
    kc.inplace_op3(&k.to_dtype(DType::F32)?.contiguous()?, slots, &op)?;
    vc.inplace_op3(&v.to_dtype(DType::F32)?.contiguous()?, slots, &op)?;
    Ok(())
}

struct KvWrite {
    kv_heads: u32,
    block_len: u32,
    head_dim: u32,
}

impl InplaceOp3 for KvWrite {
    fn name(&self) -> &'static str {
        "kv_write"
    }
    fn cpu_fwd(
        &self,
        _: &mut CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<()> {
        candle_core::bail!("kv_write: the cuda backend's kernel runs on the GPU only")
    }
    fn cuda_fwd(
        &self,
        cache: &mut CudaStorage,
        cache_l: &Layout,
        src: &CudaStorage,
        src_l: &Layout,
        slots: &CudaStorage,
        slots_l: &Layout,
    ) -> candle_core::Result<()> {
        if cache_l.start_offset() != 0 || !cache_l.is_contiguous() {
            candle_core::bail!("kv_write: the cache tensor must be whole and contiguous");
        }
        let n = slots_l.shape().elem_count();
        let total = n * (self.kv_heads * self.head_dim) as usize;
        if src_l.shape().elem_count() != total {
            candle_core::bail!(
                "kv_write: {} values for {n} slots",
                src_l.shape().elem_count()
            );
        }
        let dev = cache.device.clone();
        let s = src.as_cuda_slice::<f32>()?.slice(src_l.start_offset()..);
        let sl = slots
            .as_cuda_slice::<u32>()?
            .slice(slots_l.start_offset()..);
        let name = match cache.dtype() {
            DType::BF16 => "kv_write_bf16",
            DType::F32 => "kv_write_f32",
            d => candle_core::bail!("kv_write: a {d:?} cache has no kernel"),
        };
        let func = dev.get_or_load_custom_func(name, MODULE, PTX)?;
        let cfg = LaunchConfig {
            grid_dim: (elementwise_blocks(total).map_err(candle_err)?, 1, 1),
            block_dim: (ELEMENTWISE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let n32 = n as u32;
        let mut b = func.builder();
        b.arg(&s);
        match cache.dtype() {
            DType::BF16 => b.arg(cache.as_cuda_slice::<half::bf16>()?),
            _ => b.arg(cache.as_cuda_slice::<f32>()?),
        };
        b.arg(&sl);
        b.arg(&n32);
        b.arg(&self.kv_heads);
        b.arg(&self.block_len);
        b.arg(&self.head_dim);
        // SAFETY: argument types match the kernel; slots are inside the cache (the layout
        // checked the tables against the pool).
        unsafe { b.launch(cfg) }.w()?;
        Ok(())
    }
}

/// q (rows, heads, head_dim) over the cache of `call.layer` -> (rows, heads * head_dim) f32.
pub fn decode(
    call: &AttnCall,
    kernel: &str,
    inputs: &DecodeInputs,
    launch: DecodeLaunch,
) -> Result<Tensor> {
    let (rows, heads, head_dim) = call.q.dims3()?;
    let (kc, vc) = call.kv.layer(call.layer);
    let op = PagedDecode {
        kernel: kernel.to_string(),
        launch,
        heads: heads as u32,
        kv_heads: call.kv.kv_heads() as u32,
        head_dim: head_dim as u32,
        block_len: call.kv.block_len() as u32,
        max_blocks: inputs.layout.max_blocks as u32,
        scale: call.scale,
        tables: inputs.tables.clone(),
        ctx_lens: inputs.ctx_lens.clone(),
    };
    let q = call.q.to_dtype(DType::F32)?.contiguous()?;
    Ok(q.apply_op3_no_bwd(kc, vc, &op)?
        .reshape((rows, heads * head_dim))?)
}

struct PagedDecode {
    kernel: String,
    launch: DecodeLaunch,
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    block_len: u32,
    max_blocks: u32,
    scale: f32,
    tables: Tensor,
    ctx_lens: Tensor,
}

impl CustomOp3 for PagedDecode {
    fn name(&self) -> &'static str {
        "paged_decode"
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("paged_decode: the cuda backend's kernel runs on the GPU only")
    }
    fn cuda_fwd(
        &self,
        q: &CudaStorage,
        q_l: &Layout,
        kc: &CudaStorage,
        kc_l: &Layout,
        vc: &CudaStorage,
        vc_l: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        if !(kc_l.is_contiguous() && vc_l.is_contiguous() && q_l.is_contiguous()) {
            candle_core::bail!("paged_decode: q and the cache must be contiguous");
        }
        let dev = q.device.clone();
        let (rows, heads, hd) = q_l.shape().dims3()?;
        let q = q.as_cuda_slice::<f32>()?.slice(q_l.start_offset()..);
        let (tables_s, _) = self.tables.storage_and_layout();
        let tables = cuda_of(&tables_s, "paged_decode tables")?.as_cuda_slice::<u32>()?;
        let (ctx_s, _) = self.ctx_lens.storage_and_layout();
        let ctx = cuda_of(&ctx_s, "paged_decode ctx_lens")?.as_cuda_slice::<u32>()?;

        let l = self.launch;
        // SAFETY: every partial is written by the decode kernel before the combine reads it.
        let partial = unsafe { dev.alloc::<f32>(l.partial_len(hd))? };
        let func = dev.get_or_load_custom_func(&self.kernel, MODULE, PTX)?;
        let mut b = func.builder();
        b.arg(&q);
        match kc.dtype() {
            DType::BF16 => {
                b.arg(kc.as_cuda_slice::<half::bf16>()?);
                b.arg(vc.as_cuda_slice::<half::bf16>()?);
            }
            _ => {
                b.arg(kc.as_cuda_slice::<f32>()?);
                b.arg(vc.as_cuda_slice::<f32>()?);
            }
        }
        b.arg(tables);
        b.arg(ctx);
        b.arg(&partial);
        b.arg(&self.heads);
        b.arg(&self.kv_heads);
        b.arg(&self.block_len);
        b.arg(&self.max_blocks);
        b.arg(&l.split_len);
        b.arg(&self.scale);
        let cfg = LaunchConfig {
            grid_dim: l.grid,
            block_dim: (l.threads, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: argument types match `PAGED_DECODE`'s signature; every table entry a row
        // visits is below the pool's block count (decode_layout copied checked tables).
        unsafe { b.launch(cfg) }.w()?;

        let out = unsafe { dev.alloc::<f32>(rows * heads * hd)? };
        let combine = dev.get_or_load_custom_func("paged_decode_combine", MODULE, PTX)?;
        let splits = l.grid.2;
        let mut b = combine.builder();
        b.arg(&partial);
        b.arg(&out);
        b.arg(&self.heads);
        b.arg(&self.head_dim);
        b.arg(&splits);
        let cfg = LaunchConfig {
            grid_dim: (heads as u32, rows as u32, 1),
            block_dim: (self.head_dim, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: as above; `out` is written in full (one thread per value).
        unsafe { b.launch(cfg) }.w()?;
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev),
            Shape::from((rows, heads, hd)),
        ))
    }
}
