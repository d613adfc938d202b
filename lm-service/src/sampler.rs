//! Choosing the next token from a row of logits, in vLLM's order (v1 `Sampler.forward`):
//! 1. raw log-probabilities, when asked for (vLLM's default `logprobs_mode = raw_logprobs`:
//!    before any of the steps below);
//! 2. `min_tokens` (stop ids masked until then), `logit_bias`, and the structured-output mask
//!    (`structured`: what the grammar does not allow next is -inf);
//! 3. penalties (`apply_all_penalties`): repetition over prompt + output, then frequency and
//!    presence over the output;
//! 4. greedy (temperature 0: argmax of the processed row), else temperature, `min_p`, `top_k`,
//!    `top_p`, and a draw from a per-request seeded generator (same seed, same input: same
//!    output).
//!
//! Stop conditions on token ids (EOS, `stop_token_ids`, `max_tokens`) are decided in the
//! engine; stop *strings* are the gateway's, since it owns detokenization.
use crate::structured::Guide;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::{HashMap, HashSet};
use vlm_service_kit::generation::TokenLogprob;

/// Validated sampling settings.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingConfig {
    /// 0 = greedy.
    pub temperature: f32,
    /// 0 = off.
    pub top_k: usize,
    /// 1 (or 0 on the wire) = off.
    pub top_p: f32,
    /// 0 = off.
    pub min_p: f32,
    pub seed: u64,
    pub penalties: Penalties,
    /// (token id, bias) added to the logits.
    pub logit_bias: Vec<(u32, f32)>,
    /// Stop ids cannot be sampled before this many tokens.
    pub min_tokens: usize,
    /// `Some(k)`: each token's logprob and the k most likely alternatives.
    pub logprobs: Option<usize>,
}

/// vLLM's penalties; the defaults are off.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Penalties {
    pub presence: f32,
    pub frequency: f32,
    /// 1 = off.
    pub repetition: f32,
}

impl Default for Penalties {
    fn default() -> Self {
        Penalties {
            presence: 0.0,
            frequency: 0.0,
            repetition: 1.0,
        }
    }
}

impl Penalties {
    fn any(&self) -> bool {
        self.presence != 0.0 || self.frequency != 0.0 || self.repetition != 1.0
    }
}

impl SamplingConfig {
    pub fn greedy() -> Self {
        SamplingConfig {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
            penalties: Penalties::default(),
            logit_bias: Vec::new(),
            min_tokens: 0,
            logprobs: None,
        }
    }
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0 || self.top_k == 1
    }
}

/// One sampled token, with its log-probability when asked for.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub token: u32,
    pub logprob: Option<TokenLogprob>,
    /// The request's grammar is complete: the output must end here.
    pub grammar_done: bool,
}

/// One request's sampler: its settings, its random generator, and the token history the
/// penalties read.
#[derive(Debug, Clone)]
pub struct Sampler {
    cfg: SamplingConfig,
    rng: StdRng,
    /// Distinct prompt tokens (kept only for the repetition penalty).
    prompt: HashSet<u32>,
    /// How often each token is in the output (kept only for penalties).
    counts: HashMap<u32, u32>,
    generated: usize,
    /// The processed row, reused across steps.
    scratch: Vec<f32>,
    /// The structured-output constraint, if any.
    guide: Option<Guide>,
}

impl Sampler {
    pub fn new(cfg: SamplingConfig, prompt: &[u32]) -> Self {
        let rng = StdRng::seed_from_u64(cfg.seed);
        let prompt = if cfg.penalties.repetition != 1.0 {
            prompt.iter().copied().collect()
        } else {
            HashSet::new()
        };
        Sampler {
            cfg,
            rng,
            prompt,
            counts: HashMap::new(),
            generated: 0,
            scratch: Vec::new(),
            guide: None,
        }
    }

    /// The grammar state, when the request has one (to prepare its mask ahead).
    pub fn guide_mut(&mut self) -> Option<&mut Guide> {
        self.guide.as_mut()
    }

