//! Logprobs as the edges show them: each token's text and bytes beside its log-probability
//! (OpenAI's `{token, logprob, bytes, top_logprobs}`; the gRPC API's `TokenLogprob.token`).
use serde_json::{json, Value};
use vlm_proto::v1 as pb;
use vlm_service_kit::generation::TokenLogprob;
use vlm_tokenizer::ChatTokenizer;

/// One token with its text.
#[derive(Debug, Clone, PartialEq)]
pub struct ShownToken {
    pub token_id: u32,
    /// The token's bytes as text (a byte of a split character shows as U+FFFD; `bytes` keeps
    /// it exact).
    pub token: String,
    pub bytes: Vec<u8>,
    pub logprob: f32,
}

/// A generated token's logprob and the most likely alternatives, most likely first.
#[derive(Debug, Clone, PartialEq)]
pub struct ShownLogprob {
    pub chosen: ShownToken,
    pub top: Vec<ShownToken>,
}

fn shown(tok: &ChatTokenizer, token_id: u32, logprob: f32) -> ShownToken {
    let bytes = tok.token_bytes(token_id).unwrap_or_default();
    ShownToken {
        token_id,
        token: String::from_utf8_lossy(&bytes).into_owned(),
        bytes,
        logprob,
    }
}

/// Texts for the LM's ids.
pub fn show(tok: &ChatTokenizer, l: TokenLogprob) -> ShownLogprob {
    ShownLogprob {
        chosen: shown(tok, l.token_id, l.logprob),
        top: l
            .top
            .into_iter()
            .map(|(id, lp)| shown(tok, id, lp))
            .collect(),
    }
}

/// JSON has no -inf: OpenAI sends -9999.0 for a token of (numerically) no probability.
fn json_logprob(x: f32) -> f64 {
    if x.is_finite() {
        x as f64
    } else {
        -9999.0
    }
}

impl ShownToken {
    fn openai_json(&self) -> Value {
        json!({"token": self.token, "logprob": json_logprob(self.logprob), "bytes": self.bytes})
    }
}

impl ShownLogprob {
    /// One entry of OpenAI's `choices[i].logprobs.content`.
    pub fn openai_json(&self) -> Value {
        let mut v = self.chosen.openai_json();
        v["top_logprobs"] = self.top.iter().map(ShownToken::openai_json).collect();
        v
    }

    pub fn to_wire(&self) -> pb::TokenLogprob {
        pb::TokenLogprob {
            token_id: self.chosen.token_id,
            logprob: self.chosen.logprob,
            top_logprobs: self
                .top
                .iter()
                .map(|t| pb::TopLogprob {
                    token_id: t.token_id,
                    logprob: t.logprob,
                    token: t.token.clone(),
                })
                .collect(),
            token: self.chosen.token.clone(),
        }
    }
}

/// OpenAI's `choices[i].logprobs`: `{"content": [...]}`.
pub fn openai_content(l: &[ShownLogprob]) -> Value {
    json!({"content": l.iter().map(ShownLogprob::openai_json).collect::<Vec<_>>()})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openai_shape_with_bytes_and_a_json_safe_floor() {
        let tok =
            vlm_tokenizer::ChatTokenizer::from_dir(&crate::validation::tests::tiny_dir()).unwrap();
        let ids = tok.encode("hi").unwrap();
        let l = show(
            &tok,
            TokenLogprob {
                token_id: ids[0],
                logprob: -0.25,
                top: vec![(ids[0], -0.25), (0, f32::NEG_INFINITY)],
            },
        );
        let v = openai_content(std::slice::from_ref(&l));
        let c = &v["content"][0];
        assert_eq!(c["token"], l.chosen.token);
        assert_eq!(c["logprob"], -0.25);
        assert_eq!(c["bytes"], json!(tok.token_bytes(ids[0]).unwrap()));
        assert_eq!(c["top_logprobs"][1]["logprob"], -9999.0);
        assert_eq!(c["top_logprobs"].as_array().unwrap().len(), 2);
        let w = l.to_wire();
        assert_eq!((w.token_id, w.top_logprobs.len()), (ids[0], 2));
        assert_eq!(w.token, l.chosen.token);
    }
}
