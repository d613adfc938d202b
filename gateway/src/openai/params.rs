//! The OpenAI chat-completion parameters this server does not implement, and the check that
//! refuses them: a parameter that would change the output is never accepted and ignored.
//! A parameter given its no-op value (`store: false`, an empty `functions` list) or carrying only caller metadata (`user`, `metadata`)
//! is accepted, as is any parameter sent as `null` (what some clients send for "not given").
use crate::error::GatewayError;
use serde_json::{Map, Value};

/// Whether `param` set to `v` asks for nothing this server would do differently.
fn is_noop(param: &str, v: &Value) -> bool {
    match param {
        "store" | "echo" => v == &Value::Bool(false),
        // OpenAI's deprecated spellings of tools / tool_choice.
        "functions" => v.as_array().is_some_and(Vec::is_empty),
        "function_call" => v.as_str() == Some("none"),
        // Caller metadata: no effect on the output.
        "user" | "safety_identifier" | "prompt_cache_key" => v.is_string(),
        "metadata" => v.is_object(),
        "service_tier" => matches!(v.as_str(), Some("auto" | "default")),
        "modalities" => v
            .as_array()
            .is_some_and(|a| a.iter().all(|m| m.as_str() == Some("text"))),
        _ => false,
    }
}

/// The fields the chat-completion routes read, as their refusals list them.
pub const CHAT_FIELDS: &str = "model, messages, max_tokens, \
     max_completion_tokens, temperature, top_p, top_k, min_p, seed, stop, \
     stop_token_ids, presence_penalty, frequency_penalty, repetition_penalty, \
     logit_bias, logprobs, top_logprobs, min_tokens, ignore_eos, response_format, \
     structured_outputs, guided_json/regex/choice/grammar, tools, tool_choice, \
     parallel_tool_calls, stream, \
     stream_options.include_usage, n";

/// Refuses the first field of `extra` (the body's fields this server does not read) that is
/// not null and not its no-op value, naming it; `prefix` locates nested ones
/// (`messages[2].`).
pub fn check_unread(extra: &Map<String, Value>, prefix: &str) -> Result<(), GatewayError> {
    check_unread_of(extra, prefix, CHAT_FIELDS)
}

/// [`check_unread`] for a route whose fields are `supported` (listed in the refusal).
pub fn check_unread_of(
    extra: &Map<String, Value>,
    prefix: &str,
    supported: &str,
) -> Result<(), GatewayError> {
    let mut keys: Vec<&String> = extra.keys().collect();
    keys.sort();
    for k in keys {
        let v = &extra[k];
        if v.is_null() || is_noop(k, v) {
            continue;
        }
        let param = format!("{prefix}{k}");
        return Err(GatewayError::param(
            &param,
            format!(
                "`{param}` is not supported by this server (it would change the output, so it is \
                 refused rather than ignored); supported: {supported}"
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn check(v: Value) -> Result<(), GatewayError> {
        check_unread(v.as_object().unwrap(), "")
    }

    #[test]
    fn refuses_what_would_change_the_output_and_names_it() {
        for (body, param) in [
            (json!({"functions": [{"name": "f"}]}), "functions"),
            (json!({"reasoning_effort": "high"}), "reasoning_effort"),
            (json!({"some_future_field": 1}), "some_future_field"),
        ] {
            let e = check(body.clone()).unwrap_err();
            assert_eq!(e.param_name(), Some(param), "{body}");
            assert!(e.to_string().contains(&format!("`{param}`")), "{e}");
            assert_eq!(e.openai_body()["error"]["param"], param);
        }
    }

    #[test]
    fn accepts_no_op_values_metadata_and_nulls() {
        check(json!({
            "functions": [],
            "function_call": "none", "user": "u1",
            "metadata": {"k": "v"}, "store": false, "service_tier": "auto",
        "modalities": ["text"], "seed_extra": null
        }))
        .unwrap();
    }

    #[test]
    fn nested_fields_are_named_with_their_place() {
        let e =
            check_unread(json!({"name": "bob"}).as_object().unwrap(), "messages[1].").unwrap_err();
        assert_eq!(e.param_name(), Some("messages[1].name"));
    }
}