    /// Constrains every token to what `guide`'s grammar allows.
    pub fn with_guide(mut self, guide: Option<Guide>) -> Self {
        self.guide = guide;
        self
    }

    pub fn config(&self) -> &SamplingConfig {
        &self.cfg
    }

    /// The next token from `logits` (one row, vocab entries). `stop_ids` are masked while
    /// fewer than `min_tokens` tokens have been generated. Fails only when the grammar engine
    /// does.
    pub fn sample(&mut self, logits: &[f32], stop_ids: &[u32]) -> Result<Sampled, String> {
        let raw = self.cfg.logprobs.map(|k| RawLogprobs::of(logits, k));
        let token = if self.needs_processing() {
            let mut row = std::mem::take(&mut self.scratch);
            self.process(logits, stop_ids, &mut row);
            let masked = match &mut self.guide {
                Some(g) => g.mask(&mut row),
                None => Ok(()),
            };
            let t = masked.map(|()| self.choose(&row));
            self.scratch = row;
            t?
        } else {
            self.choose(logits)
        };
        let mut grammar_done = false;
        if let Some(g) = &mut self.guide {
            g.advance(token)?;
            grammar_done = g.is_done();
        }
        self.generated += 1;
        if self.cfg.penalties.any() {
            *self.counts.entry(token).or_insert(0) += 1;
        }
        Ok(Sampled {
            token,
            logprob: raw.map(|r| r.token(logits, token)),
            grammar_done,
        })
    }

    fn needs_processing(&self) -> bool {
        self.generated < self.cfg.min_tokens
            || self.guide.is_some()
            || !self.cfg.logit_bias.is_empty()
            || self.cfg.penalties.any()
    }

    /// Steps 2 and 3 of the module's order, into `row`.
    fn process(&self, logits: &[f32], stop_ids: &[u32], row: &mut Vec<f32>) {
        row.clear();
        row.extend_from_slice(logits);
        let n = row.len();
        if self.generated < self.cfg.min_tokens {
            for &id in stop_ids {
                if let Some(x) = row.get_mut(id as usize) {
                    *x = f32::NEG_INFINITY;
                }
            }
        }
        for &(id, b) in &self.cfg.logit_bias {
            if let Some(x) = row.get_mut(id as usize) {
                *x += b;
            }
        }
        let p = self.cfg.penalties;
        if p.repetition != 1.0 {
            // vLLM `apply_penalties`: a positive logit is divided, a negative one multiplied.
            let seen = self
                .prompt
                .iter()
                .chain(self.counts.keys().filter(|t| !self.prompt.contains(t)));
            for &id in seen {
                if (id as usize) < n {
                    let x = &mut row[id as usize];
                    *x = if *x > 0.0 {
                        *x / p.repetition
                    } else {
                        *x * p.repetition
                    };
                }
            }
        }
        if p.frequency != 0.0 || p.presence != 0.0 {
            for (&id, &c) in &self.counts {
                if (id as usize) < n {
                    row[id as usize] -= p.frequency * c as f32 + p.presence;
                }
            }
        }
    }

