//! What every handler shares: the [`HttpState`], the API-key check, and reading a JSON body
//! within the body limit.
use crate::auth::ApiKeys;
use crate::error::GatewayError;
use crate::fetch::ImageFetcher;
use crate::generate::Core;
use axum::extract::Request;
use axum::http::header;
use serde_json::Value;
use tokio::sync::watch;

#[derive(Clone)]
pub struct HttpState {
    pub core: Core,
    pub keys: ApiKeys,
    pub ready: watch::Receiver<bool>,
    pub metrics: metrics_exporter_prometheus::PrometheusHandle,
    /// Fetches allow-listed http(s) image URLs.
    pub images: ImageFetcher,
}

pub(crate) fn auth(s: &HttpState, req: &Request) -> Result<(), GatewayError> {
    let h = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    s.keys.check(h)
}

/// Checks the API key, then reads a JSON body within the body limit: (body, its bytes). The
/// bytes are dropped here.
pub(crate) async fn read_json<T: serde::de::DeserializeOwned>(
    s: &HttpState,
    req: Request,
    what: &str,
) -> Result<(T, usize), GatewayError> {
    auth(s, &req)?;
    let limit = s.core.validator().limits().max_body_bytes;
    let body = axum::body::to_bytes(req.into_body(), limit)
        .await
        .map_err(|e| match crate::http_serve::BodyTimeout::find(&e) {
            Some(t) => GatewayError::RequestTimeout(t.to_string()),
            None => GatewayError::validation(format!(
                "request body is over the limit of {limit} bytes (--max-body-bytes)"
            )),
        })?;
    let parsed = parse_json_body(&body, what)?;
    Ok((parsed, body.len()))
}

/// A request body's JSON as the handlers read it: a value of the wrong type names its field
/// (serde's message cannot, past a flatten), anything else says which request it is not.
pub fn parse_json_body<T: serde::de::DeserializeOwned>(
    body: &[u8],
    what: &str,
) -> Result<T, GatewayError> {
    serde_json::from_slice(body).map_err(|e| {
        let named = e
            .is_data()
            .then(|| serde_json::from_slice::<Value>(body).ok())
            .flatten()
            .and_then(|v| super::sampling::mistyped_field(&v));
        named.unwrap_or_else(|| {
            GatewayError::validation(format!("request body is not a valid {what}: {e}"))
        })
    })
}
