//! The seed guides' configs and tables, reproduced through the public functions.
use vlm_config::{image_geometry, BucketError, DeployConfig, ImagePlanError, Oversize};

fn example(name: &str) -> vlm_config::Loaded {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples")
        .join(name);
    DeployConfig::from_path(&path).unwrap_or_else(|e| panic!("{name}: {e}"))
}

#[test]
fn every_seed_example_is_valid() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        DeployConfig::from_path(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        n += 1;
    }
    assert!(n >= 9, "expected the seed examples in {}", dir.display());
}

#[test]
fn one_device_layout() {
    let c = example("en-one-device-compile.yaml").config;
    assert_eq!(c.visual.max_seq_len, vec![16384]);
    assert_eq!(
        (c.num_devices, c.kvcache_partition_len, c.max_seq_len),
        (1, 8192, 262_144)
    );
    assert!(!c.create_runtimes && !c.visual.create_runtimes);
    let load = example("en-one-device-load.yaml").config;
    assert_eq!(
        (load.device.clone(), load.visual.device.clone()),
        (vec![0], vec![0])
    );
}

#[test]
fn disjoint_16_device_layout_with_older_spellings() {
    let c = example("ko-disjoint-16-devices.yaml").config;
    assert_eq!(c.visual.device, (0..8).collect::<Vec<_>>());
    assert_eq!(c.device, (8..16).collect::<Vec<_>>());
    assert_eq!((c.num_devices, c.visual.num_devices), (8, 8));
    assert_eq!(c.visual.max_seq_len, vec![16384]);
    // batch_size 8 with no decoder_batch_sizes: one graph of 8.
    assert_eq!(c.decoder_batch_sizes, vec![8]);
}

#[test]
fn vit_bucket_table() {
    // Both guides: patch counts 800 / 2000 / 5000 / 20000 against [1024, 3136, 16384].
    for name in ["en-vit-buckets.yaml", "ko-vit-buckets.yaml"] {
        let v = example(name).config.visual;
        assert_eq!(v.bucket_for(800), Ok(1024));
        assert_eq!(v.bucket_for(2000), Ok(3136));
        assert_eq!(v.bucket_for(5000), Ok(16384));
        let err = v.bucket_for(20000).unwrap_err();
        assert_eq!(
            err,
            BucketError::OverLargestVitBucket {
                patches: 20000,
                largest: 16384,
                buckets: vec![1024, 3136, 16384]
            }
        );
        let msg = err.to_string();
        assert!(msg.contains("20000") && msg.contains("16384"), "{msg}");
    }
}

#[test]
fn decoder_graph_tables() {
    let c = example("ko-decoder-buckets.yaml").config;
    assert_eq!(c.decoder_batch_sizes, vec![1, 2, 4, 8]);
    let chosen: Vec<u32> = [1, 2, 3, 5, 8]
        .iter()
        .map(|&n| c.decoder_graph_for(n).unwrap())
        .collect();
    assert_eq!(chosen, vec![1, 2, 4, 8, 8]);
    assert!(c.decoder_graph_for(9).is_err());

    let c = example("en-decoder-buckets.yaml").config;
    assert_eq!(c.decoder_batch_sizes, vec![1, 2, 4]);
    assert_eq!(c.decoder_graph_for(3), Ok(4));
    assert_eq!(c.decoder_graph_for(4), Ok(4));
}

#[test]
fn image_sizes_in_raw_patches() {
    let g = image_geometry(1024, 1024, 65536, 16_777_216).unwrap();
    assert_eq!((g.patches(), g.tokens()), (4096, 1024));
    let g = image_geometry(2048, 2048, 65536, 16_777_216).unwrap();
    assert_eq!(g.patches(), 16384);

    let mut v = example("en-vit-buckets.yaml").config.visual;
    assert_eq!(v.oversize, Oversize::Reject);
    let err = v.plan_image(4096, 4096).unwrap_err();
    assert!(matches!(
        err,
        ImagePlanError::Bucket(BucketError::OverLargestVitBucket { patches: 65536, .. })
    ));
    v.oversize = Oversize::Downscale;
    let p = v.plan_image(4096, 4096).unwrap();
    assert!(p.downscaled);
    assert_eq!(
        (
            p.geometry.resized_width,
            p.geometry.resized_height,
            p.bucket
        ),
        (2048, 2048, 16384)
    );
    // The seed's "merged patches" formula would give 1024 for 1024x1024; the library's code (and
    // ours) counts raw patches: 4096.
    assert_eq!(v.plan_image(1024, 1024).unwrap().bucket, 16384);
}

#[test]
fn a_request_pixel_budget_stays_within_the_config() {
    use vlm_config::PixelBudget;
    let v = example("en-vit-buckets.yaml").config.visual;
    let budget = |min, max| PixelBudget {
        min_pixels: min,
        max_pixels: max,
    };
    // A small max: 1024x1024 at 256x256, the floor lowered with it.
    let p = v
        .plan_image_within(1024, 1024, budget(None, Some(65536)))
        .unwrap();
    assert_eq!((p.geometry.resized_width, p.geometry.tokens()), (256, 64));
    // A max over the config's is the config's.
    let big = v
        .plan_image_within(1024, 1024, budget(None, Some(u64::MAX)))
        .unwrap();
    assert_eq!(big.geometry, v.plan_image(1024, 1024).unwrap().geometry);
    // A min raises a small image.
    let p = v
        .plan_image_within(64, 64, budget(Some(512 * 512), None))
        .unwrap();
    assert_eq!(p.geometry.resized_width, 512);
    for (b, needle) in [
        (
            budget(Some(v.max_pixels + 1), None),
            "over the server's max_pixels",
        ),
        (budget(Some(70_000), Some(65_536)), "over max_pixels 65536"),
    ] {
        let e = v.plan_image_within(100, 100, b).unwrap_err();
        assert!(e.to_string().contains(needle), "{e}");
    }
}

#[test]
fn json_yaml_toml_agree() {
    let yaml = example("local.yaml").config;
    let toml = example("local.toml").config;
    assert_eq!(yaml, toml);
    let json = DeployConfig::from_json(&yaml.to_document().to_string())
        .unwrap()
        .config;
    assert_eq!(json, yaml);
}
