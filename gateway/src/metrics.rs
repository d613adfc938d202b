//! The gateway's metric names (exactly these) and small helpers to record them.
pub const REQUESTS_TOTAL: &str = "vlm_gateway_requests_total";
pub const QUEUE_DEPTH: &str = "vlm_gateway_queue_depth";
pub const IN_FLIGHT: &str = "vlm_gateway_in_flight";
pub const ADMISSION_REFUSALS_TOTAL: &str = "vlm_gateway_admission_refusals_total";
pub const TIME_TO_FIRST_TOKEN_SECONDS: &str = "vlm_gateway_time_to_first_token_seconds";
pub const REQUEST_DURATION_SECONDS: &str = "vlm_gateway_request_duration_seconds";
pub const PROMPT_TOKENS_TOTAL: &str = "vlm_gateway_prompt_tokens_total";
/// Prompt tokens of images and videos, labelled `kind` = image | video.
pub const VISION_TOKENS_TOTAL: &str = "vlm_gateway_vision_tokens_total";
pub const COMPLETION_TOKENS_TOTAL: &str = "vlm_gateway_completion_tokens_total";
pub const CACHED_PROMPT_TOKENS_TOTAL: &str = "vlm_gateway_cached_prompt_tokens_total";
pub const LM_ROUTES_TOTAL: &str = "vlm_gateway_lm_routes_total";
/// LM calls tried again on a new connection after theirs failed before the first token.
pub const LM_REDIALS_TOTAL: &str = "vlm_gateway_lm_redials_total";
/// Open connections of the HTTP port.
pub const HTTP_CONNECTIONS: &str = "vlm_gateway_http_connections";
/// HTTP connections closed by the gateway, by reason (see `http_serve`).
pub const HTTP_CONNECTIONS_CLOSED_TOTAL: &str = "vlm_gateway_http_connections_closed_total";

/// Registers every metric with a description, so `/metrics` lists them before the first request.
pub fn describe() {
    metrics::describe_counter!(REQUESTS_TOTAL, "Requests finished, by status");
    metrics::describe_gauge!(QUEUE_DEPTH, "Requests waiting for admission");
    metrics::describe_gauge!(IN_FLIGHT, "Requests admitted and not finished");
    metrics::describe_counter!(
        ADMISSION_REFUSALS_TOTAL,
        "Requests refused by admission, by reason"
    );
    metrics::describe_histogram!(
        TIME_TO_FIRST_TOKEN_SECONDS,
        "Time from arrival to the first token"
    );
    metrics::describe_histogram!(
        REQUEST_DURATION_SECONDS,
        "Time from arrival to the end of the response"
    );
    metrics::describe_counter!(
        PROMPT_TOKENS_TOTAL,
        "Prompt tokens of admitted requests, images included"
    );
    metrics::describe_counter!(COMPLETION_TOKENS_TOTAL, "Tokens generated");
    metrics::describe_counter!(
        CACHED_PROMPT_TOKENS_TOTAL,
        "Prompt tokens the LMs read from their prefix cache"
    );
    metrics::describe_counter!(
        LM_ROUTES_TOTAL,
        "LM replica choices, by route: prefix (the prompt's first KV block's replica), \
         prefix_busy (that replica was busy), load (no full first block, or prefix caching off)"
    );
    metrics::describe_counter!(
        LM_REDIALS_TOTAL,
        "LM calls that failed on their connection (not with a status from the LM) before the \
         first token and were tried again on the same replica over a new connection"
    );
    metrics::counter!(LM_REDIALS_TOTAL).increment(0);
    metrics::gauge!(QUEUE_DEPTH).set(0.0);
    metrics::gauge!(IN_FLIGHT).set(0.0);
    metrics::counter!(PROMPT_TOKENS_TOTAL).increment(0);
    metrics::counter!(COMPLETION_TOKENS_TOTAL).increment(0);
    metrics::counter!(CACHED_PROMPT_TOKENS_TOTAL).increment(0);
    metrics::describe_counter!(
        VISION_TOKENS_TOTAL,
        "Prompt tokens of images and videos of admitted requests, by kind"
    );
    for kind in ["image", "video"] {
        metrics::counter!(VISION_TOKENS_TOTAL, "kind" => kind).increment(0);
    }
    for route in ["prefix", "prefix_busy", "load"] {
        metrics::counter!(LM_ROUTES_TOTAL, "route" => route).increment(0);
    }
    for reason in ["queue_full", "kv_budget", "draining"] {
        metrics::counter!(ADMISSION_REFUSALS_TOTAL, "reason" => reason).increment(0);
    }
    metrics::describe_gauge!(HTTP_CONNECTIONS, "Open connections of the HTTP port");
    metrics::describe_counter!(
        HTTP_CONNECTIONS_CLOSED_TOTAL,
        "HTTP connections the gateway closed, by reason: header_timeout, idle_timeout, \
         over_cap (--http-max-connections)"
    );
    metrics::gauge!(HTTP_CONNECTIONS).set(0.0);
    for reason in ["header_timeout", "idle_timeout", "over_cap"] {
        metrics::counter!(HTTP_CONNECTIONS_CLOSED_TOTAL, "reason" => reason).increment(0);
    }
}

pub fn request_finished(status: &'static str) {
    metrics::counter!(REQUESTS_TOTAL, "status" => status).increment(1);
}
