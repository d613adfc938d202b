//! End to end through the ViT: the golden pixel values (the backend the reference fed its
//! model) go through [`Pipeline::encode_images`] and the decoder; tokens and per-step logits
//! must match the reference.
mod text_support;

use candle_core::{DType, Device, Tensor};
use text_support::{cases, rel_diff};
use vlm_model::pipeline::Pipeline;
use vlm_model::preprocess::PixelValues;

#[test]
fn pixels_to_tokens_matches_the_reference() {
    for case in cases() {
        let p = Pipeline::load(&case.ckpt, &Device::Cpu, DType::F32)
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
                    values,
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
            "{} ({backend} pixels): ViT + decoder per-step logits max rel diff {d:.2e}",
            case.name
        );
        assert!(d < 1e-4, "{}: {d}", case.name);
    }
}
