//! The limits of `vlm.v1.SamplingParams`, checked in one place by both the gateway (before any
//! work, so a client hears the parameter it got wrong) and the LM (which trusts no caller).
use vlm_proto::v1 as pb;

/// Most entries of `logit_bias` (OpenAI documents no limit; vLLM's default is unbounded; this
/// bounds the per-step work of one request).
pub const MAX_LOGIT_BIAS: usize = 1024;
/// Most alternatives per position (`top_logprobs`), as OpenAI.
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// Most bytes of a grammar (schema, regex, Lark text, all choices together).
pub const MAX_GRAMMAR_BYTES: usize = 64 << 10;
/// Most choices per request (`n`).
pub const MAX_N: u32 = 16;
/// Most strings of a choice.
pub const MAX_CHOICES: usize = 256;

/// A sampling parameter out of its range: which one, and why.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct SamplingError {
    /// The parameter's name as the APIs spell it (`presence_penalty`, `logit_bias`, ...).
    pub param: &'static str,
    pub message: String,
}

fn err(param: &'static str, message: String) -> SamplingError {
    SamplingError { param, message }
}

fn in_range(param: &'static str, v: f32, lo: f32, hi: f32) -> Result<(), SamplingError> {
    if v.is_finite() && (lo..=hi).contains(&v) {
        Ok(())
    } else {
        Err(err(
            param,
            format!("{param} is {v}; it must be in [{lo}, {hi}]"),
        ))
    }
}

/// Checks every field's range. `vocab` (when known) bounds the token ids of `logit_bias` and
/// `stop_token_ids`.
pub fn check(s: &pb::SamplingParams, vocab: Option<usize>) -> Result<(), SamplingError> {
    if !(s.temperature.is_finite() && s.temperature >= 0.0) {
        return Err(err(
            "temperature",
            format!("temperature is {}; it must be >= 0", s.temperature),
        ));
    }
    in_range("top_p", s.top_p, 0.0, 1.0)?;
    in_range("min_p", s.min_p, 0.0, 1.0)?;
    in_range("presence_penalty", s.presence_penalty, -2.0, 2.0)?;
    in_range("frequency_penalty", s.frequency_penalty, -2.0, 2.0)?;
    // vLLM's bound is > 0 (0 is the wire's "unset"); above 2 no model is usable.
    if s.repetition_penalty != 0.0 {
        in_range("repetition_penalty", s.repetition_penalty, 0.01, 2.0)?;
    }
    if s.logit_bias.len() > MAX_LOGIT_BIAS {
        return Err(err(
            "logit_bias",
            format!(
                "logit_bias has {} entries, over the limit of {MAX_LOGIT_BIAS}",
                s.logit_bias.len()
            ),
        ));
    }
    let mut bias: Vec<(&u32, &f32)> = s.logit_bias.iter().collect();
    bias.sort_by_key(|(id, _)| **id);
    for (&id, &b) in bias {
        if !(b.is_finite() && (-100.0..=100.0).contains(&b)) {
            return Err(err(
                "logit_bias",
                format!("logit_bias[{id}] is {b}; each bias must be in [-100, 100]"),
            ));
        }
        if let Some(v) = vocab.filter(|&v| id as usize >= v) {
            return Err(err(
                "logit_bias",
                format!("logit_bias names token id {id}, out of the vocabulary (size {v})"),
            ));
        }
    }
    if let Some(v) = vocab {
        if let Some(&id) = s.stop_token_ids.iter().find(|&&t| t as usize >= v) {
            return Err(err(
                "stop_token_ids",
                format!("stop_token_ids has {id}, out of the vocabulary (size {v})"),
            ));
        }
    }
    if s.max_tokens != 0 && s.min_tokens > s.max_tokens {
        return Err(err(
            "min_tokens",
            format!(
                "min_tokens ({}) is over max_tokens ({})",
                s.min_tokens, s.max_tokens
            ),
        ));
    }
    if s.top_logprobs > MAX_TOP_LOGPROBS {
        return Err(err(
            "top_logprobs",
            format!(
                "top_logprobs is {}; it must be in [0, {MAX_TOP_LOGPROBS}]",
                s.top_logprobs
            ),
        ));
    }
    if s.n > MAX_N {
        return Err(err(
            "n",
            format!("n is {}; it must be in [1, {MAX_N}]", s.n),
        ));
    }
    if let Some(g) = &s.structured {
        check_structured(g)?;
    }
    if s.top_logprobs > 0 && !s.logprobs {
        return Err(err(
            "top_logprobs",
            "top_logprobs needs logprobs: true".to_string(),
        ));
    }
    Ok(())
}

