//! The plan with its advice ([`plan`]): what would make a layout fit. Each candidate change is
//! applied to a copy of the config, checked by the config's own rules and then planned again;
//! only changes whose plan fits are offered.
use super::device::{human, DeviceKind};
use super::dims::ModelDims;
use super::inputs::{Part, PlanOptions};
use super::memory::{plan_only, resolve_kv_blocks_with, Plan, Suggestion};
use super::sizing::Sizing;
use crate::types::DeployConfig;
use serde_json::json;

/// Plans `cfg` on devices of `kind`. Never fails: a layout that does not fit comes back with
/// `fits: false`, its problems and the suggestions that would fit.
pub fn plan(
    cfg: &DeployConfig,
    dims: &ModelDims,
    kind: &DeviceKind,
    sizing: &dyn Sizing,
    opts: &PlanOptions,
) -> Plan {
    let mut p = plan_only(cfg, dims, kind, sizing, opts);
    if !p.fits {
        p.suggestions = suggest(cfg, dims, kind, sizing, opts, &p);
    }
    p
}

/// Tensor-parallel sizes tried when suggesting more devices.
const DEVICE_COUNTS: [u32; 7] = [2, 4, 8, 16, 32, 64, 128];

fn checked(
    cfg: &DeployConfig,
    dims: &ModelDims,
    kind: &DeviceKind,
    sizing: &dyn Sizing,
    opts: &PlanOptions,
    change: String,
    patch: serde_json::Value,
) -> Option<Suggestion> {
    let mut c = cfg.clone();
    crate::rules::apply(&mut c).ok()?;
    let p = plan_only(&c, dims, kind, sizing, opts);
    p.fits.then(|| Suggestion {
        change,
        patch,
        kv_blocks: p.kv.blocks,
        min_headroom: p.devices.iter().map(|d| d.headroom).min().unwrap_or(0),
    })
}

fn fresh_ids(cfg: &DeployConfig, count: usize) -> Vec<u32> {
    let next = cfg
        .visual
        .device
        .iter()
        .chain(cfg.device.iter())
        .copied()
        .max()
        .map_or(0, |m| m + 1);
    (next..next + count as u32).collect()
}

