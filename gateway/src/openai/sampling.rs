//! The body fields both OpenAI routes (`/v1/chat/completions`, `/v1/completions`) share:
//! sampling, stop conditions and streaming options, read once into an [`InputSampling`]
//! together with the structured-output fields (`StructuredFields`, flattened beside these in
//! each route's body: serde's flatten does not nest). Each route adds its own (messages or
//! prompt, logprobs in its shape).
use super::params::check_unread;
use crate::error::GatewayError;
use crate::response_format::{structured_output, StructuredFields};
use crate::validation::InputSampling;
use serde::Deserialize;
use serde_json::{Map, Value};
use std::collections::BTreeMap;

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// `stream_options`: whether the stream ends with a usage chunk (default: it does not).
#[derive(Debug, Deserialize)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

#[derive(Debug, Default, Deserialize)]
pub struct SamplingFields {
    pub max_tokens: Option<u32>,
    pub max_completion_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// vLLM's extension; -1 (or 0) = off.
    pub top_k: Option<i64>,
    /// vLLM's extension.
    pub min_p: Option<f32>,
    pub seed: Option<u64>,
    pub stop: Option<Stop>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub ignore_eos: bool,
    pub n: Option<u32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    /// vLLM's extension: 1 = off.
    pub repetition_penalty: Option<f32>,
    /// Token id (as a string, as OpenAI sends it) -> bias in [-100, 100].
    pub logit_bias: Option<BTreeMap<String, f32>>,
    /// vLLM's extensions.
    pub min_tokens: Option<u32>,
    pub stop_token_ids: Option<Vec<u32>>,
}

/// The typed fields of both routes' bodies and whether a value has the type: a body serde
/// refuses is checked against them, so that the refusal names the field (serde's flatten loses
/// the path: "invalid value: integer `-1`, expected u32").
/// (field, the values it takes in words, whether a value is one).
type TypedField = (&'static str, &'static str, fn(&Value) -> bool);

const TYPED_FIELDS: &[TypedField] = &[
    (
        "max_tokens",
        "a whole number from 0 to 4294967295",
        is::<u32>,
    ),
    (
        "max_completion_tokens",
        "a whole number from 0 to 4294967295",
        is::<u32>,
    ),
    ("temperature", "a number", is::<f32>),
    ("top_p", "a number", is::<f32>),
    ("top_k", "a whole number", is::<i64>),
    ("min_p", "a number", is::<f32>),
    (
        "seed",
        "a whole number from 0 to 18446744073709551615",
        is::<u64>,
    ),
    ("stop", "a string or a list of strings", is::<Stop>),
    ("stream", "true or false", is::<bool>),
    ("stream_options", "an object", is::<StreamOptions>),
    ("ignore_eos", "true or false", is::<bool>),
    ("n", "a whole number from 0 to 4294967295", is::<u32>),
    ("presence_penalty", "a number", is::<f32>),
    ("frequency_penalty", "a number", is::<f32>),
    ("repetition_penalty", "a number", is::<f32>),
    (
        "logit_bias",
        "an object of token ids to numbers",
        is::<BTreeMap<String, f32>>,
    ),
    (
        "min_tokens",
        "a whole number from 0 to 4294967295",
        is::<u32>,
    ),
    ("stop_token_ids", "a list of token ids", is::<Vec<u32>>),
    (
        "top_logprobs",
        "a whole number from 0 to 4294967295",
        is::<u32>,
    ),
    ("echo", "true or false", is::<bool>),
    // A flag on the chat route, a count on the completions route.
    (
        "logprobs",
        "true or false (chat), a count (completions)",
        |v| is::<bool>(v) || is::<u32>(v),
    ),
];

fn is<T: serde::de::DeserializeOwned>(v: &Value) -> bool {
    v.is_null() || T::deserialize(v).is_ok()
}

/// The field of `body` (a JSON object) whose value has the wrong type, as a refusal naming
/// it; `None` when no known field is at fault.
pub fn mistyped_field(body: &Value) -> Option<GatewayError> {
    let obj = body.as_object()?;
    TYPED_FIELDS.iter().find_map(|(name, want, ok)| {
        let v = obj.get(*name)?;
        (!ok(v)).then(|| {
            let shown: String = v.to_string().chars().take(60).collect();
            GatewayError::param(name, format!("{name} is {shown}; it must be {want}"))
        })
    })
}

