//! The memory plan with the backends' own sizes: the CPU backend pools everything on the host,
//! its figures are what a loaded backend reports, the candle backend on GPUs replicates the ViT
//! and refuses a tensor-parallel LM, and every seed config plans on every kind.
use vlm_backend_cpu::sizing::{vit_bucket_bytes, VitDims};
use vlm_config::plan::{
    self, structured_output_bytes, BufferPolicy, DeviceKind, ModelDims, Part, PlanOptions, Service,
    Sizing, CPU_PROCESS_BASELINE, GIB, MEDIA_LIBRARIES_BYTES,
};
use vlm_config::{DeployConfig, Dtype};

fn cfg(json: &str) -> DeployConfig {
    DeployConfig::from_json(json).unwrap().config
}

fn dims() -> ModelDims {
    ModelDims::qwen3_vl_2b()
}

fn sizing(c: &DeployConfig, kind: &DeviceKind, opts: &PlanOptions) -> Box<dyn Sizing> {
    vlm_backends::sizing(c, kind, opts).unwrap()
}

fn plan_of(c: &DeployConfig, d: &ModelDims, kind: &DeviceKind, opts: &PlanOptions) -> plan::Plan {
    plan::plan(c, d, kind, sizing(c, kind, opts).as_ref(), opts)
}

/// The CPU engine's bytes of one bucket (one thread per device, the default attention tile).
fn engine_bytes(d: &ModelDims, rows: u64) -> (u64, u64) {
    vit_bucket_bytes(&VitDims::from_plan(d), rows, 1, (256, 512))
}

fn example(name: &str) -> DeployConfig {
    DeployConfig::from_path(
        &vlm_test_support::workspace_dir()
            .join("config/examples")
            .join(name),
    )
    .unwrap_or_else(|e| panic!("{name}: {e}"))
    .config
}

#[test]
fn the_cpu_backend_pools_everything() {
    let c = cfg(r#"{
        "visual": {"max_seq_len": [1024, 4096, 16384], "device": [0]},
        "device": [1], "max_seq_len": 4096, "kvcache_partition_len": 256,
        "kvcache_num_blocks": 64, "batch_size": 8, "decoder_batch_sizes": [1, 2, 4, 8]
    }"#);
    let kind = DeviceKind::cpu_with(64 * GIB);
    let p = plan_of(&c, &dims(), &kind, &PlanOptions::default());
    assert_eq!(p.devices.len(), 1);
    assert_eq!(p.devices[0].id, "host");
    assert!(p.shared_devices.is_empty());
    // f32 weights, norms and biases in f32 too.
    let pc = dims().params();
    assert_eq!(p.visual.weights, pc.visual * 4);
    assert_eq!(p.lm.weights, pc.text * 4);
    // The f32 ViT engine holds every bucket's workspace from load (engine sizes); the LM holds
    // its largest run; f32 KV with the dummy block.
    assert_eq!(p.visual.policy, BufferPolicy::PerGraph);
    assert_eq!(
        p.visual.buffers,
        [1024, 4096, 16384]
            .iter()
            .map(|&b| engine_bytes(&dims(), b).1)
            .sum::<u64>()
    );
    assert_eq!(p.lm.policy, BufferPolicy::PerRun);
    assert_eq!(
        p.lm.buffers,
        p.lm.graphs.iter().map(|g| g.bytes).max().unwrap()
    );
    assert_eq!(p.kv.bytes_per_token, 224 * 1024);
    assert_eq!(p.lm.kv_cache, 65 * 256 * 224 * 1024);
    assert!(p.fits);
    // f16 weights in the config halve the matrices but not the f32 vectors.
    let mut half = c.clone();
    half.dtype = Dtype::F16;
    let q = plan_of(&half, &dims(), &kind, &PlanOptions::default());
    assert_eq!(
        q.lm.weights,
        (pc.text - pc.text_vectors) * 2 + pc.text_vectors * 4
    );
    // A non-f32 ViT runs candle ops: its largest run.
    let mut half = c.clone();
    half.visual.dtype = Dtype::F16;
    let q = plan_of(&half, &dims(), &kind, &PlanOptions::default());
    assert_eq!(q.visual.policy, BufferPolicy::PerRun);
    assert_eq!(
        q.visual.buffers,
        q.visual.graphs.iter().map(|g| g.bytes).max().unwrap()
    );
}