pub(crate) fn suggest(
    cfg: &DeployConfig,
    dims: &ModelDims,
    kind: &DeviceKind,
    sizing: &dyn Sizing,
    opts: &PlanOptions,
    plan: &Plan,
) -> Vec<Suggestion> {
    let mut out = Vec::new();

    // 1. The largest max_seq_len that fits (same number of sequences).
    let part = cfg.kvcache_partition_len;
    let k0 = cfg.max_seq_len / part;
    for k in (2..k0).rev() {
        let mut c = cfg.clone();
        c.max_seq_len = k * part;
        if c.kvcache_num_blocks != 0 {
            let scaled = (c.kvcache_num_blocks as u64 * k as u64).div_ceil(k0 as u64) as u32;
            c.kvcache_num_blocks = scaled.max(k);
        }
        let mut patch = json!({ "max_seq_len": c.max_seq_len });
        if c.kvcache_num_blocks != cfg.kvcache_num_blocks {
            patch["kvcache_num_blocks"] = c.kvcache_num_blocks.into();
        }
        let change = format!(
            "max_seq_len: {} (the largest multiple of kvcache_partition_len {part} that fits)",
            c.max_seq_len
        );
        if let Some(s) = checked(&c, dims, kind, sizing, opts, change, patch) {
            out.push(s);
            break;
        }
    }

    // 2. The largest kvcache_num_blocks that fits (sequences beyond it queue).
    let relaxed = PlanOptions {
        require_full_batch: false,
        ..opts.clone()
    };
    let mut auto = cfg.clone();
    auto.kvcache_num_blocks = 0;
    if let Ok(blocks) = resolve_kv_blocks_with(&auto, dims, kind, sizing, &relaxed) {
        if blocks != cfg.kvcache_num_blocks || plan.options.require_full_batch {
            let mut c = cfg.clone();
            c.kvcache_num_blocks = blocks;
            let per_seq = cfg.blocks_per_sequence();
            let change = format!(
                "kvcache_num_blocks: {blocks} (the largest that fits: {} full-length sequence(s) for batch_size {}; the rest queue or are preempted)",
                blocks / per_seq,
                cfg.batch_size
            );
            if let Some(s) = checked(
                &c,
                dims,
                kind,
                sizing,
                &relaxed,
                change,
                json!({ "kvcache_num_blocks": blocks }),
            ) {
                out.push(s);
            }
            // With full-length slots required: the batch that the blocks hold.
            let seqs = blocks / per_seq;
            if opts.require_full_batch && seqs >= 1 && seqs < cfg.batch_size {
                let mut c = cfg.clone();
                c.batch_size = seqs;
                c.decoder_batch_sizes.retain(|&b| b < seqs);
                c.decoder_batch_sizes.push(seqs);
                let change = format!(
                    "batch_size: {seqs}, decoder_batch_sizes: {:?} (the largest batch whose every sequence can reach max_seq_len)",
                    c.decoder_batch_sizes
                );
                let patch =
                    json!({ "batch_size": seqs, "decoder_batch_sizes": c.decoder_batch_sizes });
                if let Some(s) = checked(&c, dims, kind, sizing, opts, change, patch) {
                    out.push(s);
                }
            }
        }
    }

    if !kind.shared_pool {
        // 3. Move the ViT off the LM's devices.
        if !plan.shared_devices.is_empty() {
            let mut c = cfg.clone();
            c.visual.device = fresh_ids(cfg, cfg.visual.num_devices as usize);
            let change = format!(
                "visual.device: {:?} (move visual to {} devices of its own, {} more in all)",
                c.visual.device, c.visual.num_devices, c.visual.num_devices
            );
            let patch = json!({ "visual": { "device": c.visual.device } });
            if let Some(s) = checked(&c, dims, kind, sizing, opts, change, patch) {
                out.push(s);
            }
        }
        // 4. More devices for the LM (tensor parallel), then for the ViT.
        for &n in DEVICE_COUNTS.iter().filter(|&&n| n > cfg.num_devices) {
            let mut c = cfg.clone();
            c.device
                .extend(fresh_ids(cfg, (n - cfg.num_devices) as usize));
            c.num_devices = n;
            let change = format!(
                "num_devices: {n}, device: {:?} ({} more devices for the LM)",
                c.device,
                n - cfg.num_devices
            );
            let patch = json!({ "num_devices": n, "device": c.device });
            if let Some(s) = checked(&c, dims, kind, sizing, opts, change, patch) {
                out.push(s);
                break;
            }
        }
        let vision_short = plan
            .devices
            .iter()
            .any(|d| d.headroom < 0 && d.parts.contains(&Part::Visual));
        if vision_short {
            for &n in DEVICE_COUNTS
                .iter()
                .filter(|&&n| n > cfg.visual.num_devices)
            {
                let mut c = cfg.clone();
                c.visual
                    .device
                    .extend(fresh_ids(cfg, (n - cfg.visual.num_devices) as usize));
                c.visual.num_devices = n;
                let change = format!(
                    "visual.num_devices: {n}, visual.device: {:?} ({} more devices for visual)",
                    c.visual.device,
                    n - cfg.visual.num_devices
                );
                let patch = json!({ "visual": { "num_devices": n, "device": c.visual.device } });
                if let Some(s) = checked(&c, dims, kind, sizing, opts, change, patch) {
                    out.push(s);
                    break;
                }
            }
        }
    }

    // 5. Bigger devices: the most any device needs.
    let need = plan.devices.iter().map(|d| d.used).max().unwrap_or(0);
    if need > kind.capacity {
        let bigger = kind.clone().with_capacity(need);
        let change = format!(
            "devices of at least {} ({need} bytes; --device-memory {need})",
            human(need)
        );
        if let Some(s) = checked(
            cfg,
            dims,
            &bigger,
            sizing,
            opts,
            change,
            json!({ "device_memory": need }),
        ) {
            out.push(s);
        }
    }
    out
}