impl SamplingFields {
    /// Whether a streamed answer ends with a usage chunk (`stream_options.include_usage`;
    /// OpenAI's default, and vLLM's, is no usage).
    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false)
    }

    /// Into the domain form. `default_max_tokens` applies when neither max field is given
    /// (0 = the rest of the context); `logprobs` is (asked, alternatives); `forced` is a
    /// route's own constraint (a required tool call), which excludes any other.
    /// Fields the body leaves out take the server's defaults (`--generation-config`).
    pub fn fill_defaults(&mut self, d: &crate::sampling_defaults::SamplingDefaults) {
        self.temperature = self.temperature.or(d.temperature);
        self.top_p = self.top_p.or(d.top_p);
        self.top_k = self.top_k.or(d.top_k);
        self.min_p = self.min_p.or(d.min_p);
        self.repetition_penalty = self.repetition_penalty.or(d.repetition_penalty);
    }

    pub fn into_sampling(
        self,
        structured: StructuredFields,
        default_max_tokens: u32,
        logprobs: (bool, u32),
        forced: Option<vlm_proto::StructuredOutput>,
    ) -> Result<InputSampling, GatewayError> {
        if self.n == Some(0) {
            return Err(GatewayError::param("n", "n is 0; it must be at least 1"));
        }
        if let Some(o) = &self.stream_options {
            if !self.stream {
                return Err(GatewayError::param(
                    "stream_options",
                    "stream_options is only allowed with stream: true",
                ));
            }
            check_unread(&o.extra, "stream_options.")?;
        }
        let stop = match self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s],
            Some(Stop::Many(v)) => v,
        };
        let (max_param, max_tokens) = match (self.max_completion_tokens, self.max_tokens) {
            (Some(n), _) => ("max_completion_tokens", n),
            (None, Some(n)) => ("max_tokens", n),
            (None, None) => ("max_tokens", default_max_tokens),
        };
        if max_tokens == 0 && (self.max_completion_tokens.is_some() || self.max_tokens.is_some()) {
            return Err(GatewayError::param(
                max_param,
                format!(
                    "{max_param} is 0; it must be at least 1 (leave it out for the rest of the \
                     context)"
                ),
            ));
        }
        let top_k = match self.top_k.unwrap_or(0) {
            -1 | 0 => 0,
            k if (1..=u32::MAX as i64).contains(&k) => k as u32,
            k => {
                return Err(GatewayError::param(
                    "top_k",
                    format!("top_k is {k}; it must be -1 or 0 (off) or a positive count"),
                ))
            }
        };
        let mut logit_bias = Vec::new();
        for (k, &b) in self.logit_bias.iter().flatten() {
            let id = k.trim().parse::<u32>().map_err(|_| {
                GatewayError::param(
                    "logit_bias",
                    format!("logit_bias key {k:?} is not a token id"),
                )
            })?;
            logit_bias.push((id, b));
        }
        logit_bias.sort_by_key(|&(t, _)| t);
        let mut structured = structured_output(structured)?;
        if let Some(f) = forced {
            if structured.is_some() {
                return Err(GatewayError::param(
                    "tool_choice",
                    "a required or named tool_choice is a constraint of its own; it cannot be \
                     combined with response_format or structured_outputs",
                ));
            }
            structured = Some(f);
        }
        Ok(InputSampling {
            max_tokens,
            temperature: self.temperature.unwrap_or(1.0),
            top_p: self.top_p.unwrap_or(0.0),
            top_k,
            min_p: self.min_p.unwrap_or(0.0),
            seed: self.seed,
            stop,
            stop_token_ids: self.stop_token_ids.unwrap_or_default(),
            ignore_eos: self.ignore_eos,
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            repetition_penalty: self.repetition_penalty.unwrap_or(0.0),
            logit_bias,
            min_tokens: self.min_tokens.unwrap_or(0),
            logprobs: logprobs.0,
            top_logprobs: logprobs.1,
            structured,
            n: self.n.unwrap_or(1),
            max_tokens_param: max_param,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A route's body: its own field, the shared ones, and the rest.
    #[derive(Debug, Deserialize)]
    struct Body {
        #[allow(dead_code)]
        prompt: String,
        #[serde(flatten)]
        sampling: SamplingFields,
        #[serde(flatten)]
        structured: StructuredFields,
        #[serde(flatten)]
        extra: Map<String, Value>,
    }

    #[test]
    fn shared_fields_are_read_once_and_only_the_rest_is_left() {
        let b: Body = serde_json::from_value(json!({
            "prompt": "p", "temperature": 0.5, "top_k": -1, "logit_bias": {"7": 2.0},
            "stop": "x", "stream": true, "stream_options": {"include_usage": false},
            "guided_regex": "a+", "mystery": 1
        }))
        .unwrap();
        assert_eq!(b.extra.keys().collect::<Vec<_>>(), ["mystery"]);
        assert!(!b.sampling.include_usage());
        let s = b
            .sampling
            .into_sampling(b.structured, 16, (false, 0), None)
            .unwrap();
        assert!(s.structured.is_some());
        assert_eq!((s.temperature, s.top_k, s.max_tokens), (0.5, 0, 16));
        assert_eq!(
            (s.logit_bias.clone(), s.stop.clone()),
            (vec![(7, 2.0)], vec!["x".to_string()])
        );
    }
}
