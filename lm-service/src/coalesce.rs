//! One gRPC message per burst of tokens, not per token: when the consumer (the gateway, the
//! network) is slower than the decode loop, the events already waiting are merged into one, so a
//! fast model is not held to one message round trip per token. A finish or an error ends a
//! merge; nothing is reordered, dropped or delayed (a lone event goes out as it is).
use crate::engine::GenEvent;
use crate::error::LmError;
use futures::Stream;
use tokio::sync::mpsc::UnboundedReceiver;

/// The events of `rx`, each merged with the `Ok` events already queued behind it.
pub fn coalesced(
    rx: UnboundedReceiver<Result<GenEvent, LmError>>,
) -> impl Stream<Item = Result<GenEvent, LmError>> {
    futures::stream::unfold((rx, None), |(mut rx, pending)| async move {
        let first = match pending {
            Some(p) => p,
            None => rx.recv().await?,
        };
        let Ok(mut ev) = first else {
            return Some((first, (rx, None)));
        };
        let mut pending = None;
        while ev.finish.is_none() {
            match rx.try_recv() {
                // Another choice's event is not merged into this one's.
                Ok(Ok(next)) if next.index != ev.index => {
                    pending = Some(Ok(next));
                    break;
                }
                Ok(Ok(next)) => {
                    ev.tokens.extend(next.tokens);
                    ev.logprobs.extend(next.logprobs);
                    ev.finish = next.finish;
                    ev.usage = next.usage; // cumulative
                }
                Ok(Err(e)) => {
                    pending = Some(Err(e));
                    break;
                }
                Err(_) => break,
            }
        }
        Some((Ok(ev), (rx, pending)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;
    use vlm_service_kit::generation::{Finish, TokenLogprob, Usage};

    fn ev(t: u32, finish: Option<Finish>) -> Result<GenEvent, LmError> {
        Ok(GenEvent {
            index: 0,
            tokens: vec![t],
            logprobs: vec![TokenLogprob {
                token_id: t,
                logprob: -(t as f32),
                top: Vec::new(),
            }],
            finish,
            usage: Usage {
                prompt_tokens: 3,
                image_tokens: 0,
                completion_tokens: t,
                cached_tokens: 0,
                video_tokens: 0,
            },
        })
    }

    #[tokio::test]
    async fn queued_events_merge_in_order_up_to_a_finish_or_an_error() {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        for t in 1..=3 {
            tx.send(ev(t, None)).unwrap();
        }
        tx.send(Err(LmError::Unavailable("gone".into()))).unwrap();
        tx.send(ev(4, None)).unwrap();
        tx.send(ev(5, Some(Finish::Length))).unwrap();
        tx.send(ev(6, None)).unwrap();
        drop(tx);
        let out: Vec<_> = coalesced(rx).collect().await;
        assert_eq!(out.len(), 4, "{out:?}");
        let first = out[0].as_ref().unwrap();
        assert_eq!(first.tokens, vec![1, 2, 3]);
        // Logprobs stay one per token, in order.
        let ids: Vec<u32> = first.logprobs.iter().map(|l| l.token_id).collect();
        assert_eq!(ids, first.tokens);
        assert_eq!(first.usage.completion_tokens, 3);
        assert!(out[1].is_err());
        let second = out[2].as_ref().unwrap();
        assert_eq!(
            (second.tokens.clone(), second.finish),
            (vec![4, 5], Some(Finish::Length))
        );
        assert_eq!(out[3].as_ref().unwrap().tokens, vec![6]);
    }

    #[tokio::test]
    async fn choices_are_never_merged_into_each_other() {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        for (t, index) in [(1, 0), (2, 0), (3, 1), (4, 1), (5, 0)] {
            let mut e = ev(t, None).unwrap();
            e.index = index;
            tx.send(Ok(e)).unwrap();
        }
        drop(tx);
        let out: Vec<(u32, Vec<u32>)> = coalesced(rx)
            .map(|e| e.map(|e| (e.index, e.tokens)).unwrap())
            .collect()
            .await;
        assert_eq!(out, [(0, vec![1, 2]), (1, vec![3, 4]), (0, vec![5])]);
    }

    #[tokio::test]
    async fn a_lone_event_is_not_held_back() {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let mut s = Box::pin(coalesced(rx));
        tx.send(ev(1, None)).unwrap();
        let got = tokio::time::timeout(std::time::Duration::from_secs(5), s.next())
            .await
            .expect("delivered without waiting for more")
            .unwrap()
            .unwrap();
        assert_eq!(got.tokens, vec![1]);
    }
}
