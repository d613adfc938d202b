//! The LM service as a real process with the real vision service, on the tiny golden
//! checkpoint: image prompts against the in-process pipeline, across prefill chunks, under
//! preemption, and through the prefix and embedding caches.
mod support;

use futures::future::join_all;
use serde_json::json;
use sha2::{Digest, Sha256};
use support::*;
use vlm_proto::{EncodedImage, ImageGrid, ImageInput, LmImage, LmInfoRequest};

fn image_prompt(tokens: usize) -> Vec<u32> {
    let mut ids = text_prompt(6, 11);
    ids.push(990);
    ids.extend(std::iter::repeat_n(993, tokens));
    ids.push(991);
    ids.extend(text_prompt(9, 12));
    ids
}

/// The in-process oracle for an image prompt: the image's grid, the prompt ids (placeholders
/// expanded) and the greedy tokens of `vlm_model::oracle` (on the CPU backend's kernels) with the
/// same chunk and block sizes.
fn image_oracle(
    bytes: &[u8],
    chunk: usize,
    block_len: usize,
    max_new: usize,
) -> ([usize; 3], Vec<u32>, Vec<u32>) {
    use vlm_backend_cpu::{CpuKernels, CpuOptions};
    use vlm_model::oracle::Oracle;
    use vlm_preprocess::{preprocess_bytes, PreprocessConfig};
    let kernels = CpuKernels::new(CpuOptions::detect());
    let pipe = Oracle::load(&kernels, &tiny_dir(), vlm_model::DType::F32)
        .unwrap()
        .with_prefill_chunk_size(chunk)
        .with_block_len(block_len);
    let pv = preprocess_bytes(bytes, &PreprocessConfig::default()).unwrap();
    let grid = pv.grid_thw;
    let embeds = pipe.encode_images(&[pv]).unwrap();
    let ids = image_prompt(embeds[0].tokens());
    let oracle = pipe
        .generate_greedy(&ids, &embeds, max_new, &[])
        .unwrap()
        .tokens;
    (grid, ids, oracle)
}

#[tokio::test(flavor = "multi_thread")]
async fn greedy_with_image_matches_in_process_pipeline_and_hits_the_cache() {
    let bytes = std::fs::read(tiny_dir().join("synth_100x75/synthetic.png")).unwrap();

    // In-process oracle.
    let (chunk, block_len, max_new) = (128usize, 256usize, 12usize);
    let (grid, ids, oracle) = image_oracle(&bytes, chunk, block_len, max_new);

    let vision = start_vision();
    wait_serving(&vision).await;
    let lm = start_lm_for(
        &json!({
            "max_seq_len": 1024, "kvcache_partition_len": block_len,
            "batch_size": 4, "decoder_batch_sizes": [1, 2, 4], "prefill_chunk_size": chunk
        }),
        &vision.grpc,
    );
    wait_serving(&lm).await;
    let mut client = lm_client(&lm).await;
    let image = encoded_image(bytes, grid);
    let req = request(
        ids.clone(),
        vec![image.clone()],
        &vision.endpoint(),
        greedy(max_new as u32),
    );
    let (served, _) = generate(&mut client, req).await.unwrap();
    assert_eq!(
        served, oracle,
        "service greedy output differs from the in-process pipeline"
    );
    assert_eq!(lm.metric("vlm_lm_embedding_cache_misses_total"), Some(1.0));

    // The same image again: a cache hit, no vision call needed (even with the endpoint gone).
    drop(vision);
    let req = request(
        ids,
        vec![image],
        "http://127.0.0.1:1",
        greedy(max_new as u32),
    );
    let (again, _) = generate(&mut client, req).await.unwrap();
    assert_eq!(again, oracle);
    assert_eq!(lm.metric("vlm_lm_embedding_cache_hits_total"), Some(1.0));
}

