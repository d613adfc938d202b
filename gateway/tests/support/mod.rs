//! The gateway's OpenAI HTTP route served in process, without replicas: what a request looks
//! like once it has passed (or failed) the gateway's own checks.
#![allow(dead_code)]
use std::net::SocketAddr;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use vlm_gateway::admission::{Admission, AdmissionLimits};
use vlm_gateway::auth::ApiKeys;
use vlm_gateway::fetch::ImageFetcher;
use vlm_gateway::generate::Core;
use vlm_gateway::http_serve::HttpLimits;
use vlm_gateway::openai::{router, HttpState};
use vlm_gateway::routing::{ReplicaSource, Router, RoutingOptions};
use vlm_gateway::validation::{Limits, Validator};

/// The route's validator: the tiny tokenizer (its files in the directory returned), the default
/// config with ViT buckets up to 4096, 2 images and 1 MiB bodies at most, model "tiny".
pub fn tiny_validator() -> (Validator, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = vlm_make_model::MakeOptions::new(vlm_make_model::Preset::Tiny);
    opts.weights = false;
    vlm_make_model::make_model(dir.path(), &opts).unwrap();
    let tok = vlm_tokenizer::ChatTokenizer::from_dir(dir.path()).unwrap();
    let mut cfg = vlm_config::DeployConfig::default_config();
    cfg.visual.max_seq_len = vec![1024, 4096];
    let limits = Limits::from_config(&cfg, 2, 1 << 20);
    (Validator::new(tok, cfg.visual, limits, "tiny".into()), dir)
}

/// Serves the HTTP route on loopback over a tiny tokenizer (2 images per request at most, no
/// LM or vision replica: a valid request ends in 503); keep the directory alive.
pub async fn start_gateway(fetch: ImageFetcher) -> (SocketAddr, tempfile::TempDir) {
    let (state, dir) = http_state(fetch, 4);
    let addr = serve_state(state, HttpLimits::default()).await;
    (addr, dir)
}

/// The route's state over [`tiny_validator`], no replicas, `max_in_flight` requests admitted
/// at once (4 queued); keep the directory alive.
pub fn http_state(fetch: ImageFetcher, max_in_flight: usize) -> (HttpState, tempfile::TempDir) {
    let (validator, dir) = tiny_validator();
    let admission = Admission::new(AdmissionLimits {
        max_in_flight,
        max_queue: 4,
        max_kv_tokens: 0,
    });
    let routes = Router::new(
        ReplicaSource::Static(vec![]),
        ReplicaSource::Static(vec![]),
        RoutingOptions::default(),
    );
    let ready = routes.ready();
    let state = HttpState {
        core: Core::new(validator, admission, routes),
        keys: ApiKeys::load(None, None).unwrap(),
        ready,
        metrics: vlm_service_kit::metrics_http::recorder(),
        images: fetch,
    };
    (state, dir)
}

/// Serves `state`'s routes on loopback as the gateway does (its connection handling, under
/// `limits`) until the test ends.
pub async fn serve_state(state: HttpState, limits: HttpLimits) -> SocketAddr {
    serve_app(router(state), limits).await
}

/// Serves `app` on loopback with the gateway's connection handling until the test ends.
pub async fn serve_app(app: axum::Router, limits: HttpLimits) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(vlm_gateway::http_serve::serve(
        l,
        app,
        limits,
        tokio_util::sync::CancellationToken::new(),
    ));
    addr
}

/// One HTTP/1.1 request: (status, the whole response text).
pub async fn request(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.unwrap();
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, text)
}

/// `POST /v1/chat/completions` with `body`.
pub async fn post(addr: SocketAddr, body: &serde_json::Value) -> (u16, String) {
    request(addr, "POST", "/v1/chat/completions", &body.to_string()).await
}

/// The JSON body of a response [`request`] returned.
pub fn json_body(text: &str) -> serde_json::Value {
    let body = text.split("\r\n\r\n").nth(1).unwrap_or("");
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}
