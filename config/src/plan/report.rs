//! Plain-text rendering of a plan (what `vlm plan` prints).
use super::device::{human, BufferPolicy};
use super::dims::ModelDims;
use super::inputs::Part;
use super::memory::{DevicePlan, Plan};
use std::fmt::Write;

fn parts_label(parts: &[Part]) -> String {
    let names: Vec<&str> = parts.iter().map(|p| p.as_str()).collect();
    names.join(" + ")
}

fn signed(h: i64) -> String {
    if h < 0 {
        format!("-{}", human((-h) as u64))
    } else {
        human(h as u64)
    }
}

/// The plan as text: header, KV geometry, one table per device, verdict, suggestions.
pub fn render(plan: &Plan, dims: &ModelDims) -> String {
    let mut s = String::new();
    let k = &plan.kind;
    let pc = dims.params();
    let policy = |p: BufferPolicy| match p {
        BufferPolicy::PerGraph => "every graph's",
        BufferPolicy::PerRun => "the largest run's",
    };
    let _ = writeln!(
        s,
        "device kind {}: {} per device, {} reserved{}; buffers held: visual {}, lm {}",
        k.name,
        human(k.capacity),
        human(k.reserved),
        if k.shared_pool {
            ", every device id in one memory pool (host)"
        } else {
            ""
        },
        policy(plan.visual.policy),
        policy(plan.lm.policy)
    );
    let _ = writeln!(
        s,
        "model: {} parameters (visual {}, lm {}); weights visual {} / lm {}, activations {}",
        pc.total(),
        pc.visual,
        pc.text,
        plan.visual.weight_dtype.as_str(),
        plan.lm.weight_dtype.as_str(),
        plan.lm.activation_dtype.as_str()
    );
    let kv = &plan.kv;
    let _ = writeln!(
        s,
        "kv cache: {} per token ({}), block of {} tokens = {}; {} blocks{} = {} full-length ({}-token) sequence(s) for batch_size {} (full batch needs {})",
        human(kv.bytes_per_token),
        kv.dtype.as_str(),
        kv.block_tokens,
        human(kv.block_bytes),
        kv.blocks,
        if kv.automatic {
            if plan.options.require_full_batch {
                " (kvcache_num_blocks 0, planned as batch_size full-length sequences)"
            } else {
                " (kvcache_num_blocks 0: the largest that fits)"
            }
        } else {
            ""
        },
        kv.full_sequences,
        kv.max_seq_len,
        kv.batch_size,
        kv.full_batch_blocks
    );
    if kv.prefix_caching {
        let _ = writeln!(
            s,
            "prefix caching: on; full blocks of {} tokens are reused by requests sharing a prefix \
             (freed blocks stay cached, least recently used evicted first)",
            kv.block_tokens
        );
    }
    if !plan.shared_devices.is_empty() {
        let _ = writeln!(s, "visual and lm share devices {:?}", plan.shared_devices);
    }
    // Devices with the same contents are shown once.
    let mut groups: Vec<(Vec<&str>, &DevicePlan)> = Vec::new();
    for d in &plan.devices {
        match groups.last_mut() {
            Some((ids, first))
                if first.items == d.items && first.parts == d.parts && first.used == d.used =>
            {
                ids.push(&d.id)
            }
            _ => groups.push((vec![&d.id], d)),
        }
    }
    for (ids, d) in groups {
        let _ = writeln!(s);
        if ids.len() == 1 {
            let _ = writeln!(s, "device {} ({})", ids[0], parts_label(&d.parts));
        } else {
            let _ = writeln!(
                s,
                "devices {} ({}), each",
                ids.join(", "),
                parts_label(&d.parts)
            );
        }
        for it in &d.items {
            let _ = writeln!(
                s,
                "  {:<7} {:<32} {:>12}",
                it.part.as_str(),
                it.what,
                human(it.bytes)
            );
        }
        if d.reserved > 0 {
            let _ = writeln!(
                s,
                "  {:<7} {:<32} {:>12}",
                "",
                "reserved",
                human(d.reserved)
            );
        }
        let _ = writeln!(
            s,
            "  {:<7} {:<32} {:>12}   of {}, headroom {}{}",
            "",
            "total",
            human(d.used),
            human(d.capacity),
            signed(d.headroom),
            if d.headroom < 0 {
                "  <-- does not fit"
            } else {
                ""
            }
        );
    }
    let _ = writeln!(s);
    if plan.fits {
        let _ = writeln!(
            s,
            "fits: yes{}",
            if plan.full_batch {
                ""
            } else {
                " (fewer KV blocks than batch_size full-length sequences: long requests queue)"
            }
        );
    } else {
        let _ = writeln!(s, "fits: NO");
        for p in &plan.problems {
            let _ = writeln!(s, "  {p}");
        }
        if plan.suggestions.is_empty() {
            let _ = writeln!(s, "no single change found that fits");
        } else {
            let _ = writeln!(s, "changes that fit (each re-planned):");
            for sug in &plan.suggestions {
                let _ = writeln!(
                    s,
                    "  - {}  [kv blocks {}, least headroom {}]",
                    sug.change,
                    sug.kv_blocks,
                    signed(sug.min_headroom)
                );
            }
        }
    }
    s
}
