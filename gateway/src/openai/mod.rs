//! The OpenAI-compatible HTTP surface: `POST /v1/chat/completions` (text and `image_url` parts
//! as `data:` URLs, or http(s):// URLs on `--allow-image-host` hosts, fetched by [`crate::fetch`];
//! `stream: true` as SSE chunks ending with `data: [DONE]`), `POST /v1/completions`, vLLM's
//! `/tokenize` and `/detokenize`, `GET /v1/models`, `GET /health`, `GET /metrics`. A body field
//! this server does not implement is a 400 naming it ([`params`]); other routes and methods are
//! OpenAI-shaped 404 / 405s.
//!
//! Files point one way: `routes` -> the handlers (`chat`, `completions`) -> `request` (the body
//! to a domain request; `images`, `video`, `sampling`, `params`) and `wire` (the answer's JSON
//! and SSE shapes) -> `state`.
pub mod chat;
pub mod completions;
pub mod images;
pub mod params;
pub mod request;
pub mod routes;
pub mod sampling;
pub mod state;
pub mod video;
pub mod wire;

pub use request::{parse_chat_request, to_chat_request, ChatCompletionRequest, ParsedChat};
pub use routes::router;
pub use state::HttpState;
