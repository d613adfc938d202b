//! Property tests of decoding every request message of `vlm.v1` (issue 18): for each of
//! GenerateRequest (and its ChatMessage / ContentPart / ImagePart / SamplingParams /
//! StructuredOutput parts), LmGenerateRequest (LmImage), EncodeRequest (ImageInput,
//! EncodedImage, ResizedPixels) and the empty Info / Load requests:
//!
//! - a random valid message decodes from its encoding to itself;
//! - random bytes, and encodings of random messages truncated, with bytes flipped, inserted or
//!   spliced, never panic; what decodes re-encodes to bytes that decode to the same message;
//! - the codec every generated server uses (`vlm_proto::codec::ProstCodec`'s decoder, driven
//!   through tonic's `Streaming` exactly as a server reads a request body) answers bytes that
//!   do not decode with INVALID_ARGUMENT naming the message type, and bytes that do with what
//!   `prost::Message::decode` gives.
//!
//! Bounded: a fixed number of cases per property. A failing case is kept in
//! `proptest-regressions/fuzz_decode.txt` and replayed first on every run.
use bytes::Bytes;
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;
use prost::Message;
use std::collections::HashMap;
use std::fmt::Debug;
use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};
use tonic::Code;
use vlm_proto::codec::CheckedDecoder;
use vlm_proto::v1::{self as pb, content_part, image_input, structured_output};

/// `PROPTEST_CASES` (e.g. for a longer run by hand) overrides the bounded default.
fn config() -> ProptestConfig {
    ProptestConfig {
        cases: std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|n| n.parse().ok())
            .unwrap_or(1024),
        // Relative to the crate (cargo runs tests there): `proto/proptest-regressions/`.
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(
            "proptest-regressions/fuzz_decode.txt",
        ))),
        ..ProptestConfig::default()
    }
}

// ---- random valid messages (no NaN: `PartialEq` is then exact) ----

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z<|>_ ]{0,12}",
        Just("<|im_start|>".to_string()),
        any::<String>(),
    ]
}

fn blob() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(any::<u8>(), 0..48)
}

fn float() -> impl Strategy<Value = f32> {
    prop_oneof![
        any::<f32>().prop_filter("NaN never equals itself", |x| !x.is_nan()),
        Just(0.0f32),
        Just(f32::INFINITY),
        Just(f32::MIN_POSITIVE),
    ]
}

fn uint() -> impl Strategy<Value = u32> {
    prop_oneof![Just(0u32), Just(u32::MAX), 0u32..300, any::<u32>()]
}

fn grid() -> impl Strategy<Value = pb::ImageGrid> {
    (uint(), uint(), uint()).prop_map(|(t, h, w)| pb::ImageGrid { t, h, w })
}

fn structured() -> impl Strategy<Value = pb::StructuredOutput> {
    let kind = prop_oneof![
        text().prop_map(structured_output::Kind::JsonSchema),
        any::<bool>().prop_map(structured_output::Kind::JsonObject),
        text().prop_map(structured_output::Kind::Regex),
        prop::collection::vec(text(), 0..4)
            .prop_map(|choices| structured_output::Kind::Choice(pb::ChoiceList { choices })),
        text().prop_map(structured_output::Kind::Lark),
    ];
    prop::option::of(kind).prop_map(|kind| pb::StructuredOutput { kind })
}

fn sampling() -> impl Strategy<Value = pb::SamplingParams> {
    (
        (
            uint(),
            float(),
            float(),
            uint(),
            prop::option::of(any::<u64>()),
        ),
        (
            prop::collection::vec(text(), 0..3),
            prop::collection::vec(uint(), 0..4),
            any::<bool>(),
            float(),
            float(),
            float(),
        ),
        (
            float(),
            prop::collection::hash_map(uint(), float(), 0..4),
            uint(),
            any::<bool>(),
            uint(),
            prop::option::of(structured()),
            uint(),
        ),
    )
        .prop_map(
            |(
                (max_tokens, temperature, top_p, top_k, seed),
                (stop, stop_token_ids, ignore_eos, min_p, presence_penalty, frequency_penalty),
                (repetition_penalty, logit_bias, min_tokens, logprobs, top_logprobs, structured, n),
            )| pb::SamplingParams {
                max_tokens,
                temperature,
                top_p,
                top_k,
                seed,
                stop,
                stop_token_ids,
                ignore_eos,
                min_p,
                presence_penalty,
                frequency_penalty,
                repetition_penalty,
                logit_bias: logit_bias.into_iter().collect::<HashMap<_, _>>(),
                min_tokens,
                logprobs,
                top_logprobs,
                structured,
                n,
            },
        )
}