#[test]
fn cpu_service_bytes_are_the_plans_parts() {
    let c = cfg(r#"{
        "visual": {"max_seq_len": [1024, 4096], "device": [0]},
        "device": [1], "max_seq_len": 4096, "kvcache_partition_len": 256,
        "kvcache_num_blocks": 16, "batch_size": 2
    }"#);
    let s = sizing(&c, &DeviceKind::cpu().unwrap(), &PlanOptions::default());
    let v = plan::cpu_service_bytes(&c, &dims(), s.as_ref(), Service::Vision).unwrap();
    let l = plan::cpu_service_bytes(&c, &dims(), s.as_ref(), Service::Lm).unwrap();
    assert_eq!(v.total, v.weights + v.buffers);
    assert_eq!(l.total, l.weights + l.buffers + l.kv_cache);
    assert_eq!(l.kv_cache, 17 * 256 * 224 * 1024);
    let p = plan_of(
        &c,
        &dims(),
        &DeviceKind::cpu().unwrap(),
        &PlanOptions::default(),
    );
    assert_eq!(p.visual.total, v.total);
    assert_eq!(p.lm.total, l.total);
    assert_eq!(p.devices[0].used, v.total + l.total);
}

#[test]
fn every_seed_config_plans() {
    for name in [
        "design-disjoint.json",
        "en-decoder-buckets.yaml",
        "en-one-device-compile.yaml",
        "en-one-device-load.yaml",
        "en-vit-buckets.yaml",
        "ko-decoder-buckets.yaml",
        "ko-disjoint-16-devices.yaml",
        "ko-submodule-structure.yaml",
        "ko-vit-buckets.yaml",
    ] {
        let cfg = example(name);
        for kind in [DeviceKind::atom(), DeviceKind::rebel(), DeviceKind::h200()] {
            let p = plan_of(&cfg, &dims(), &kind, &PlanOptions::default());
            let text = plan::report::render(&p, &dims());
            assert!(text.contains("fits: "), "{name}: {text}");
            if !p.fits {
                assert!(!p.problems.is_empty(), "{name} on {}", kind.name);
            }
        }
    }
}

#[test]
fn a_cpu_service_resident_figure_is_baseline_weights_held_buffers_and_kv() {
    let c = cfg(r#"{
        "visual": {"max_seq_len": [1024, 4096], "device": [0]},
        "device": [1], "max_seq_len": 4096, "kvcache_partition_len": 256,
        "kvcache_num_blocks": 16, "batch_size": 2
    }"#);
    let dims = ModelDims::qwen3_vl_2b();
    let kind = DeviceKind::cpu_with(64 * GIB);
    let opts = PlanOptions::default();
    let s = sizing(&c, &kind, &opts);
    let v = plan::service_bytes(&c, &dims, &kind, s.as_ref(), Service::Vision, &opts).unwrap();
    let held = engine_bytes(&dims, 1024).0 + engine_bytes(&dims, 4096).0;
    assert_eq!(v.held_buffers, held);
    assert!(v.held_buffers < v.buffers);
    assert_eq!(
        v.resident(),
        CPU_PROCESS_BASELINE + MEDIA_LIBRARIES_BYTES + v.weights + held
    );
    let l = plan::service_bytes(&c, &dims, &kind, s.as_ref(), Service::Lm, &opts).unwrap();
    assert_eq!(l.held_buffers, 0);
    // The LM's process also holds its structured-output compiler.
    assert_eq!(
        l.resident(),
        CPU_PROCESS_BASELINE + structured_output_bytes(dims.vocab) + l.weights + l.kv_cache
    );
    // Device memory of an accelerator carries no process baseline.
    let h200 = DeviceKind::h200();
    let hs = sizing(&c, &h200, &opts);
    let h = plan::service_bytes(&c, &dims, &h200, hs.as_ref(), Service::Lm, &opts).unwrap();
    assert_eq!(h.process_baseline, 0);
}

