//! `/v1/chat/completions` bodies as the handler reads them: JSON -> `ChatCompletionRequest`
//! (`openai::state::parse_json_body`) -> server sampling defaults -> `parse_chat_request` ->
//! `Validator::validate` (template, tokenizer, image and video headers, every limit), over the
//! tiny tokenizer with the gateway tests' limits (2 images, 1 MiB bodies, model "tiny").
//! Never a panic; a refusal has a message that names its `param`; what passes fits the
//! context with room for one token.
#![no_main]
#[path = "../../gateway/tests/support/mod.rs"]
mod support;

use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;
use vlm_gateway::fetch::{FetchOptions, ImageFetcher};
use vlm_gateway::openai::state::parse_json_body;
use vlm_gateway::openai::{parse_chat_request, ChatCompletionRequest};
use vlm_gateway::validation::Validator;
use vlm_gateway::GatewayError;

struct Env {
    validator: Validator,
    fetcher: ImageFetcher,
    _dir: tempfile::TempDir,
}

fn env() -> &'static Env {
    static ENV: OnceLock<Env> = OnceLock::new();
    ENV.get_or_init(|| {
        let (validator, dir) = support::tiny_validator();
        Env {
            validator,
            fetcher: ImageFetcher::new(FetchOptions::deny_all()),
            _dir: dir,
        }
    })
}

fn judge(body: &[u8]) -> Result<usize, GatewayError> {
    let e = env();
    let mut req: ChatCompletionRequest = parse_json_body(body, "chat completion request")?;
    req.sampling.fill_defaults(e.validator.sampling_defaults());
    let parsed = parse_chat_request(req, body.len(), &e.fetcher)?;
    assert!(
        parsed.remote.is_empty(),
        "deny_all let a remote image through"
    );
    Ok(e.validator.validate(parsed.chat)?.input_ids.len())
}

fuzz_target!(|body: &[u8]| {
    match judge(body) {
        Ok(prompt) => {
            let max = env().validator.limits().max_seq_len as usize;
            assert!(
                prompt < max,
                "a {prompt}-token prompt passed a {max}-token context"
            );
        }
        Err(e) => {
            let message = e.to_string();
            assert!(!message.is_empty(), "a refusal without a message: {e:?}");
            if let Some(p) = e.param_name() {
                assert!(message.contains(p), "{message:?} does not name {p:?}");
            }
        }
    }
});
