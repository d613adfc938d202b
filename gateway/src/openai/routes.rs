//! The router: each route to its handler, and the answers that need no model (health,
//! metrics, the model list, OpenAI-shaped 404 / 405s).
use super::state::{auth, HttpState};
use crate::error::{openai_error_body, GatewayError};
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value};

pub fn router(state: HttpState) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(super::chat::chat_completions))
        .route("/v1/completions", post(super::completions::completions))
        .route("/tokenize", post(super::completions::tokenize))
        .route("/detokenize", post(super::completions::detokenize))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn(trim_after_large_bodies))
        .with_state(state)
}

/// After a request whose body was large (a refused 30 MB prompt, a body of images), the heap it
/// freed goes back to the system instead of staying with the process.
async fn trim_after_large_bodies(req: Request, next: axum::middleware::Next) -> Response {
    let length = req
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
        .unwrap_or(0);
    let _trim = vlm_service_kit::memory::TrimOnDrop::for_bytes(length);
    next.run(req).await
}

/// OpenAI's error body for an HTTP status this API answers outside its handlers.
fn route_error(status: StatusCode, message: String) -> Response {
    let body = openai_error_body(
        &message,
        "invalid_request_error",
        None,
        status.as_u16().into(),
    );
    (status, axum::Json(body)).into_response()
}

async fn not_found(req: Request) -> Response {
    route_error(
        StatusCode::NOT_FOUND,
        format!(
            "no route {} {}: this server serves POST /v1/chat/completions, POST /v1/completions, \
             POST /tokenize, POST /detokenize, GET /v1/models, GET /v1/models/{{id}}, \
             GET /health, GET /metrics",
            req.method(),
            req.uri().path()
        ),
    )
}

async fn method_not_allowed(req: Request) -> Response {
    route_error(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("{} is not allowed on {}", req.method(), req.uri().path()),
    )
}

async fn health(State(s): State<HttpState>) -> Response {
    if *s.ready.borrow() {
        (StatusCode::OK, "ok\n").into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: no healthy LM or vision replica\n",
        )
            .into_response()
    }
}

async fn metrics_text(State(s): State<HttpState>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.metrics.render(),
    )
        .into_response()
}

/// The served model as `/v1/models` lists it, or why it cannot be listed yet: tools that
/// wait for a server by polling `/v1/models` (as they do for vLLM, whose port opens only when
/// it can serve) see 503 for as long as `/health` does.
fn served_model(s: &HttpState, req: &Request) -> Result<Value, GatewayError> {
    auth(s, req)?;
    if !*s.ready.borrow() {
        return Err(GatewayError::Unavailable(
            "not ready: no healthy LM or vision replica yet (GET /health turns 200 when it can \
             serve)"
                .into(),
        ));
    }
    let id = s.core.validator().model_id();
    Ok(json!({"id": id, "object": "model", "created": 0, "owned_by": "vlm"}))
}

async fn models(State(s): State<HttpState>, req: Request) -> Response {
    match served_model(&s, &req) {
        Ok(m) => axum::Json(json!({"object": "list", "data": [m]})).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `GET /v1/models/{id}` (the SDK's `models.retrieve`): the served model, else 404.
async fn model(
    State(s): State<HttpState>,
    axum::extract::Path(id): axum::extract::Path<String>,
    req: Request,
) -> Response {
    let served = match served_model(&s, &req) {
        Ok(m) => m,
        Err(e) => return e.into_response(),
    };
    match s.core.validator().check_model(&id) {
        Ok(()) if !id.is_empty() => axum::Json(served).into_response(),
        Ok(()) | Err(_) => GatewayError::ModelNotFound {
            model: id,
            served: s.core.validator().model_id().to_string(),
        }
        .into_response(),
    }
}