#[tokio::test(flavor = "multi_thread")]
async fn image_split_across_prefill_chunks_matches_the_pipeline() {
    let bytes = std::fs::read(tiny_dir().join("jpeg_400x176/input.jpg")).unwrap();
    // 64-token chunks: the image's 72 rows (prompt tokens 7..79) straddle the chunk boundary.
    let (chunk, block_len, max_new) = (64usize, 32usize, 10usize);
    let (grid, ids, oracle) = image_oracle(&bytes, chunk, block_len, max_new);

    let vision = start_vision();
    let lm = start_lm_for(
        &json!({
            "max_seq_len": 512, "kvcache_partition_len": block_len,
            "batch_size": 2, "decoder_batch_sizes": [1, 2], "prefill_chunk_size": chunk
        }),
        &vision.grpc,
    );
    wait_serving(&vision).await;
    wait_serving(&lm).await;
    let mut client = lm_client(&lm).await;
    let image = encoded_image(bytes, grid);
    let req = request(ids, vec![image], &vision.endpoint(), greedy(max_new as u32));
    let (served, _) = generate(&mut client, req).await.unwrap();
    assert_eq!(served, oracle);
}

/// An image file as the gateway sends it: its bytes for the vision service, their SHA-256 and
/// the grid they preprocess to.
fn encoded_image(bytes: Vec<u8>, grid: [usize; 3]) -> LmImage {
    LmImage {
        content_hash: Sha256::digest(&bytes).to_vec(),
        grid: Some(ImageGrid {
            t: grid[0] as u32,
            h: grid[1] as u32,
            w: grid[2] as u32,
        }),
        input: Some(ImageInput {
            source: Some(vlm_proto::image_input::Source::Encoded(EncodedImage {
                data: bytes,
                mime_type: String::new(),
            })),
            content_hash: vec![],
            expected_grid: None,
            ..Default::default()
        }),
        video: false,
    }
}

/// The tiny fixtures' synthetic image as the gateway sends it (encoded, hashed, its grid), and
/// its number of image tokens.
fn synthetic_image() -> (LmImage, usize) {
    let bytes = std::fs::read(tiny_dir().join("synth_100x75/synthetic.png")).unwrap();
    let grid = vlm_preprocess::preprocess_bytes(&bytes, &Default::default())
        .unwrap()
        .grid_thw;
    let tokens = grid[0] * (grid[1] / 2) * (grid[2] / 2);
    let image = encoded_image(bytes, grid);
    (image, tokens)
}

#[tokio::test(flavor = "multi_thread")]
async fn preempted_image_prompts_recompute_to_identical_outputs() {
    let (image, tokens) = synthetic_image();
    let vision = start_vision();
    // 16 blocks of 16 tokens for four ~90-token image prompts generating up to 60 tokens each.
    let lm = start_lm_for(
        &json!({
            "max_seq_len": 256, "kvcache_partition_len": 16, "kvcache_num_blocks": 16,
            "batch_size": 4, "decoder_batch_sizes": [1, 2, 4], "prefill_chunk_size": 64
        }),
        &vision.grpc,
    );
    wait_serving(&vision).await;
    wait_serving(&lm).await;
    let mut client = lm_client(&lm).await;
    let reqs: Vec<_> = (0..4u32)
        .map(|i| {
            let mut ids = image_prompt(tokens);
            ids.extend(text_prompt(i as usize * 3 + 1, 20 + i));
            request(
                ids,
                vec![image.clone()],
                &vision.endpoint(),
                greedy(45 + i * 5),
            )
        })
        .collect();
    let mut alone = Vec::new();
    for r in &reqs {
        alone.push(generate(&mut client, r.clone()).await.unwrap().0);
    }
    let together = join_all(reqs.iter().map(|r| {
        let mut c = client.clone();
        let r = r.clone();
        async move { generate(&mut c, r).await.unwrap().0 }
    }))
    .await;
    assert!(
        lm.metric("vlm_lm_preemptions_total").unwrap_or(0.0) > 0.0,
        "the pool was meant to force preemption"
    );
    assert_eq!(alone, together);
    assert!(
        lm.metric("vlm_lm_packed_prefill_steps_total")
            .unwrap_or(0.0)
            > 0.0,
        "image prompts' chunks were meant to share steps"
    );
    assert_eq!(
        lm.metric("vlm_lm_embedding_cache_misses_total"),
        Some(1.0),
        "one vision call for the one image"
    );
}

