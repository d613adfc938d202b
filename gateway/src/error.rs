//! The gateway's error type and its two mappings: one to a gRPC `Status`, one to an HTTP
//! response. Domain code returns [`GatewayError`]; only the edges convert.
use axum::http::StatusCode;

/// Why admission refused a request; the `reason` label of
/// `vlm_gateway_admission_refusals_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OverloadReason {
    /// In-flight and queue are both full.
    QueueFull,
    /// The request alone needs more KV tokens than the whole budget.
    KvBudget,
    /// The gateway is draining.
    Draining,
    /// The vision service's wait line is full (or the request waited past its limit there).
    VisionBusy,
    /// The LM service refused the request as overloaded.
    LmBusy,
}

impl OverloadReason {
    pub fn label(self) -> &'static str {
        match self {
            OverloadReason::QueueFull => "queue_full",
            OverloadReason::KvBudget => "kv_budget",
            OverloadReason::Draining => "draining",
            OverloadReason::VisionBusy => "vision_busy",
            OverloadReason::LmBusy => "lm_busy",
        }
    }
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum GatewayError {
    /// The request is invalid; the message names the limit and the value.
    #[error("{0}")]
    Validation(String),
    /// One named request parameter is invalid or not supported (OpenAI's `param`).
    #[error("{message}")]
    InvalidParam { param: String, message: String },
    /// Admission refused it at once.
    #[error("overloaded ({}): {message}", reason.label())]
    Overloaded {
        reason: OverloadReason,
        message: String,
    },
    /// The request names a model this gateway does not serve (OpenAI's 404
    /// `model_not_found`, which the SDK raises as `NotFoundError`).
    #[error("the model {model:?} does not exist here; this server serves {served:?}")]
    ModelNotFound { model: String, served: String },
    /// Missing or wrong API key.
    #[error("unauthenticated: {0}")]
    Unauthenticated(String),
    /// No healthy replica, or a replica failed after output had started.
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// The caller went away.
    #[error("cancelled")]
    Cancelled,
    /// The request's deadline passed before it finished (the LM dropped the sequence).
    #[error("deadline exceeded: {0}")]
    DeadlineExceeded(String),
    /// The client did not send its request in time (a body that stopped arriving): HTTP 408.
    #[error("{0}")]
    RequestTimeout(String),
    /// An upstream service refused the request as invalid (passed on as is).
    #[error("{0}")]
    UpstreamInvalid(String),
    #[error("internal error: {0}")]
    Internal(String),
}

impl GatewayError {
    pub fn validation(msg: impl Into<String>) -> Self {
        GatewayError::Validation(msg.into())
    }

    /// A refusal naming the parameter at fault (`param` in the OpenAI error body).
    pub fn param(param: &str, msg: impl Into<String>) -> Self {
        GatewayError::InvalidParam {
            param: param.to_string(),
            message: msg.into(),
        }
    }

    /// The parameter this error names, if any.
    pub fn param_name(&self) -> Option<&str> {
        match self {
            GatewayError::InvalidParam { param, .. } => Some(param),
            GatewayError::ModelNotFound { .. } => Some("model"),
            _ => None,
        }
    }