    /// Step 4: greedy, or a draw from the truncated, tempered distribution.
    fn choose(&mut self, logits: &[f32]) -> u32 {
        if self.cfg.is_greedy() || logits.is_empty() {
            return argmax(logits);
        }
        let t = self.cfg.temperature;
        // Candidates sorted by logit, descending (ties: lower id first, as argmax), and the
        // largest finite logit.
        let small_k = (1..=SMALL_TOP_K).contains(&self.cfg.top_k);
        let (max, mut idx) = if small_k && self.cfg.min_p <= 0.0 {
            // The first candidate is the largest finite logit: no pass of its own.
            let idx = top_k_desc(logits, self.cfg.top_k, f32::NEG_INFINITY);
            let Some(&first) = idx.first() else {
                return argmax(logits);
            };
            (logits[first], idx)
        } else {
            let max = logits
                .iter()
                .copied()
                .filter(|x| x.is_finite())
                .fold(f32::NEG_INFINITY, f32::max);
            if max == f32::NEG_INFINITY {
                return argmax(logits);
            }
            // min_p: p_i >= min_p * p_max  <=>  logit_i >= max + t * ln(min_p). Filtering on
            // the logit first keeps the sort below short.
            let floor = if self.cfg.min_p > 0.0 {
                max + t * self.cfg.min_p.ln()
            } else {
                f32::NEG_INFINITY
            };
            let untruncated = (self.cfg.top_k == 0 || self.cfg.top_k >= logits.len())
                && !(self.cfg.top_p > 0.0 && self.cfg.top_p < 1.0);
            let idx = if small_k {
                top_k_desc(logits, self.cfg.top_k, floor)
            } else {
                let mut idx: Vec<usize> = (0..logits.len())
                    .filter(|&i| logits[i].is_finite() && logits[i] >= floor)
                    .collect();
                // Neither top_k nor top_p needs an order: the draw walks the candidates by id
                // instead of sorting the whole vocabulary, a row at a time on the engine thread.
                if !untruncated {
                    let order =
                        |&a: &usize, &b: &usize| logits[b].total_cmp(&logits[a]).then(a.cmp(&b));
                    if self.cfg.top_k > 0 && self.cfg.top_k < idx.len() {
                        idx.select_nth_unstable_by(self.cfg.top_k - 1, order);
                        idx.truncate(self.cfg.top_k);
                    }
                    idx.sort_by(order);
                }
                idx
            };
            (max, idx)
        };
        let mut probs: Vec<f64> = idx
            .iter()
            .map(|&i| (((logits[i] - max) / t) as f64).exp())
            .collect();
        let sum: f64 = probs.iter().sum();
        for p in &mut probs {
            *p /= sum;
        }
        let top_p = self.cfg.top_p;
        if top_p > 0.0 && top_p < 1.0 {
            let mut acc = 0.0;
            let mut keep = probs.len();
            for (k, p) in probs.iter().enumerate() {
                acc += p;
                if acc >= top_p as f64 {
                    keep = k + 1;
                    break;
                }
            }
            probs.truncate(keep);
            idx.truncate(keep);
            let s: f64 = probs.iter().sum();
            for p in &mut probs {
                *p /= s;
            }
        }
        let r: f64 = self.rng.gen();
        let mut acc = 0.0;
        for (k, p) in probs.iter().enumerate() {
            acc += p;
            if r < acc {
                return idx[k] as u32;
            }
        }
        idx[idx.len() - 1] as u32
    }
}

/// Up to this `top_k` the candidates come from one pass over the row ([`top_k_desc`]).
const SMALL_TOP_K: usize = 64;

/// `x > bar`, false for a NaN.
#[inline]
fn above(x: f32, bar: f32) -> bool {
    x.partial_cmp(&bar) == Some(std::cmp::Ordering::Greater)
}

/// Logits [`top_k_desc`] checks against its bar at once.
const BLOCK: usize = 64;

/// The ids of the `k` largest finite logits `>= floor`, sorted by logit descending, ties lower
/// id first: the same list as sorting every candidate and keeping `k` (the general path of
/// [`Sampler::choose`]), in one pass over the row, blocks whose max is under the current k-th
/// largest skipped at once. On a 151,936-entry row (the 2B's vocabulary; Zen 5, test build)
/// top_k 20 takes 46 us a row, where building and partially sorting every candidate took
/// 1.27-1.56 ms: on the engine thread, for each of 32 streams, every decode step.
fn top_k_desc(logits: &[f32], k: usize, floor: f32) -> Vec<usize> {
    // (logit, id), descending; a later id with an equal logit ranks after, as in the sort.
    let mut top: Vec<(f32, usize)> = Vec::with_capacity(k + 1);
    // The k-th largest so far once there are k (NaN fails `x > bar` too).
    let mut bar = f32::NEG_INFINITY;
    for (c, block) in logits.chunks(BLOCK).enumerate() {
        if top.len() == k {
            // Most blocks hold nothing above the bar: one vectorised max says so (a NaN is
            // passed over, as below).
            let m = block
                .iter()
                .fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m });
            if !above(m, bar) {
                continue;
            }
        }
        for (j, &x) in block.iter().enumerate() {
            if top.len() == k && !above(x, bar) {
                continue;
            }
            if !x.is_finite() || x < floor {
                continue;
            }
            let at = top.partition_point(|&(y, _)| y >= x);
            top.insert(at, (x, c * BLOCK + j));
            top.truncate(k);
            if top.len() == k {
                bar = top[k - 1].0;
            }
        }
    }
    top.into_iter().map(|(_, i)| i).collect()
}