/// The grammar's size (the LM compiles it; this bounds that work) and shape.
fn check_structured(g: &pb::StructuredOutput) -> Result<(), SamplingError> {
    use pb::structured_output::Kind;
    let p = "structured";
    let bytes = match &g.kind {
        None => return Err(err(
            p,
            "structured is set but names no kind (json_schema, json_object, regex, choice or lark)"
                .into(),
        )),
        Some(Kind::JsonObject(false)) => {
            return Err(err(
                p,
                "structured.json_object must be true when given".into(),
            ))
        }
        Some(Kind::JsonObject(true)) => 0,
        Some(Kind::JsonSchema(t) | Kind::Regex(t) | Kind::Lark(t)) => {
            if t.is_empty() {
                return Err(err(p, "structured: the grammar text is empty".into()));
            }
            t.len()
        }
        Some(Kind::Choice(c)) => {
            if c.choices.is_empty() || c.choices.len() > MAX_CHOICES {
                return Err(err(
                    p,
                    format!(
                        "structured.choice has {} strings; it must have 1 to {MAX_CHOICES}",
                        c.choices.len()
                    ),
                ));
            }
            c.choices.iter().map(String::len).sum()
        }
    };
    if bytes > MAX_GRAMMAR_BYTES {
        return Err(err(
            p,
            format!(
                "structured: the grammar is {bytes} bytes, over the limit of {MAX_GRAMMAR_BYTES}"
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(f: impl FnOnce(&mut pb::SamplingParams)) -> Result<(), SamplingError> {
        let mut s = pb::SamplingParams::default();
        f(&mut s);
        check(&s, Some(100))
    }

    #[test]
    fn defaults_pass_and_each_range_names_its_parameter() {
        assert_eq!(with(|_| {}), Ok(()));
        assert_eq!(
            with(|s| {
                s.min_p = 0.5;
                s.presence_penalty = -2.0;
                s.frequency_penalty = 2.0;
                s.repetition_penalty = 1.3;
                s.logit_bias.insert(99, -100.0);
                s.min_tokens = 3;
                s.max_tokens = 3;
                s.logprobs = true;
                s.top_logprobs = 20;
            }),
            Ok(())
        );
        type Edit = Box<dyn Fn(&mut pb::SamplingParams)>;
        let cases: Vec<(&str, Edit)> = vec![
            ("temperature", Box::new(|s| s.temperature = -0.1)),
            ("top_p", Box::new(|s| s.top_p = 1.5)),
            ("min_p", Box::new(|s| s.min_p = f32::NAN)),
            ("presence_penalty", Box::new(|s| s.presence_penalty = 2.5)),
            (
                "frequency_penalty",
                Box::new(|s| s.frequency_penalty = -3.0),
            ),
            (
                "repetition_penalty",
                Box::new(|s| s.repetition_penalty = -1.0),
            ),
            (
                "repetition_penalty",
                Box::new(|s| s.repetition_penalty = 5.0),
            ),
            (
                "logit_bias",
                Box::new(|s| {
                    s.logit_bias.insert(1, 101.0);
                }),
            ),
            (
                "logit_bias",
                Box::new(|s| {
                    s.logit_bias.insert(100, 1.0);
                }),
            ),
            (
                "logit_bias",
                Box::new(|s| {
                    s.logit_bias = (0..MAX_LOGIT_BIAS as u32 + 1).map(|i| (i, 0.0)).collect();
                }),
            ),
            (
                "stop_token_ids",
                Box::new(|s| s.stop_token_ids = vec![3, 100]),
            ),
            (
                "min_tokens",
                Box::new(|s| {
                    s.min_tokens = 5;
                    s.max_tokens = 4;
                }),
            ),
            (
                "top_logprobs",
                Box::new(|s| {
                    s.logprobs = true;
                    s.top_logprobs = 21;
                }),
            ),
            ("top_logprobs", Box::new(|s| s.top_logprobs = 2)),
            (
                "structured",
                Box::new(|s| s.structured = Some(pb::StructuredOutput { kind: None })),
            ),
            (
                "structured",
                Box::new(|s| {
                    s.structured = Some(pb::StructuredOutput {
                        kind: Some(pb::structured_output::Kind::Regex(
                            "x".repeat(MAX_GRAMMAR_BYTES + 1),
                        )),
                    })
                }),
            ),
            (
                "structured",
                Box::new(|s| {
                    s.structured = Some(pb::StructuredOutput {
                        kind: Some(pb::structured_output::Kind::Choice(pb::ChoiceList {
                            choices: vec![],
                        })),
                    })
                }),
            ),
        ];
        for (param, f) in cases {
            let mut s = pb::SamplingParams::default();
            f(&mut s);
            let e = check(&s, Some(100)).unwrap_err();
            assert_eq!(e.param, param, "{e}");
            assert!(e.message.contains(param), "{e}");
        }
    }

    #[test]
    fn token_ids_are_bounded_only_when_the_vocabulary_is_known() {
        let mut s = pb::SamplingParams::default();
        s.logit_bias.insert(500_000, 1.0);
        assert!(check(&s, None).is_ok());
        assert!(check(&s, Some(151_936)).is_err());
    }
}