#[test]
fn every_cpu_vision_device_holds_its_own_workspaces() {
    let one = cfg(r#"{"visual": {"max_seq_len": [1024, 4096], "device": [0]}, "device": [3]}"#);
    let three =
        cfg(r#"{"visual": {"max_seq_len": [1024, 4096], "device": [0, 1, 2]}, "device": [3]}"#);
    let dims = ModelDims::qwen3_vl_2b();
    let kind = DeviceKind::cpu_with(64 * GIB);
    let opts = PlanOptions::default();
    let a = plan::visual_bytes(
        &one,
        &dims,
        &kind,
        sizing(&one, &kind, &opts).as_ref(),
        &opts,
    );
    let b = plan::visual_bytes(
        &three,
        &dims,
        &kind,
        sizing(&three, &kind, &opts).as_ref(),
        &opts,
    );
    assert_eq!(b.weights, a.weights, "the weights are shared");
    assert_eq!(b.buffers, 3 * a.buffers);
    assert_eq!(b.held_buffers, 3 * a.held_buffers);
    assert!(b.graphs[0].what.contains("x3 devices"), "{:?}", b.graphs[0]);
}

#[test]
fn on_gpus_the_vit_is_replicated_and_a_tensor_parallel_lm_is_a_problem() {
    let c = cfg(r#"{
        "visual": {"max_seq_len": [1024, 4096], "device": [0, 1]},
        "device": [2, 3], "max_seq_len": 4096, "kvcache_partition_len": 1024,
        "kvcache_num_blocks": 8
    }"#);
    let kind = DeviceKind::h200();
    let p = plan_of(&c, &dims(), &kind, &PlanOptions::default());
    // Each vision GPU holds the whole ViT (one instance per device), not half of it.
    let weights_on = |id: &str, part: Part| {
        p.devices
            .iter()
            .find(|d| d.id == id)
            .unwrap()
            .items
            .iter()
            .find(|i| i.part == part && i.what == "weights")
            .unwrap()
            .bytes
    };
    assert_eq!(weights_on("0", Part::Visual), p.visual.weights);
    assert_eq!(weights_on("1", Part::Visual), p.visual.weights);
    // Two LM GPUs: the candle backend runs the LM on one; the plan says so.
    assert!(!p.fits);
    assert!(
        p.problems
            .iter()
            .any(|m| m.starts_with("lm:") && m.contains("tensor parallel")),
        "{:?}",
        p.problems
    );
    // One LM GPU plans.
    let mut one = c.clone();
    one.device = vec![2];
    one.num_devices = 1;
    assert!(plan_of(&one, &dims(), &kind, &PlanOptions::default()).fits);
}

/// The tiny checkpoint's plan against what the loaded backends report they hold.
#[test]
fn the_plan_is_what_the_loaded_backends_hold() {
    let dir = vlm_test_support::tiny_dir();
    let tiny = ModelDims::from_dir(&dir).unwrap();
    let fp8 = vlm_config::KvCacheDtype::Fp8E4m3;
    for (dtype, kv) in [
        (Dtype::F32, Default::default()),
        (Dtype::Bf16, Default::default()),
        (Dtype::Bf16, fp8),
    ] {
        let mut c = cfg(r#"{
            "visual": {"max_seq_len": [64, 256, 1024], "device": [0, 1]},
            "device": [0, 1], "max_seq_len": 512, "kvcache_partition_len": 64,
            "kvcache_num_blocks": 12, "batch_size": 2
        }"#);
        c.kv_cache_dtype = kv;
        c.dtype = dtype;
        c.visual.dtype = dtype;
        let kind = DeviceKind::cpu_with(64 * GIB);
        let opts = PlanOptions::default();
        let s = sizing(&c, &kind, &opts);
        let v = plan::service_bytes(&c, &tiny, &kind, s.as_ref(), Service::Vision, &opts).unwrap();
        let l = plan::service_bytes(&c, &tiny, &kind, s.as_ref(), Service::Lm, &opts).unwrap();
        let vision = vlm_backends::load_vision(&vlm_backends::VisionLoad {
            model_dir: &dir,
            dtype,
            kernels: &c.visual.kernels,
            buckets: &[64, 256, 1024],
            devices: &[0, 1],
        })
        .unwrap();
        assert_eq!(vision.len(), 2, "one instance per device");
        let held: u64 = vision
            .iter()
            .flat_map(|d| d.memory().buckets)
            .map(|b| b.held_bytes)
            .sum();
        let memory = vision[0].memory();
        assert!(memory.weights_shared);
        assert_eq!(v.weights, memory.weight_bytes, "{dtype:?} vision weights");
        assert_eq!(v.held_buffers, held, "{dtype:?} vision buffers held");
        let lm = vlm_backends::load_lm(&vlm_backends::LmLoad {
            model_dir: &dir,
            dtype,
            kv_cache_dtype: c.kv_cache_dtype,
            kernels: &c.kernels,
            num_blocks: 12,
            block_len: 64,
            devices: &[0, 1],
        })
        .unwrap();
        let m = lm.memory();
        assert_eq!(l.weights, m.weight_bytes, "{dtype:?} LM weights");
        assert_eq!(l.kv_cache, m.kv_bytes(), "{dtype:?} {kv:?} KV pool");
        let kv_name = c.kv_cache_dtype.resolve(dtype.into()).as_str();
        let info = lm.info();
        let said = info.kernels.iter().find(|(k, _)| k == "kv_cache");
        assert_eq!(said.map(|(_, v)| v.as_str()), Some(kv_name), "{info:?}");
        assert_eq!(
            v.resident() + l.resident(),
            2 * CPU_PROCESS_BASELINE
                + MEDIA_LIBRARIES_BYTES
                + structured_output_bytes(tiny.vocab)
                + memory.weight_bytes
                + held
                + m.weight_bytes
                + m.kv_bytes()
        );
    }
}

#[test]
fn one_gpu_sizes_its_kv_pool_from_the_gpus_free_memory() {
    // `config/examples/one-gpu.yaml` (kvcache_num_blocks: 0) on a GPU as cuMemGetInfo would
    // report it: the CUDA backend's sizes, the pool from the free memory less the margin.
    let c = example("one-gpu.yaml");
    let dims = dims();
    let gpu = |free: u64| {
        vlm_backend_cuda::plan::device_kind(&vlm_backend_cuda::plan::GpuMemory {
            name: "NVIDIA H200".into(),
            free,
            total: 150_754_820_096,
        })
    };
    let (roomy, tight) = (gpu(140_000_000_000), gpu(20_000_000_000));
    let s = sizing(&c, &roomy, &PlanOptions::default());
    assert_eq!(s.backend(Part::Lm), "cuda");
    let many = plan::resolve_kv_blocks(&c, &dims, &roomy, s.as_ref()).unwrap();
    let few = plan::resolve_kv_blocks(&c, &dims, &tight, s.as_ref()).unwrap();
    // Capped at batch_size full-length sequences on the roomy card; less on the full one.
    let full = c.batch_size * c.max_seq_len / c.kvcache_partition_len;
    assert_eq!(many, full);
    assert!(few < many && few > 0, "{few} of {many}");
    let mut sized = c.clone();
    sized.kvcache_num_blocks = few;
    assert!(plan_of(&sized, &dims, &tight, &PlanOptions::default()).fits);
}

#[cfg(not(feature = "cuda"))]
#[test]
fn the_cuda_backend_is_refused_by_a_build_without_it() {
    let k = vlm_config::KernelConfig {
        backend: vlm_config::BackendChoice::Cuda,
        ..Default::default()
    };
    let e = vlm_backends::Backend::resolve(&k, Dtype::Bf16, vlm_backends::Part::Lm).unwrap_err();
    assert!(e.to_string().contains("--features cuda"), "{e}");
}