fn image_part() -> impl Strategy<Value = pb::ImagePart> {
    (blob(), text(), any::<u64>(), any::<u64>()).prop_map(
        |(data, mime_type, min_pixels, max_pixels)| pb::ImagePart {
            data,
            mime_type,
            min_pixels,
            max_pixels,
        },
    )
}

fn content_part() -> impl Strategy<Value = pb::ContentPart> {
    prop::option::of(prop_oneof![
        text().prop_map(content_part::Part::Text),
        image_part().prop_map(content_part::Part::Image),
    ])
    .prop_map(|part| pb::ContentPart { part })
}

fn chat_message() -> impl Strategy<Value = pb::ChatMessage> {
    (
        prop_oneof![
            prop::sample::select(vec!["system", "user", "assistant", "tool"])
                .prop_map(str::to_string),
            text()
        ],
        prop::collection::vec(content_part(), 0..4),
    )
        .prop_map(|(role, content)| pb::ChatMessage { role, content })
}

fn generate_request() -> impl Strategy<Value = pb::GenerateRequest> {
    (
        prop::collection::vec(chat_message(), 0..4),
        prop::option::of(sampling()),
        text(),
    )
        .prop_map(|(messages, sampling, model)| pb::GenerateRequest {
            messages,
            sampling,
            model,
        })
}

fn encoded_image() -> impl Strategy<Value = pb::EncodedImage> {
    (blob(), text()).prop_map(|(data, mime_type)| pb::EncodedImage { data, mime_type })
}

fn resized_pixels() -> impl Strategy<Value = pb::ResizedPixels> {
    (uint(), uint(), blob(), blob()).prop_map(|(width, height, rgb8, second_frame)| {
        pb::ResizedPixels {
            width,
            height,
            rgb8,
            second_frame,
        }
    })
}

fn image_input() -> impl Strategy<Value = pb::ImageInput> {
    (
        prop::option::of(prop_oneof![
            encoded_image().prop_map(image_input::Source::Encoded),
            resized_pixels().prop_map(image_input::Source::Pixels),
        ]),
        blob(),
        prop::option::of(grid()),
        any::<u64>(),
        any::<u64>(),
    )
        .prop_map(
            |(source, content_hash, expected_grid, min_pixels, max_pixels)| pb::ImageInput {
                source,
                content_hash,
                expected_grid,
                min_pixels,
                max_pixels,
            },
        )
}

fn lm_image() -> impl Strategy<Value = pb::LmImage> {
    (
        blob(),
        prop::option::of(grid()),
        prop::option::of(image_input()),
        any::<bool>(),
    )
        .prop_map(|(content_hash, grid, input, video)| pb::LmImage {
            content_hash,
            grid,
            input,
            video,
        })
}

fn lm_generate_request() -> impl Strategy<Value = pb::LmGenerateRequest> {
    (
        text(),
        prop::collection::vec(uint(), 0..16),
        prop::collection::vec(lm_image(), 0..3),
        text(),
        prop::option::of(sampling()),
    )
        .prop_map(
            |(request_id, input_ids, images, vision_replica, sampling)| pb::LmGenerateRequest {
                request_id,
                input_ids,
                images,
                vision_replica,
                sampling,
            },
        )
}

fn encode_request() -> impl Strategy<Value = pb::EncodeRequest> {
    (
        text(),
        prop::collection::vec(image_input(), 0..3),
        // Enum fields are open: values outside DType are kept as they are.
        prop_oneof![0i32..4, any::<i32>()],
    )
        .prop_map(|(request_id, images, dtype)| pb::EncodeRequest {
            request_id,
            images,
            dtype,
        })
}

// ---- bytes that are not quite encodings ----

#[derive(Debug, Clone)]
enum Mutation {
    Truncate(prop::sample::Index),
    Flip(prop::sample::Index, u8),
    Insert(prop::sample::Index, Vec<u8>),
    Remove(prop::sample::Index, usize),
    /// A varint-looking run of continuation bytes (the classic overlong/unterminated varint).
    Varint(prop::sample::Index, usize),
    /// Another message's bytes spliced in.
    Splice(prop::sample::Index, Vec<u8>),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let i = any::<prop::sample::Index>();
    prop_oneof![
        i.clone().prop_map(Mutation::Truncate),
        (i.clone(), 1u8..=255).prop_map(|(i, x)| Mutation::Flip(i, x)),
        (i.clone(), prop::collection::vec(any::<u8>(), 1..8))
            .prop_map(|(i, b)| Mutation::Insert(i, b)),
        (i.clone(), 1usize..8).prop_map(|(i, n)| Mutation::Remove(i, n)),
        (i.clone(), 1usize..12).prop_map(|(i, n)| Mutation::Varint(i, n)),
        (i, prop::collection::vec(any::<u8>(), 0..32)).prop_map(|(i, b)| Mutation::Splice(i, b)),
    ]
}