/// log-softmax of a raw row: its log-normalizer and its `k` most likely entries.
struct RawLogprobs {
    log_z: f64,
    top: Vec<(u32, f32)>,
}

impl RawLogprobs {
    fn of(logits: &[f32], k: usize) -> Self {
        let max = logits
            .iter()
            .copied()
            .filter(|x| x.is_finite())
            .fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = logits
            .iter()
            .filter(|x| x.is_finite())
            .map(|&x| ((x - max) as f64).exp())
            .sum();
        let log_z = max as f64 + sum.ln();
        // The k largest, most likely first; a later id only displaces on a strictly larger
        // logit, so ties keep the lower id first.
        let mut best: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
        if k > 0 {
            for (i, &x) in logits.iter().enumerate() {
                if !x.is_finite() || (best.len() == k && x <= best[k - 1].1) {
                    continue;
                }
                let at = best.partition_point(|&(_, y)| y >= x);
                best.insert(at, (i as u32, x));
                best.truncate(k);
            }
        }
        let top = best
            .into_iter()
            .map(|(i, x)| (i, (x as f64 - log_z) as f32))
            .collect();
        RawLogprobs { log_z, top }
    }

    fn token(self, logits: &[f32], token: u32) -> TokenLogprob {
        let x = logits.get(token as usize).copied().unwrap_or(f32::NAN);
        TokenLogprob {
            token_id: token,
            logprob: (x as f64 - self.log_z) as f32,
            top: self.top,
        }
    }
}

