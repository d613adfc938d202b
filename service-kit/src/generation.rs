//! Why a generation ended and its token accounting: one definition for the LM and the gateway,
//! and the only conversions to and from the wire types (`vlm.v1.FinishReason`, `vlm.v1.Usage`).
use vlm_proto::v1 as pb;

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// EOS, a stop token id, or a stop string.
    Stop,
    /// `max_tokens` (or the context) reached.
    Length,
    /// The request was cancelled (deadline, the caller going away, shutdown).
    Cancelled,
}

/// Token accounting of one generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub image_tokens: u32,
    pub completion_tokens: u32,
    /// Of `prompt_tokens`, those read from the LM's prefix cache instead of computed.
    pub cached_tokens: u32,
    /// Of `prompt_tokens`, the video tokens (not in `image_tokens`).
    pub video_tokens: u32,
}

/// The log-probability of one generated token and the most likely alternatives at its
/// position (most likely first), under the model's raw distribution.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TokenLogprob {
    pub token_id: u32,
    pub logprob: f32,
    /// (token id, logprob), most likely first.
    pub top: Vec<(u32, f32)>,
}

impl From<TokenLogprob> for pb::TokenLogprob {
    fn from(l: TokenLogprob) -> Self {
        pb::TokenLogprob {
            token_id: l.token_id,
            logprob: l.logprob,
            top_logprobs: l
                .top
                .into_iter()
                .map(|(token_id, logprob)| pb::TopLogprob {
                    token_id,
                    logprob,
                    token: String::new(),
                })
                .collect(),
            token: String::new(),
        }
    }
}

impl From<pb::TokenLogprob> for TokenLogprob {
    fn from(l: pb::TokenLogprob) -> Self {
        TokenLogprob {
            token_id: l.token_id,
            logprob: l.logprob,
            top: l
                .top_logprobs
                .into_iter()
                .map(|t| (t.token_id, t.logprob))
                .collect(),
        }
    }
}

impl From<Finish> for pb::FinishReason {
    fn from(f: Finish) -> Self {
        match f {
            Finish::Stop => pb::FinishReason::Stop,
            Finish::Length => pb::FinishReason::Length,
            Finish::Cancelled => pb::FinishReason::Cancelled,
        }
    }
}

/// `FINISH_REASON_UNSPECIFIED`: the generation has not ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("finish reason unspecified: the generation has not ended")]
pub struct NotFinished;

impl TryFrom<pb::FinishReason> for Finish {
    type Error = NotFinished;
    fn try_from(r: pb::FinishReason) -> Result<Self, NotFinished> {
        match r {
            pb::FinishReason::Unspecified => Err(NotFinished),
            pb::FinishReason::Stop => Ok(Finish::Stop),
            pb::FinishReason::Length => Ok(Finish::Length),
            pb::FinishReason::Cancelled => Ok(Finish::Cancelled),
        }
    }
}

impl Finish {
    /// The wire field `finish_reason` of a message: UNSPECIFIED until the last one.
    pub fn to_wire(finish: Option<Finish>) -> i32 {
        finish.map_or(pb::FinishReason::Unspecified, pb::FinishReason::from) as i32
    }

    /// The wire field read back: None for UNSPECIFIED and for values this build does not
    /// know.
    pub fn from_wire(finish_reason: i32) -> Option<Finish> {
        pb::FinishReason::try_from(finish_reason)
            .ok()
            .and_then(|r| Finish::try_from(r).ok())
    }
}

impl From<Usage> for pb::Usage {
    fn from(u: Usage) -> Self {
        pb::Usage {
            prompt_tokens: u.prompt_tokens,
            image_tokens: u.image_tokens,
            completion_tokens: u.completion_tokens,
            cached_tokens: u.cached_tokens,
            video_tokens: u.video_tokens,
        }
    }
}

impl From<pb::Usage> for Usage {
    fn from(u: pb::Usage) -> Self {
        Usage {
            prompt_tokens: u.prompt_tokens,
            image_tokens: u.image_tokens,
            completion_tokens: u.completion_tokens,
            cached_tokens: u.cached_tokens,
            video_tokens: u.video_tokens,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finish_reasons_round_trip_on_the_wire() {
        assert_eq!(Finish::to_wire(None), pb::FinishReason::Unspecified as i32);
        assert_eq!(
            Finish::from_wire(pb::FinishReason::Unspecified as i32),
            None
        );
        for (f, wire) in [
            (Finish::Stop, pb::FinishReason::Stop),
            (Finish::Length, pb::FinishReason::Length),
            (Finish::Cancelled, pb::FinishReason::Cancelled),
        ] {
            assert_eq!(pb::FinishReason::from(f), wire);
            assert_eq!(Finish::try_from(wire), Ok(f));
            assert_eq!(Finish::to_wire(Some(f)), wire as i32);
            assert_eq!(Finish::from_wire(wire as i32), Some(f));
        }
        // A value from a newer peer reads as "not finished", as before.
        assert_eq!(Finish::from_wire(99), None);
    }

    #[test]
    fn logprobs_round_trip() {
        let l = TokenLogprob {
            token_id: 4,
            logprob: -0.5,
            top: vec![(4, -0.5), (9, -1.25)],
        };
        let wire = pb::TokenLogprob::from(l.clone());
        assert_eq!(wire.top_logprobs[1].token_id, 9);
        assert_eq!(TokenLogprob::from(wire), l);
    }

    #[test]
    fn usage_round_trips() {
        let u = Usage {
            prompt_tokens: 7,
            image_tokens: 3,
            completion_tokens: 11,
            cached_tokens: 5,
            video_tokens: 0,
        };
        let wire = pb::Usage::from(u);
        assert_eq!(
            (
                wire.prompt_tokens,
                wire.image_tokens,
                wire.completion_tokens,
                wire.cached_tokens
            ),
            (7, 3, 11, 5)
        );
        assert_eq!(Usage::from(wire), u);
    }
}