fn mutate(mut b: Vec<u8>, muts: &[Mutation]) -> Vec<u8> {
    for m in muts {
        let at = |i: &prop::sample::Index, len: usize| if len == 0 { 0 } else { i.index(len + 1) };
        match m {
            Mutation::Truncate(i) => b.truncate(at(i, b.len())),
            Mutation::Flip(i, x) => {
                if !b.is_empty() {
                    let k = i.index(b.len());
                    b[k] ^= x;
                }
            }
            Mutation::Insert(i, bytes) | Mutation::Splice(i, bytes) => {
                let k = at(i, b.len());
                b.splice(k..k, bytes.iter().copied());
            }
            Mutation::Remove(i, n) => {
                let k = at(i, b.len()).min(b.len());
                let end = (k + n).min(b.len());
                b.drain(k..end);
            }
            Mutation::Varint(i, n) => {
                let k = at(i, b.len());
                b.splice(k..k, std::iter::repeat_n(0xff, *n));
            }
        }
    }
    b
}

// ---- the checks ----

/// Equal, or both holding a NaN somewhere (random bytes decode to NaN floats, which never equal
/// themselves) with the same encoded length.
fn same<M: Message + PartialEq + Debug>(a: &M, b: &M) -> bool {
    a == b || (format!("{a:?}").contains("NaN") && a.encoded_len() == b.encoded_len())
}

/// Whatever `bytes` are: no panic; what decodes re-encodes to bytes that decode to the same
/// message (decoding is a projection onto what the encoder writes).
fn check_bytes<M: Message + Default + PartialEq + Debug + 'static>(
    bytes: &[u8],
) -> Result<(), TestCaseError> {
    if let Ok(m) = M::decode(bytes) {
        let again = M::decode(m.encode_to_vec().as_slice());
        prop_assert!(
            again.is_ok(),
            "re-encoding of a decoded message does not decode: {m:?}"
        );
        let again = again.unwrap();
        prop_assert!(same(&again, &m), "{again:?} != {m:?}");
        // Length-delimited framing (as gRPC-web and logs use) round-trips too.
        let framed = m.encode_length_delimited_to_vec();
        let back = M::decode_length_delimited(framed.as_slice());
        prop_assert!(back.is_ok_and(|b| same(&b, &m)));
    }
    check_codec::<M>(bytes)
}

/// A valid message decodes from its encoding to itself (also as a gRPC frame, through the codec).
fn check_round_trip<M: Message + Default + PartialEq + Debug + 'static>(
    m: &M,
) -> Result<(), TestCaseError> {
    let bytes = m.encode_to_vec();
    prop_assert_eq!(bytes.len(), m.encoded_len());
    let back = M::decode(bytes.as_slice());
    prop_assert!(back.is_ok(), "{:?}: {:?}", m, back);
    prop_assert_eq!(&back.unwrap(), m);
    let decoded = codec_decode::<M>(&bytes);
    prop_assert!(
        matches!(&decoded, Ok(Some(d)) if d == m),
        "codec: {:?}",
        decoded
    );
    Ok(())
}

/// One gRPC request body (a single uncompressed frame) through the decoder generated servers
/// use, read as tonic's server reads it.
fn codec_decode<M: Message + Default + 'static>(
    payload: &[u8],
) -> Result<Option<M>, tonic::Status> {
    let mut frame = Vec::with_capacity(payload.len() + 5);
    frame.push(0);
    frame.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    frame.extend_from_slice(payload);
    let body = http_body_util::Full::new(Bytes::from(frame));
    let mut s = tonic::Streaming::new_request(CheckedDecoder::<M>::default(), body, None, None);
    block_on(s.message())
}

/// The body is in memory: every poll is ready, no runtime needed.
fn block_on<F: Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    let mut cx = Context::from_waker(Waker::noop());
    for _ in 0..1000 {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
    }
    panic!("an in-memory body never finished decoding");
}