/// Tokens, and the usage of the last event.
async fn generate_with_usage(
    client: &mut vlm_proto::lm_client::LmClient<tonic::transport::Channel>,
    req: vlm_proto::LmGenerateRequest,
) -> (Vec<u32>, vlm_proto::Usage) {
    let mut stream = client.generate(req).await.unwrap().into_inner();
    let (mut tokens, mut usage) = (Vec::new(), vlm_proto::Usage::default());
    while let Some(ev) = stream.message().await.unwrap() {
        tokens.extend_from_slice(&ev.token_ids);
        if let Some(u) = ev.usage {
            usage = u;
        }
    }
    (tokens, usage)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_second_turn_and_a_shared_image_read_their_prefix_from_the_cache() {
    let (image, tokens) = synthetic_image();
    let vision = start_vision();
    // The same layout with the prefix cache on (the default) and off; blocks of 16 tokens.
    let config = |caching: bool| {
        json!({
            "max_seq_len": 512, "kvcache_partition_len": 16, "kvcache_num_blocks": 64,
            "batch_size": 2, "decoder_batch_sizes": [1, 2], "prefill_chunk_size": 64,
            "prefix_caching": caching
        })
    };
    let (on, off) = (
        start_lm_for(&config(true), &vision.grpc),
        start_lm_for(&config(false), &vision.grpc),
    );
    wait_serving(&vision).await;
    wait_serving(&on).await;
    wait_serving(&off).await;
    let (mut c_on, mut c_off) = (lm_client(&on).await, lm_client(&off).await);
    for (c, want) in [(&mut c_on, true), (&mut c_off, false)] {
        let info = c.info(LmInfoRequest {}).await.unwrap().into_inner();
        assert_eq!(info.prefix_caching, want, "Lm.Info reports the switch");
    }
    let ask = |ids: Vec<u32>| request(ids, vec![image.clone()], &vision.endpoint(), greedy(8));

    // Turn 1 misses; both replicas agree.
    let turn1 = image_prompt(tokens);
    let (a_on, u1) = generate_with_usage(&mut c_on, ask(turn1.clone())).await;
    let (a_off, _) = generate_with_usage(&mut c_off, ask(turn1.clone())).await;
    assert_eq!(a_on, a_off);
    assert_eq!(u1.cached_tokens, 0);
    // Turn 2: turn 1, its answer and a new question. Its full blocks of turn 1 and the answer
    // are read from the cache, and the output is the one computed without the cache.
    let mut turn2 = turn1.clone();
    turn2.extend(&a_on);
    turn2.extend(text_prompt(20, 77));
    let (b_on, u2) = generate_with_usage(&mut c_on, ask(turn2.clone())).await;
    let (b_off, u2_off) = generate_with_usage(&mut c_off, ask(turn2.clone())).await;
    assert_eq!(b_on, b_off, "second turn: cache on vs off");
    let known = turn1.len() + a_on.len() - 1; // the last answer token is never computed
    assert_eq!(u2.cached_tokens as usize, known / 16 * 16, "{u2:?}");
    assert_eq!(u2_off.cached_tokens, 0);
    // Another prompt with the same text and image but its own question: the blocks up to where
    // they differ are shared.
    let mut other = turn1[..turn1.len() - 5].to_vec();
    other.extend(text_prompt(12, 99));
    let (c_on_out, u3) = generate_with_usage(&mut c_on, ask(other.clone())).await;
    let (c_off_out, _) = generate_with_usage(&mut c_off, ask(other.clone())).await;
    assert_eq!(c_on_out, c_off_out, "shared image prefix: cache on vs off");
    assert_eq!(
        u3.cached_tokens as usize,
        (turn1.len() - 5) / 16 * 16,
        "{u3:?}"
    );
    let hits = on.metric("vlm_lm_prefix_cache_hit_tokens_total").unwrap();
    assert_eq!(hits as u32, u2.cached_tokens + u3.cached_tokens);
    assert_eq!(
        off.metric("vlm_lm_prefix_cache_hit_tokens_total"),
        Some(0.0)
    );
}
