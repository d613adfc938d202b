//! Choosing the next token from a row of logits: greedy (temperature 0), or temperature with
//! optional top-k and top-p, drawn from a per-request seeded generator (same seed, same input:
//! same output). Stop conditions on token ids (EOS, `stop_token_ids`, `max_tokens`) are decided
//! in the engine; stop *strings* are the gateway's, since it owns detokenization.
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Validated sampling settings.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingConfig {
    /// 0 = greedy.
    pub temperature: f32,
    /// 0 = off.
    pub top_k: usize,
    /// 1 (or 0 on the wire) = off.
    pub top_p: f32,
    pub seed: u64,
}

impl SamplingConfig {
    pub fn greedy() -> Self {
        SamplingConfig {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0 || self.top_k == 1
    }
}

/// One request's sampler: its settings and its random generator.
#[derive(Debug, Clone)]
pub struct Sampler {
    cfg: SamplingConfig,
    rng: StdRng,
}

impl Sampler {
    pub fn new(cfg: SamplingConfig) -> Self {
        let rng = StdRng::seed_from_u64(cfg.seed);
        Sampler { cfg, rng }
    }

    pub fn config(&self) -> &SamplingConfig {
        &self.cfg
    }

    /// The next token from `logits` (one row, vocab entries).
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.cfg.is_greedy() || logits.is_empty() {
            return argmax(logits);
        }
        // Candidates sorted by logit, descending (ties: lower id first, as argmax).
        let mut idx: Vec<usize> = (0..logits.len())
            .filter(|&i| logits[i].is_finite())
            .collect();
        if idx.is_empty() {
            return argmax(logits);
        }
        idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        if self.cfg.top_k > 0 && self.cfg.top_k < idx.len() {
            idx.truncate(self.cfg.top_k);
        }
        let t = self.cfg.temperature;
        let max = logits[idx[0]];
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
        }
    }

    #[test]
    fn greedy_is_argmax_first_on_ties() {
        let mut s = Sampler::new(SamplingConfig::greedy());
        assert_eq!(s.sample(&[0.1, 3.0, 3.0, -1.0]), 1);
        // top_k = 1 is greedy whatever the temperature.
        let mut s = Sampler::new(cfg(2.0, 1, 1.0, 7));
        assert_eq!(s.sample(&[0.1, 3.0, 2.9, -1.0]), 1);
    }

    #[test]
    fn same_seed_same_tokens() {
        let logits: Vec<f32> = (0..50).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let run = |seed| {
            let mut s = Sampler::new(cfg(1.0, 0, 1.0, seed));
            (0..40).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(run(42), run(42));
        assert_ne!(run(42), run(43));
    }

    #[test]
    fn top_k_and_top_p_restrict_the_candidates() {
        let logits = [5.0, 4.0, 0.0, -1.0, 4.5];
        let mut s = Sampler::new(cfg(1.0, 2, 1.0, 1));
        for _ in 0..200 {
            let t = s.sample(&logits);
            assert!(t == 0 || t == 4, "top-2 are ids 0 and 4, got {t}");
        }
        // p(0) ~ 0.5, p(4) ~ 0.3: top_p 0.6 keeps exactly those two.
        let mut s = Sampler::new(cfg(1.0, 0, 0.6, 1));
        let mut seen = [false; 5];
        for _ in 0..500 {
            seen[s.sample(&logits) as usize] = true;
        }
        assert_eq!(seen, [true, false, false, false, true]);
        // A tiny top_p is greedy.
        let mut s = Sampler::new(cfg(1.0, 0, 0.01, 1));
        assert!((0..50).all(|_| s.sample(&logits) == 0));
    }

    #[test]
    fn low_temperature_concentrates_on_the_max() {
        let logits = [1.0, 1.2, 0.9];
        let mut s = Sampler::new(cfg(0.01, 0, 1.0, 3));
        assert!((0..100).all(|_| s.sample(&logits) == 1));
    }
}