fn check_codec<M: Message + Default + PartialEq + Debug + 'static>(
    bytes: &[u8],
) -> Result<(), TestCaseError> {
    let direct = M::decode(bytes);
    match (codec_decode::<M>(bytes), direct) {
        (Ok(Some(via_codec)), Ok(direct)) => prop_assert!(same(&via_codec, &direct)),
        (Err(status), Err(_)) => {
            prop_assert_eq!(status.code(), Code::InvalidArgument, "{:?}", status);
            let name = std::any::type_name::<M>().rsplit("::").next().unwrap();
            prop_assert!(
                status.message().contains(&format!("not a valid {name}")),
                "{}",
                status.message()
            );
        }
        (codec, direct) => {
            return Err(TestCaseError::fail(format!(
                "the codec and prost disagree: codec {codec:?}, prost {direct:?}"
            )))
        }
    }
    Ok(())
}

/// Every property for one message type: its strategy, and the other request types its bytes
/// are also decoded as (a request sent to the wrong method).
macro_rules! message_props {
    ($name:ident, $ty:ty, $strategy:expr) => {
        mod $name {
            use super::*;
            proptest! {
                #![proptest_config(config())]

                #[test]
                fn round_trips(m in $strategy) {
                    check_round_trip::<$ty>(&m)?;
                }

                #[test]
                fn mutated_encodings_never_panic_and_reencode(
                    m in $strategy,
                    muts in prop::collection::vec(mutation(), 1..4),
                    other in generate_request(),
                ) {
                    let mut bytes = m.encode_to_vec();
                    // Splices take some of another message's real encoding.
                    if let Some(Mutation::Splice(_, b)) = muts.first() {
                        let o = other.encode_to_vec();
                        let mut b = b.clone();
                        b.extend_from_slice(&o[..o.len().min(24)]);
                        bytes.extend_from_slice(&b);
                    }
                    let bytes = mutate(bytes, &muts);
                    check_bytes::<$ty>(&bytes)?;
                }

                #[test]
                fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..96)) {
                    check_bytes::<$ty>(&bytes)?;
                    // Every request type reads the same bytes without a panic either.
                    check_bytes::<pb::GenerateRequest>(&bytes)?;
                    check_bytes::<pb::LmGenerateRequest>(&bytes)?;
                    check_bytes::<pb::EncodeRequest>(&bytes)?;
                }
            }
        }
    };
}

message_props!(
    generate_request_msg,
    pb::GenerateRequest,
    generate_request()
);
message_props!(chat_message_msg, pb::ChatMessage, chat_message());
message_props!(content_part_msg, pb::ContentPart, content_part());
message_props!(image_part_msg, pb::ImagePart, image_part());
message_props!(sampling_params_msg, pb::SamplingParams, sampling());
message_props!(structured_output_msg, pb::StructuredOutput, structured());
message_props!(
    lm_generate_request_msg,
    pb::LmGenerateRequest,
    lm_generate_request()
);
message_props!(lm_image_msg, pb::LmImage, lm_image());
message_props!(encode_request_msg, pb::EncodeRequest, encode_request());
message_props!(image_input_msg, pb::ImageInput, image_input());
message_props!(image_grid_msg, pb::ImageGrid, grid());
message_props!(
    lm_info_request_msg,
    pb::LmInfoRequest,
    Just(pb::LmInfoRequest {})
);
message_props!(load_request_msg, pb::LoadRequest, Just(pb::LoadRequest {}));
message_props!(
    vision_info_request_msg,
    pb::VisionInfoRequest,
    Just(pb::VisionInfoRequest {})
);

/// Known shapes that must be refused INVALID_ARGUMENT (not INTERNAL, which clients retry as a
/// server bug): an unterminated varint, a length past the end, a wrong wire type for a known
/// field, a string field holding invalid UTF-8, a deprecated group wire type.
#[test]
fn undecodable_requests_are_invalid_argument() {
    for bytes in [
        &[0x08, 0xff][..],
        &[0x0a, 0x10, b'a'],
        &[0x0d, 0, 0],
        &[0x1a, 0x02, 0xc3, 0x28],
        &[0x0b],
        &[
            0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01,
        ],
    ] {
        let s = codec_decode::<pb::GenerateRequest>(bytes).unwrap_err();
        assert_eq!(s.code(), Code::InvalidArgument, "{bytes:?}: {s:?}");
        assert!(
            s.message().contains("not a valid GenerateRequest"),
            "{}",
            s.message()
        );
    }
    // A valid one through the same path.
    let m = pb::GenerateRequest {
        model: "m".into(),
        ..Default::default()
    };
    let got = codec_decode::<pb::GenerateRequest>(&m.encode_to_vec()).unwrap();
    assert_eq!(got, Some(m));
}