/// Index of the largest value, the first on ties (as `torch.argmax` and the in-process oracle).
pub fn argmax(row: &[f32]) -> u32 {
    vlm_compute::argmax(row)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> SamplingConfig {
        SamplingConfig {
            temperature,
            top_k,
            top_p,
            seed,
            ..SamplingConfig::greedy()
        }
    }

    fn token(s: &mut Sampler, logits: &[f32]) -> u32 {
        s.sample(logits, &[]).unwrap().token
    }

    #[test]
    fn greedy_is_argmax_first_on_ties() {
        let mut s = Sampler::new(SamplingConfig::greedy(), &[]);
        assert_eq!(token(&mut s, &[0.1, 3.0, 3.0, -1.0]), 1);
        // top_k = 1 is greedy whatever the temperature.
        let mut s = Sampler::new(cfg(2.0, 1, 1.0, 7), &[]);
        assert_eq!(token(&mut s, &[0.1, 3.0, 2.9, -1.0]), 1);
    }

    #[test]
    fn same_seed_same_tokens() {
        let logits: Vec<f32> = (0..50).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let run = |seed| {
            let mut s = Sampler::new(cfg(1.0, 0, 1.0, seed), &[]);
            (0..40).map(|_| token(&mut s, &logits)).collect::<Vec<_>>()
        };
        assert_eq!(run(42), run(42));
        assert_ne!(run(42), run(43));
    }

    #[test]
    fn top_k_and_top_p_restrict_the_candidates() {
        let logits = [5.0, 4.0, 0.0, -1.0, 4.5];
        let mut s = Sampler::new(cfg(1.0, 2, 1.0, 1), &[]);
        for _ in 0..200 {
            let t = token(&mut s, &logits);
            assert!(t == 0 || t == 4, "top-2 are ids 0 and 4, got {t}");
        }
        // p(0) ~ 0.5, p(4) ~ 0.3: top_p 0.6 keeps exactly those two.
        let mut s = Sampler::new(cfg(1.0, 0, 0.6, 1), &[]);
        let mut seen = [false; 5];
        for _ in 0..500 {
            seen[token(&mut s, &logits) as usize] = true;
        }
        assert_eq!(seen, [true, false, false, false, true]);
        // A tiny top_p is greedy.
        let mut s = Sampler::new(cfg(1.0, 0, 0.01, 1), &[]);
        assert!((0..50).all(|_| token(&mut s, &logits) == 0));
    }

    /// The one-pass candidate list is the sort's, ties, NaN, infinities and floors included.
    #[test]
    fn one_pass_top_k_equals_sorting_every_candidate() {
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) as u32
        };
        for case in 0..400 {
            let n = 1 + next() as usize % 300;
            let logits: Vec<f32> = (0..n)
                .map(|_| match next() % 40 {
                    0 => f32::NAN,
                    1 => f32::NEG_INFINITY,
                    2 => f32::INFINITY,
                    // Few distinct values: many ties.
                    v => (v % 7) as f32 - 3.0,
                })
                .collect();
            let k = 1 + next() as usize % 70;
            let floor = if case % 3 == 0 {
                f32::NEG_INFINITY
            } else {
                (next() % 5) as f32 - 3.0
            };
            let mut want: Vec<usize> = (0..n)
                .filter(|&i| logits[i].is_finite() && logits[i] >= floor)
                .collect();
            want.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
            want.truncate(k);
            assert_eq!(
                top_k_desc(&logits, k, floor),
                want,
                "{logits:?} k {k} floor {floor}"
            );
        }
    }

    #[test]
    fn min_p_drops_tokens_below_its_share_of_the_top() {
        // p ~ [0.50, 0.18, 0.01, 0.003, 0.30]: min_p 0.5 keeps ids 0 (1.0x) and 4 (0.61x).
        let logits = [5.0, 4.0, 0.0, -1.0, 4.5];
        let mut s = Sampler::new(
            SamplingConfig {
                min_p: 0.5,
                ..cfg(1.0, 0, 1.0, 5)
            },
            &[],
        );
        let mut seen = [false; 5];
        for _ in 0..500 {
            seen[token(&mut s, &logits) as usize] = true;
        }
        assert_eq!(seen, [true, false, false, false, true]);
    }

    #[test]
    fn low_temperature_concentrates_on_the_max() {
        let logits = [1.0, 1.2, 0.9];
        let mut s = Sampler::new(cfg(0.01, 0, 1.0, 3), &[]);
        assert!((0..100).all(|_| token(&mut s, &logits) == 1));
    }

    #[test]
    fn logit_bias_moves_the_greedy_choice() {
        let logits = [1.0, 3.0, 2.0];
        let mut s = Sampler::new(
            SamplingConfig {
                logit_bias: vec![(2, 5.0), (1, -100.0)],
                ..SamplingConfig::greedy()
            },
            &[],
        );
        assert_eq!(token(&mut s, &logits), 2);
        // Out-of-row ids are ignored here (the service refused them before).
        let mut s = Sampler::new(
            SamplingConfig {
                logit_bias: vec![(9, 5.0)],
                ..SamplingConfig::greedy()
            },
            &[],
        );
        assert_eq!(token(&mut s, &logits), 1);
    }

    #[test]
    fn min_tokens_masks_the_stop_ids_until_reached() {
        let logits = [1.0, 3.0, 2.0];
        let mut s = Sampler::new(
            SamplingConfig {
                min_tokens: 2,
                ..SamplingConfig::greedy()
            },
            &[],
        );
        let run: Vec<u32> = (0..3)
            .map(|_| s.sample(&logits, &[1]).unwrap().token)
            .collect();
        assert_eq!(run, [2, 2, 1]);
    }

    fn penalized(p: Penalties, prompt: &[u32]) -> Sampler {
        Sampler::new(
            SamplingConfig {
                penalties: p,
                ..SamplingConfig::greedy()
            },
            prompt,
        )
    }

    #[test]
    fn presence_and_frequency_penalties_act_on_the_output_only() {
        let logits = [3.0, 2.5, 0.0];
        // Presence 1: id 0 is used once, then 0 - 1 = 2 < 2.5 -> id 1, then both penalized.
        let mut s = penalized(
            Penalties {
                presence: 1.0,
                ..Penalties::default()
            },
            &[0, 0, 0],
        );
        let run: Vec<u32> = (0..4).map(|_| token(&mut s, &logits)).collect();
        assert_eq!(run, [0, 1, 0, 0]);
        // Frequency 0.4: the penalty grows with each use: 3.0, 2.6, 2.2 for id 0.
        let mut s = penalized(
            Penalties {
                frequency: 0.4,
                ..Penalties::default()
            },
            &[],
        );
        let run: Vec<u32> = (0..4).map(|_| token(&mut s, &logits)).collect();
        assert_eq!(run, [0, 0, 1, 0]);
        // A negative penalty encourages repeats.
        let mut s = penalized(
            Penalties {
                presence: -2.0,
                ..Penalties::default()
            },
            &[],
        );
        assert!((0..5).all(|_| token(&mut s, &[2.0, 3.0, 2.9]) == 1));
    }

    #[test]
    fn repetition_penalty_covers_prompt_and_output_with_the_sign_rule() {
        // id 0 is in the prompt: 3.0 / 2 = 1.5 < 2.5.
        let mut s = penalized(
            Penalties {
                repetition: 2.0,
                ..Penalties::default()
            },
            &[0],
        );
        assert_eq!(token(&mut s, &[3.0, 2.5, 0.0]), 1);
        // Then id 1 is in the output too: 2.5 / 2 = 1.25 < 1.5.
        assert_eq!(token(&mut s, &[3.0, 2.5, -0.5]), 0);
        let mut s = penalized(
            Penalties {
                repetition: 2.0,
                ..Penalties::default()
            },
            &[2],
        );
        // -0.5 * 2 = -1.0 < -0.8: the unseen id 1 wins.
        assert_eq!(token(&mut s, &[-2.0, -0.8, -0.5]), 1);
    }

    #[test]
    fn raw_logprobs_are_sorted_normalised_and_include_the_sample() {
        let logits = [1.0f32, 3.0, 2.0, 3.0, -5.0];
        let mut s = Sampler::new(
            SamplingConfig {
                logprobs: Some(3),
                logit_bias: vec![(4, 100.0)],
                ..SamplingConfig::greedy()
            },
            &[],
        );
        let out = s.sample(&logits, &[]).unwrap();
        // The bias chose id 4; its logprob is the raw one.
        assert_eq!(out.token, 4);
        let lp = out.logprob.unwrap();
        let z: f64 = logits.iter().map(|&x| (x as f64).exp()).sum();
        let want = |i: usize| (logits[i] as f64 - z.ln()) as f32;
        assert!((lp.logprob - want(4)).abs() < 1e-6);
        // Top 3, most likely first; ties keep the lower id first.
        let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, [1, 3, 2]);
        for &(i, l) in &lp.top {
            assert!((l - want(i as usize)).abs() < 1e-6);
        }
        let mass: f32 = lp.top.iter().map(|t| t.1.exp()).sum();
        assert!(mass <= 1.0 && mass > 0.8, "{mass}");
        // No alternatives asked for: only the token's own.
        let mut s = Sampler::new(
            SamplingConfig {
                logprobs: Some(0),
                ..SamplingConfig::greedy()
            },
            &[],
        );
        let lp = s.sample(&logits, &[]).unwrap().logprob.unwrap();
        assert_eq!((lp.token_id, lp.top.len()), (1, 0));
    }
}
