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
}

impl OverloadReason {
    pub fn label(self) -> &'static str {
        match self {
            OverloadReason::QueueFull => "queue_full",
            OverloadReason::KvBudget => "kv_budget",
            OverloadReason::Draining => "draining",
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
            _ => None,
        }
    }

    /// The `status` label of `vlm_gateway_requests_total`.
    pub fn status_label(&self) -> &'static str {
        match self {
            GatewayError::Validation(_)
            | GatewayError::InvalidParam { .. }
            | GatewayError::UpstreamInvalid(_) => "invalid",
            GatewayError::Overloaded { .. } => "overloaded",
            GatewayError::Unauthenticated(_) => "unauthenticated",
            GatewayError::Unavailable(_) => "unavailable",
            GatewayError::Cancelled => "cancelled",
            GatewayError::DeadlineExceeded(_) => "deadline",
            GatewayError::Internal(_) => "error",
        }
    }

    /// The HTTP status of this error.
    pub fn http_status(&self) -> StatusCode {
        match self {
            GatewayError::Validation(_)
            | GatewayError::InvalidParam { .. }
            | GatewayError::UpstreamInvalid(_) => StatusCode::BAD_REQUEST,
            GatewayError::Overloaded { .. } => StatusCode::TOO_MANY_REQUESTS,
            GatewayError::Unauthenticated(_) => StatusCode::UNAUTHORIZED,
            GatewayError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            // nginx's "client closed request"; nobody reads it.
            GatewayError::Cancelled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
            GatewayError::DeadlineExceeded(_) => StatusCode::GATEWAY_TIMEOUT,
            GatewayError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The OpenAI error `type` string.
    pub fn openai_type(&self) -> &'static str {
        match self {
            GatewayError::Validation(_)
            | GatewayError::InvalidParam { .. }
            | GatewayError::UpstreamInvalid(_) => "invalid_request_error",
            GatewayError::Overloaded { .. } => "rate_limit_exceeded",
            GatewayError::Unauthenticated(_) => "authentication_error",
            GatewayError::Unavailable(_) => "service_unavailable",
            GatewayError::Cancelled => "cancelled",
            GatewayError::DeadlineExceeded(_) => "timeout",
            GatewayError::Internal(_) => "server_error",
        }
    }

    /// The OpenAI error body: `{"error": {"message", "type", "param", "code"}}`.
    pub fn openai_body(&self) -> serde_json::Value {
        let code = match self {
            GatewayError::Overloaded { reason, .. } => serde_json::Value::from(reason.label()),
            _ => serde_json::Value::Null,
        };
        openai_error_body(
            &self.to_string(),
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

impl From<GatewayError> for tonic::Status {
    fn from(e: GatewayError) -> Self {
        let msg = e.to_string();
        match e {
            GatewayError::Validation(_)
            | GatewayError::InvalidParam { .. }
            | GatewayError::UpstreamInvalid(_) => tonic::Status::invalid_argument(msg),
            GatewayError::Overloaded { .. } => tonic::Status::resource_exhausted(msg),
            GatewayError::Unauthenticated(_) => tonic::Status::unauthenticated(msg),
            GatewayError::Unavailable(_) => tonic::Status::unavailable(msg),
            GatewayError::Cancelled => tonic::Status::cancelled(msg),
            GatewayError::DeadlineExceeded(_) => tonic::Status::deadline_exceeded(msg),
            GatewayError::Internal(_) => tonic::Status::internal(msg),
        }
    }
}

impl axum::response::IntoResponse for GatewayError {
    fn into_response(self) -> axum::response::Response {
        (self.http_status(), axum::Json(self.openai_body())).into_response()
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
