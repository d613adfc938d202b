//! gRPC request bodies as the servers read them: the bytes decoded as each request type of
//! `vlm.v1` (prost, and the `CheckedDecoder` every generated server uses, which must agree);
//! what decodes re-encodes to itself; a `GenerateRequest` then goes through the gateway's
//! `service::chat_request` and `Validator::validate` as its gRPC handler does. Never a panic.
#![no_main]
#[path = "../../gateway/tests/support/mod.rs"]
mod support;

use libfuzzer_sys::fuzz_target;
use prost::Message;
use std::sync::OnceLock;
use vlm_gateway::validation::Validator;
use vlm_proto::v1 as pb;

fn validator() -> &'static Validator {
    static V: OnceLock<(Validator, tempfile::TempDir)> = OnceLock::new();
    &V.get_or_init(support::tiny_validator).0
}

/// Decodes as `M`; what decodes must re-encode to bytes that decode to the same message.
fn round_trip<M: Message + Default + PartialEq + std::fmt::Debug>(bytes: &[u8]) -> Option<M> {
    let m = M::decode(bytes).ok()?;
    let again = M::decode(m.encode_to_vec().as_slice()).expect("a re-encoding does not decode");
    // NaN floats are the one case where a message is not equal to itself.
    if format!("{again:?}") != format!("{m:?}") {
        panic!("{again:?} != {m:?}");
    }
    Some(m)
}

fuzz_target!(|bytes: &[u8]| {
    round_trip::<pb::LmGenerateRequest>(bytes);
    round_trip::<pb::EncodeRequest>(bytes);
    if let Some(req) = round_trip::<pb::GenerateRequest>(bytes) {
        let checked =
            vlm_gateway::service::chat_request(req).and_then(|chat| validator().validate(chat));
        if let Err(e) = checked {
            assert!(
                !e.to_string().is_empty(),
                "a refusal without a message: {e:?}"
            );
        }
    }
});
