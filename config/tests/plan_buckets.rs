//! Bucket advice: the exact dynamic programme against brute force and against answers known by
//! hand; the traffic formats.
use vlm_config::plan::buckets::{
    self, choose, choose_brute_force, evaluate, image_samples, parse_batch_log, parse_traffic,
};
use vlm_config::plan::{CostModel, DeviceKind, ModelDims, Part, PlanOptions};
use vlm_config::{DeployConfig, DEFAULT_VIT_BUCKETS};

fn vit() -> CostModel {
    CostModel::vit(&ModelDims::qwen3_vl_2b())
}

fn any(_: &[u64]) -> bool {
    true
}

fn samples_of(sizes: &[(u32, u32)]) -> Vec<(u64, f64)> {
    image_samples(sizes, 65_536, 16_777_216).unwrap()
}

/// A deterministic xorshift, so the tests need no crate.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[test]
fn cost_constants_of_qwen3_vl_2b() {
    let c = vit();
    assert_eq!(c.a, 657_457_152.0);
    assert_eq!(c.c, 98_304.0);
    let d = CostModel::decode(&ModelDims::qwen3_vl_2b());
    assert_eq!(d.a, 2.0 * 1_720_574_976.0);
    assert_eq!(d.c, 0.0);
}

/// 50 images of 1024 patches (512x512), 50 of 2048 (1024x512), one of 16384 (2048x2048), two
/// buckets. The largest must be 16384; the other is 1024 or 2048:
///   {1024, 16384}: 50 cost(1024) + 51 cost(16384)
///   {2048, 16384}: 100 cost(2048) + 1 cost(16384)
/// and 50 cost(16384) is far more than 100 cost(2048) - 50 cost(1024): {2048, 16384} wins.
#[test]
fn finds_a_known_best_answer() {
    let mut sizes = vec![(512, 512); 50];
    sizes.extend(vec![(1024, 512); 50]);
    sizes.push((2048, 2048));
    let s = samples_of(&sizes);
    let c = vit();
    let best = choose(&s, 2, None, &c, &any).unwrap();
    assert_eq!(best.buckets, vec![2048, 16384]);
    let by_hand = (100.0 * c.cost(2048) + c.cost(16384)) / 101.0;
    assert!((best.expected_cost - by_hand).abs() / by_hand < 1e-12);
    // With three buckets every size gets its own, no padding.
    let three = choose(&s, 3, None, &c, &any).unwrap();
    assert_eq!(three.buckets, vec![1024, 2048, 16384]);
    assert_eq!(three.padding_waste, 0.0);
}

/// The issue's mix: 60/30/10 of 512/1024/2048 square images, K = 3, within 5% of brute force
/// (here exactly the optimum: one bucket per size), and far better than one largest bucket.
#[test]
fn sixty_thirty_ten_mix() {
    let mut sizes = vec![(512, 512); 60];
    sizes.extend(vec![(1024, 1024); 30]);
    sizes.extend(vec![(2048, 2048); 10]);
    let s = samples_of(&sizes);
    let c = vit();
    let best = choose(&s, 3, None, &c, &any).unwrap();
    let brute = choose_brute_force(&s, 3, &c);
    assert!(best.expected_cost <= brute.expected_cost * 1.05);
    assert_eq!(best.buckets, vec![1024, 4096, 16384]);
    assert_eq!(
        best.buckets,
        DEFAULT_VIT_BUCKETS
            .iter()
            .map(|&b| b as u64)
            .collect::<Vec<_>>()
    );
    let single = evaluate(&s, &[16384], &c);
    assert!(single.expected_cost > 5.0 * best.expected_cost);
    assert!(single.padding_waste > 0.7);
}

/// The same mix with the sizes jittered (many distinct patch counts): the dynamic programme
/// equals brute force over every set of at most K buckets.
#[test]
fn jittered_mix_matches_brute_force() {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut sizes = Vec::new();
    for _ in 0..400 {
        let base = match rng.below(10) {
            0..=5 => 512,
            6..=8 => 1024,
            _ => 2048,
        };
        let jw = rng.below(200) as u32;
        let jh = rng.below(200) as u32;
        sizes.push((base - 100 + jw, base - 100 + jh));
    }
    let s = samples_of(&sizes);
    let c = vit();
    let distinct = {
        let mut v: Vec<u64> = s.iter().map(|x| x.0).collect();
        v.sort_unstable();
        v.dedup();
        v.len()
    };
    assert!(distinct > 20, "{distinct}");
    for k in 1..=3 {
        let best = choose(&s, k, None, &c, &any).unwrap();
        let brute = choose_brute_force(&s, k, &c);
        assert!(best.buckets.len() <= k);
        assert!(
            (best.expected_cost - brute.expected_cost).abs() <= 1e-9 * brute.expected_cost,
            "k={k}: {best:?} vs {brute:?}"
        );
        assert!(best.expected_cost <= brute.expected_cost * 1.05);
    }
}

#[test]
fn random_samples_match_brute_force() {
    let mut rng = Rng(42);
    for round in 0..30 {
        let n = 1 + rng.below(12) as usize;
        let s: Vec<(u64, f64)> = (0..n)
            .map(|_| (4 * (1 + rng.below(4096)), 1.0 + rng.below(5) as f64))
            .collect();
        let c = if round % 2 == 0 {
            vit()
        } else {
            CostModel { a: 1.0, c: 0.0 }
        };
        let k = 1 + rng.below(4) as usize;
        let best = choose(&s, k, None, &c, &any).unwrap();
        let brute = choose_brute_force(&s, k, &c);
        assert!(
            (best.expected_cost - brute.expected_cost).abs() <= 1e-9 * brute.expected_cost,
            "{s:?} k={k}"
        );
    }
}

