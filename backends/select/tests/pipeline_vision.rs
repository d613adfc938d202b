//! End to end through the ViT: the golden pixel values (the backend the reference fed its
//! model) go through the oracle's exact ViT forward (`Oracle::encode_images`) and the decoder,
//! on each backend's kernels; tokens and per-step logits must match the reference.
mod text_support;

use candle_core::{DType, Tensor};
use text_support::{candle, cases, cpu, rel_diff};
use vlm_compute::PixelValues;
use vlm_model::oracle::Oracle;
use vlm_model::Kernels;

#[test]
fn pixels_to_tokens_matches_the_reference() {
    check(&cpu());
    check(&candle());
}

fn check<K: Kernels>(k: &K) {
    for case in cases() {
        let p = Oracle::load(k, &case.ckpt, DType::F32)
            .unwrap()
            .with_prefill_chunk_size(64);
        let backend = &case.fed_backend;
        let fed: &Tensor = case.t(&format!("pixel_values_{backend}"));
        let mut row = 0;
        let pixels: Vec<PixelValues> = case
            .grids
            .iter()
            .map(|&g| {
                let n = g[0] * g[1] * g[2];
                let values = fed.narrow(0, row, n).unwrap();
                row += n;
                PixelValues {
                    values: values.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    grid_thw: g,
                }
            })
            .collect();
        let images = p.encode_images(&pixels).unwrap();
        let steps = case.generated_ids().len();
        let out = p
            .generate_greedy(&case.input_ids(), &images, steps, &[])
            .unwrap();
        assert_eq!(out.tokens, case.generated_ids(), "{}", case.name);
        let d = rel_diff(&out.step_logits, case.t("generate_step_logits"));
        eprintln!(
            "{} ({backend} pixels, {} backend): ViT + decoder per-step logits max rel diff {d:.2e}",
            case.name,
            k.name()
        );
        assert!(d < 1e-4, "{}: {d}", case.name);
    }
}