    /// The `status` label of `vlm_gateway_requests_total`.
    pub fn status_label(&self) -> &'static str {
        match self {
            GatewayError::Validation(_)
            | GatewayError::InvalidParam { .. }
            | GatewayError::UpstreamInvalid(_)
            | GatewayError::ModelNotFound { .. } => "invalid",
            GatewayError::Overloaded { .. } => "overloaded",
            GatewayError::Unauthenticated(_) => "unauthenticated",
            GatewayError::Unavailable(_) => "unavailable",
            GatewayError::Cancelled => "cancelled",
            GatewayError::DeadlineExceeded(_) => "deadline",
            GatewayError::RequestTimeout(_) => "request_timeout",
            GatewayError::Internal(_) => "error",
        }
    }

    /// The HTTP status of this error.
    pub fn http_status(&self) -> StatusCode {
        match self {
            GatewayError::Validation(_)
            | GatewayError::InvalidParam { .. }
            | GatewayError::UpstreamInvalid(_) => StatusCode::BAD_REQUEST,
            GatewayError::ModelNotFound { .. } => StatusCode::NOT_FOUND,
            GatewayError::Overloaded { .. } => StatusCode::TOO_MANY_REQUESTS,
            GatewayError::Unauthenticated(_) => StatusCode::UNAUTHORIZED,
            GatewayError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            // nginx's "client closed request"; nobody reads it.
            GatewayError::Cancelled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
            GatewayError::DeadlineExceeded(_) => StatusCode::GATEWAY_TIMEOUT,
            GatewayError::RequestTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            GatewayError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// How long a client should wait before retrying (`Retry-After` on 429, `RetryInfo` on
    /// RESOURCE_EXHAUSTED); `None` when retrying the same request cannot help (it alone is
    /// over the KV budget).
    pub fn retry_after(&self) -> Option<std::time::Duration> {
        match self {
            GatewayError::Overloaded {
                reason:
                    OverloadReason::QueueFull
                    | OverloadReason::Draining
                    | OverloadReason::VisionBusy
                    | OverloadReason::LmBusy,
                ..
            } => Some(RETRY_AFTER),
            _ => None,
        }
    }

    /// The OpenAI error `type` string.
    pub fn openai_type(&self) -> &'static str {
        match self {
            GatewayError::Validation(_)
            | GatewayError::InvalidParam { .. }
            | GatewayError::UpstreamInvalid(_)
            | GatewayError::ModelNotFound { .. } => "invalid_request_error",
            GatewayError::Overloaded { .. } => "rate_limit_exceeded",
            GatewayError::Unauthenticated(_) => "authentication_error",
            GatewayError::Unavailable(_) => "service_unavailable",
            GatewayError::Cancelled => "cancelled",
            GatewayError::DeadlineExceeded(_) | GatewayError::RequestTimeout(_) => "timeout",
            GatewayError::Internal(_) => "server_error",
        }
    }

    /// The OpenAI error body: `{"error": {"message", "type", "param", "code"}}`.
    pub fn openai_body(&self) -> serde_json::Value {
        let code = match self {
            GatewayError::Overloaded { reason, .. } => serde_json::Value::from(reason.label()),
            GatewayError::ModelNotFound { .. } => serde_json::Value::from("model_not_found"),
            _ => serde_json::Value::Null,
        };
        openai_error_body(
            &self.client_message(),
            self.openai_type(),
            self.param_name(),
            code,
        )
    }
}

/// OpenAI's error body: `{"error": {"message", "type", "param", "code"}}` (every error this
/// API answers has this shape).
pub fn openai_error_body(
    message: &str,
    kind: &str,
    param: Option<&str>,
    code: serde_json::Value,
) -> serde_json::Value {
    serde_json::json!({"error": {"message": message, "type": kind, "param": param, "code": code}})
}

/// `msg` with anything that looks like an internal address (`http://...`, an IP with or
/// without a port, `[v6]:port`, `name.domain:port`, `localhost:port`) replaced by
/// `<internal>`: upstream messages reach clients only through this. The addresses go to the
/// logs, with the request id, where the failure is seen.
pub fn scrub_addresses(msg: &str) -> String {
    let mut out = String::with_capacity(msg.len());
    let mut word = String::new();
    let flush = |word: &mut String, out: &mut String| {
        // Trailing punctuation of a sentence is not part of the address.
        // (The LM prefixes a vision replica's message with `vision replica ADDR: `.)
        let core = word.trim_end_matches(['.', ',', ';', ')', ':']);
        let tail = &word[core.len()..];
        if looks_like_address(core) {
            out.push_str("<internal>");
            out.push_str(tail);
        } else {
            out.push_str(word);
        }
        word.clear();
    };
    for c in msg.chars() {
        if c.is_whitespace() || c == '"' || c == '\'' || c == '(' {
            flush(&mut word, &mut out);
            out.push(c);
        } else {
            word.push(c);
        }
    }
    flush(&mut word, &mut out);
    out
}

fn looks_like_address(w: &str) -> bool {
    if w.contains("://") {
        return true;
    }
    let ipv4 = |h: &str| h.split('.').count() == 4 && h.split('.').all(|p| p.parse::<u8>().is_ok());
    if ipv4(w) || w.starts_with('[') && w.contains("]:") {
        return true;
    }
    match w.rsplit_once(':') {
        Some((host, port)) if !port.is_empty() && port.chars().all(|c| c.is_ascii_digit()) => {
            ipv4(host)
                || host == "localhost"
                || (host.contains('.') && host.chars().any(|c| c.is_ascii_alphabetic()))
        }
        _ => false,
    }
}

