//! Wire types (vlm.v1) to domain types and back. Sampling parameters stay in their wire type
//! up to `generate`, where the shared checks (`vlm_service_kit::sampling`) read them.
use crate::engine::{EngineInfo, GenEvent};
use crate::generate::{GenerateInput, ImageIn};
use crate::scheduler::SchedulerLoad;
use std::time::Instant;
use vlm_compute::HostDtype;
use vlm_proto as pb;
use vlm_service_kit::generation::Finish;

pub fn generate_input(r: pb::LmGenerateRequest, deadline: Option<Instant>) -> GenerateInput {
    let s = r.sampling.unwrap_or_default();
    GenerateInput {
        request_id: r.request_id,
        input_ids: r.input_ids,
        images: r
            .images
            .into_iter()
            .map(|i| ImageIn {
                content_hash: i.content_hash,
                grid: i.grid.map(|g| [g.t as usize, g.h as usize, g.w as usize]),
                input: i.input,
                video: i.video,
            })
            .collect(),
        vision_replica: r.vision_replica,
        sampling: s,
        deadline,
    }
}

pub fn token_event(e: GenEvent) -> pb::TokenEvent {
    pb::TokenEvent {
        index: e.index,
        token_ids: e.tokens,
        finish_reason: Finish::to_wire(e.finish),
        usage: Some(e.usage.into()),
        logprobs: e.logprobs.into_iter().map(Into::into).collect(),
    }
}

pub fn wire_dtype(d: HostDtype) -> pb::DType {
    match d {
        HostDtype::F32 => pb::DType::DtypeF32,
        HostDtype::F16 => pb::DType::DtypeF16,
        HostDtype::Bf16 => pb::DType::DtypeBf16,
    }
}

pub fn info(i: &EngineInfo) -> pb::LmInfo {
    pb::LmInfo {
        model_id: i.model.model_id.clone(),
        quantization: i.model.quantization.clone(),
        max_seq_len: i.deploy.max_seq_len,
        batch_size: i.deploy.batch_size,
        decoder_batch_sizes: i.deploy.decoder_batch_sizes.clone(),
        kvcache_partition_len: i.block_len,
        kvcache_num_blocks: i.num_blocks,
        prefill_chunk_size: i.deploy.prefill_chunk_size,
        vocab_size: i.model.text.vocab_size as u32,
        eos_token_ids: i.model.eos_token_ids.clone(),
        image_token_id: i.model.image_token_id,
        dtype: wire_dtype(i.dtype) as i32,
        device: i.deploy.device.clone(),
        backend: Some(vlm_service_kit::backend_info::to_proto(
            i.backend.backend,
            &i.backend.device,
            &i.backend.kernels,
        )),
        prefix_caching: i.deploy.prefix_caching,
        mixed_steps: i.mixed_steps,
        prefill_tokens_while_decoding: i.prefill_while_decoding,
        grpc_conn: None,
    }
}

pub fn load(l: SchedulerLoad, draining: bool) -> pb::LoadReport {
    pb::LoadReport {
        running: l.running,
        waiting: l.waiting,
        free_kv_blocks: l.free_blocks,
        total_kv_blocks: l.total_blocks,
        tokens_in_flight: l.tokens_in_flight,
        draining,
        cached_kv_blocks: l.cached_blocks,
    }
}