#[test]
fn memory_bounds_the_choice() {
    let mut sizes = vec![(512, 512); 60];
    sizes.extend(vec![(1024, 1024); 30]);
    sizes.extend(vec![(2048, 2048); 10]);
    let s = samples_of(&sizes);
    // A predicate allowing at most two buckets: the best two-bucket set comes back.
    let two = |set: &[u64]| set.len() <= 2;
    let got = choose(&s, 3, None, &vit(), &two).unwrap();
    assert_eq!(got, choose(&s, 2, None, &vit(), &any).unwrap());
    // Nothing fits: a clear error.
    let err = choose(&s, 3, None, &vit(), &|_: &[u64]| false).unwrap_err();
    assert!(err.to_string().contains("no bucket set fits"), "{err}");
    // The real predicate: the layout re-planned with the buckets, on a vision device of 1.9 GiB
    // (288 MiB reserved, 776 MiB of bf16 ViT weights): the 16384 graph (722 MiB) leaves room
    // for the 1024 graph (45 MiB) but not the 4096 graph (180 MiB), so the constrained optimum
    // is {1024, 16384}, not the unconstrained {1024, 4096, 16384} nor its best pair {4096, 16384}.
    let cfg = DeployConfig::from_json(r#"{"visual": {"device": [0]}, "device": [1], "max_seq_len": 8192, "kvcache_partition_len": 1024, "kvcache_num_blocks": 8}"#)
        .unwrap()
        .config;
    let dims = ModelDims::qwen3_vl_2b();
    let kind = DeviceKind::atom().with_capacity(1946 << 20);
    let rbln = vlm_config::plan::RblnSizing::for_kind(&kind, &PlanOptions::default());
    let fits = |set: &[u64]| {
        let mut c = cfg.clone();
        c.visual.max_seq_len = set.iter().map(|&b| b as u32).collect();
        vlm_config::plan::plan_only(&c, &dims, &kind, &rbln, &PlanOptions::default())
            .part_fits(Part::Visual)
    };
    assert!(!fits(&[4096, 16384]));
    assert!(fits(&[1024, 16384]));
    let got = choose(&s, 3, None, &vit(), &fits).unwrap();
    assert_eq!(got.buckets, vec![1024, 16384]);
    // The LM device (1.9 GiB, 3.2 GiB of weights) does not fit, and does not matter here.
    assert!(!vlm_config::plan::plan_only(&cfg, &dims, &kind, &rbln, &PlanOptions::default()).fits);
}

#[test]
fn decode_graphs_from_a_batch_log() {
    // Mostly 1 or 3 active, sometimes 8 (= batch_size): graphs {1, 3, 8}.
    let log = parse_batch_log("1 1 1 1\n3,3,3\n# a comment\n{\"active\": 8}\n").unwrap();
    assert_eq!(log, vec![1, 1, 1, 1, 3, 3, 3, 8]);
    let s: Vec<(u64, f64)> = log.iter().map(|&b| (b, 1.0)).collect();
    let d = CostModel::decode(&ModelDims::qwen3_vl_2b());
    let best = choose(&s, 3, Some(8), &d, &any).unwrap();
    assert_eq!(best.buckets, vec![1, 3, 8]);
    // batch_size is always the largest graph, even when never observed.
    let best = choose(&s[..7], 2, Some(8), &d, &any).unwrap();
    assert_eq!(best.buckets.last(), Some(&8));
    assert!(choose(&s, 2, Some(4), &d, &any).is_err());
    assert!(parse_batch_log("0\n").is_err());
}

#[test]
fn traffic_formats() {
    let text = "# sizes\n512x512\n1024X768\n\n{\"id\": 1, \"images\": [{\"width\": 2048, \"height\": 2048}, {\"width\": 64, \"height\": 64}]}\n{\"id\": 2}\n";
    let sizes = parse_traffic(text).unwrap();
    assert_eq!(sizes, vec![(512, 512), (1024, 768), (2048, 2048), (64, 64)]);
    let s = samples_of(&sizes);
    assert_eq!(s[0].0, 1024);
    assert_eq!(s[2].0, 16384);
    assert_eq!(s[3].0, 256); // upscaled to min_pixels
    assert!(s.iter().all(|x| x.0 % 4 == 0));
    let err = parse_traffic("512x\n").unwrap_err().to_string();
    assert!(err.contains("line 1"), "{err}");
    let err = parse_traffic("{\"images\": [{\"width\": 5}]}")
        .unwrap_err()
        .to_string();
    assert!(err.contains("height"), "{err}");
    assert!(buckets::choose(&[], 3, None, &vit(), &any).is_err());
}

#[test]
fn video_traffic_counts_each_temporal_group_as_a_vit_run() {
    use vlm_config::plan::buckets::{parse_video_traffic, video_samples};
    let text =
        "{\"videos\": [{\"width\": 96, \"height\": 64, \"frames\": 30, \"fps\": 10}]}\n512x512\n";
    let v = parse_video_traffic(text).unwrap();
    assert_eq!(v, [(96, 64, 30, Some(10.0))]);
    // 6 frames sampled at 2 fps -> 3 groups of 4 x 6 = 24 patches.
    let s = video_samples(&v, &vlm_config::video::VideoProcessorConfig::default()).unwrap();
    assert_eq!(s, [(24, 3.0)]);
    assert!(parse_video_traffic("{\"videos\": [{\"width\": 5}]}").is_err());
}