impl GatewayError {
    /// The message a client sees: upstream failures scrubbed of internal addresses.
    pub fn client_message(&self) -> String {
        match self {
            GatewayError::Unavailable(_)
            | GatewayError::Internal(_)
            | GatewayError::DeadlineExceeded(_)
            | GatewayError::UpstreamInvalid(_) => scrub_addresses(&self.to_string()),
            _ => self.to_string(),
        }
    }
}

/// The wait suggested to overloaded clients: the queue turns over in about this long.
const RETRY_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

impl From<GatewayError> for tonic::Status {
    fn from(e: GatewayError) -> Self {
        use tonic_types::{ErrorDetails, StatusExt};
        let msg = e.client_message();
        if let Some(wait) = e.retry_after() {
            return tonic::Status::with_error_details(
                tonic::Code::ResourceExhausted,
                msg,
                ErrorDetails::with_retry_info(Some(wait)),
            );
        }
        match e {
            GatewayError::Validation(_)
            | GatewayError::InvalidParam { .. }
            | GatewayError::UpstreamInvalid(_) => tonic::Status::invalid_argument(msg),
            GatewayError::ModelNotFound { .. } => tonic::Status::not_found(msg),
            GatewayError::Overloaded { .. } => tonic::Status::resource_exhausted(msg),
            GatewayError::Unauthenticated(_) => tonic::Status::unauthenticated(msg),
            GatewayError::Unavailable(_) => tonic::Status::unavailable(msg),
            GatewayError::Cancelled => tonic::Status::cancelled(msg),
            GatewayError::DeadlineExceeded(_) => tonic::Status::deadline_exceeded(msg),
            GatewayError::RequestTimeout(_) => tonic::Status::invalid_argument(msg),
            GatewayError::Internal(_) => tonic::Status::internal(msg),
        }
    }
}

impl axum::response::IntoResponse for GatewayError {
    fn into_response(self) -> axum::response::Response {
        let mut r = (self.http_status(), axum::Json(self.openai_body())).into_response();
        if let Some(wait) = self.retry_after() {
            r.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from(wait.as_secs().max(1)),
            );
        }
        r
    }
}

/// Startup failures of [`crate::run`], by stage.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("loading the tokenizer from {dir}: {message}")]
    Tokenizer { dir: String, message: String },
    #[error("config: {0}")]
    Config(String),
    #[error("binding {what} on {addr}: {source}")]
    Bind {
        what: &'static str,
        addr: String,
        source: std::io::Error,
    },
    #[error("replica list {0}")]
    Replicas(String),
    #[error("reflection: {0}")]
    Reflection(String),
    #[error("serving gRPC: {0}")]
    Grpc(String),
    #[error("reading the API key file {path}: {source}")]
    ApiKey {
        path: String,
        source: std::io::Error,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn internal_addresses_are_scrubbed_from_client_messages() {
        let cases = [
            (
                "vision replica 10.1.2.3:50061 is unavailable",
                "vision replica <internal> is unavailable",
            ),
            ("at http://127.0.0.1:4000/x.", "at <internal>."),
            (
                "dial \"vlm-vision-0.vlm-vision.ns.svc:50061\"",
                "dial \"<internal>\"",
            ),
            (
                "[::1]:80 and localhost:9 and 192.168.0.1",
                "<internal> and <internal> and <internal>",
            ),
            (
                "vision replica 127.0.0.1:32889: image 0: corrupt Png image",
                "vision replica <internal>: image 0: corrupt Png image",
            ),
            // Not addresses: left as they are.
            (
                "image 0: truncated (max_seq_len: 4096)",
                "image 0: truncated (max_seq_len: 4096)",
            ),
            (
                "messages[0].role is \"x\"; ratio 1.5:1",
                "messages[0].role is \"x\"; ratio 1.5:1",
            ),
        ];
        for (msg, want) in cases {
            assert_eq!(scrub_addresses(msg), want, "{msg}");
        }
        let e = GatewayError::Unavailable("vision replica 127.0.0.1:5 failed".into());
        assert!(!tonic::Status::from(e.clone())
            .message()
            .contains("127.0.0.1"));
        assert!(!e.openai_body().to_string().contains("127.0.0.1"));
    }
}
