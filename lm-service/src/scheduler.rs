//! Continuous batching, as pure bookkeeping: data in, a [`StepPlan`] out. No tensors, no
//! clock of its own (the caller passes `now`), no channels, so it is tested from small integers.
//!
//! Every sequence has `num_tokens` known tokens (prompt + generated) of which `num_computed`
//! are in the KV cache. A sequence is *prefilling* while `num_computed` is below its prefill
//! target (the prompt; after a preemption, the prompt plus all generated tokens but the last),
//! and *decoding* once only its last token is missing from the cache.
//!
//! Each step:
//! 1. sequences whose deadline passed leave (their blocks go back to the pool);
//! 2. every decoding sequence, oldest first, gets room for one more token; when the pool is out
//!    of blocks the NEWEST running sequence is preempted (blocks freed, back to the front of the
//!    queue, recomputed later) until the allocation fits;
//! 3. when nothing was preempted, waiting sequences are admitted in order while the batch has a
//!    slot and their prefill fits the free blocks (head of line blocks the rest: no starvation);
//! 4. prefilling sequences, oldest first, get chunks out of a budget of `prefill_chunk_size`
//!    tokens per step (vLLM v1's token budget, decode rows not counted; a smaller one while
//!    sequences decode when `prefill_while_decoding` says so): a long prompt takes the whole
//!    budget, short ones are packed into one step. The chunks run in the same step as the
//!    decode batch, so running streams never stall behind a long prompt;
//! 5. the decode batch runs the smallest decode graph that holds it
//!    ([`vlm_config::DeployConfig::decoder_graph_for`]).
//!
//! Prefix caching (`prefix_caching: true`): the caller gives each sequence the content keys of
//! its full blocks of known tokens ([`Scheduler::extend_keys`]); at admission its table starts
//! with the cached blocks of its longest cached prefix and its computed tokens with them (at
//! least one token is always computed, so the chunk that ends the prompt has logits); every
//! full block it computes is registered for the sequences after it.
use crate::kv::{BlockKey, KvManager, SeqId};
use std::collections::{HashMap, VecDeque};
use std::time::Instant;
use vlm_config::DeployConfig;

/// What the scheduler needs to know about the deployment.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// batch_size, decoder_batch_sizes, prefill_chunk_size are read from here.
    pub deploy: DeployConfig,
    pub num_blocks: u32,
    /// Tokens per block (`kvcache_partition_len`).
    pub block_len: u32,
    /// Reuse cached blocks of a known prefix (`prefix_caching`).
    pub prefix_caching: bool,
    /// The step's prefill token budget while sequences decode (`--prefill-tokens-while-
    /// decoding`): smaller steps, so running streams get their tokens sooner during a long
    /// prefill. At most `prefill_chunk_size`, which is the budget otherwise.
    pub prefill_while_decoding: u32,
}

impl SchedulerConfig {
    pub fn new(deploy: &DeployConfig, num_blocks: u32) -> Self {
        SchedulerConfig {
            deploy: deploy.clone(),
            num_blocks,
            block_len: deploy.kvcache_partition_len,
            prefix_caching: deploy.prefix_caching,
            prefill_while_decoding: deploy.prefill_chunk_size,
        }
    }

    /// With a prefill budget of `tokens` while sequences decode (0, or more than
    /// `prefill_chunk_size`: `prefill_chunk_size`).
    pub fn with_prefill_while_decoding(mut self, tokens: u32) -> Self {
        let chunk = self.deploy.prefill_chunk_size;
        self.prefill_while_decoding = match tokens {
            0 => chunk,
            t => t.min(chunk),
        };
        self
    }

    /// The prefill token budget of a step with or without decode rows.
    pub fn prefill_budget(&self, decoding: bool) -> usize {
        let chunk = self.deploy.prefill_chunk_size;
        let budget = if decoding {
            self.prefill_while_decoding.min(chunk)
        } else {
            chunk
        };
        budget.max(1) as usize
    }
}

/// One step's work.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepPlan {
    /// Sequences removed because their deadline passed (blocks already freed).
    pub expired: Vec<SeqId>,
    /// Sequences preempted this step (blocks freed, queued again for recompute).
    pub preempted: Vec<SeqId>,
    /// Sequences that joined the running batch this step.
    pub admitted: Vec<SeqId>,
    pub decode: Option<DecodePlan>,
    /// Prefill chunks of different sequences, oldest first, together at most
    /// `prefill_chunk_size` tokens.
    pub prefills: Vec<PrefillPlan>,
}

impl StepPlan {
    pub fn is_idle(&self) -> bool {
        self.decode.is_none() && self.prefills.is_empty()
    }
}

/// One decode step: a row per decoding sequence, padded to `graph` rows by the runner.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodePlan {
    /// The decode graph (bucket) to run: the smallest `decoder_batch_sizes` entry >= rows.
    pub graph: u32,
    pub rows: Vec<DecodeRowPlan>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct DecodeRowPlan {
    pub seq: SeqId,
    /// Tokens already cached; the sequence's last token is written at this index.
    pub context_len: usize,
    pub block_table: Vec<u32>,
}

/// One prefill chunk: tokens `start..start+len` of `seq` (prompt, then generated tokens when
/// recomputing after a preemption).
#[derive(Debug, Clone, PartialEq)]
pub struct PrefillPlan {
    pub seq: SeqId,
    pub start: usize,
    pub len: usize,
    pub block_table: Vec<u32>,
    /// The chunk ends the prompt of a sequence that has generated nothing yet: its logits give
    /// the first token. False for a recompute (its next token is already known).
    pub sample: bool,
}

#[derive(Debug, Clone)]
struct SeqMeta {
    prompt_len: usize,
    /// Prompt + generated tokens.
    num_tokens: usize,
    /// Tokens in the KV cache.
    num_computed: usize,
    deadline: Option<Instant>,
    running: bool,
    /// Content keys of its full blocks of known tokens (prefix caching).
    keys: Vec<BlockKey>,
    /// Blocks of its table registered (or found) in the cache.
    registered: usize,
    /// Prompt tokens read from the cache instead of computed, in its first run.
    prefix_hit: Option<usize>,
    /// In its first run (never preempted): cache reads still count in `prefix_hit`.
    hit_open: bool,
}

impl SeqMeta {
    fn generated(&self) -> usize {
        self.num_tokens - self.prompt_len
    }
    /// Tokens to have in the cache before decoding (or sampling the first token).
    fn prefill_target(&self) -> usize {
        if self.generated() == 0 {
            self.prompt_len
        } else {
            self.num_tokens - 1
        }
    }
    fn is_decoding(&self) -> bool {
        self.generated() > 0 && self.num_computed + 1 == self.num_tokens
    }
}

/// Counts for `Lm.Load` and the gauges.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SchedulerLoad {
    pub running: u32,
    pub waiting: u32,
    pub free_blocks: u32,
    pub total_blocks: u32,
    /// Of the free blocks, those holding a cached prefix.
    pub cached_blocks: u32,
    pub tokens_in_flight: u64,
}

#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    kv: KvManager,
    seqs: HashMap<SeqId, SeqMeta>,
    /// Admission order; preempted sequences go back to the front.
    waiting: VecDeque<SeqId>,
    /// Oldest admission first; the newest is the preemption victim.
    running: Vec<SeqId>,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig) -> Self {
        let kv = KvManager::new(cfg.num_blocks, cfg.block_len);
        Scheduler {
            cfg,
            kv,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
        }
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }
    pub fn kv(&self) -> &KvManager {
        &self.kv
    }

    /// Queues a new sequence of `prompt_len` tokens. The caller has checked that its whole
    /// length fits the pool (see [`Scheduler::max_tokens_per_sequence`]).
    pub fn add(&mut self, seq: SeqId, prompt_len: usize, deadline: Option<Instant>) {
        debug_assert!(prompt_len > 0);
        self.seqs.insert(
            seq,
            SeqMeta {
                prompt_len,
                num_tokens: prompt_len,
                num_computed: 0,
                deadline,
                running: false,
                keys: Vec::new(),
                registered: 0,
                prefix_hit: None,
                hit_open: true,
            },
        );
        self.waiting.push_back(seq);
    }

    /// Appends content keys of `seq`'s next full blocks (block `i` of its known tokens gets
    /// the `i`-th key given over all calls).
    pub fn extend_keys(&mut self, seq: SeqId, keys: &[BlockKey]) {
        if let Some(m) = self.seqs.get_mut(&seq) {
            m.keys.extend_from_slice(keys);
        }
    }

    /// Prompt tokens `seq` read from the prefix cache instead of computing them, in its first
    /// run (`None` before its first admission).
    pub fn prefix_hit(&self, seq: SeqId) -> Option<usize> {
        self.seqs.get(&seq).and_then(|m| m.prefix_hit)
    }

    /// The longest sequence (prompt + generated) this pool can ever hold.
    pub fn max_tokens_per_sequence(&self) -> u64 {
        self.kv.capacity_tokens()
    }

    /// Removes a sequence (finished, cancelled) and frees its blocks. False if unknown.
    pub fn finish(&mut self, seq: SeqId) -> bool {
        if self.seqs.remove(&seq).is_none() {
            return false;
        }
        self.kv.free(seq);
        self.running.retain(|&s| s != seq);
        self.waiting.retain(|&s| s != seq);
        true
    }

    pub fn contains(&self, seq: SeqId) -> bool {
        self.seqs.contains_key(&seq)
    }
    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }
    /// Running sequences, oldest admission first.
    pub fn running(&self) -> &[SeqId] {
        &self.running
    }
    pub fn waiting(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.waiting.iter().copied()
    }

    pub fn load(&self) -> SchedulerLoad {
        SchedulerLoad {
            running: self.running.len() as u32,
            waiting: self.waiting.len() as u32,
            free_blocks: self.kv.free_blocks(),
            total_blocks: self.kv.total_blocks(),
            cached_blocks: self.kv.cached_free_blocks(),
            tokens_in_flight: self.seqs.values().map(|s| s.num_tokens as u64).sum(),
        }
    }

    /// Plans one step at time `now`.
    pub fn schedule(&mut self, now: Instant) -> StepPlan {
        let mut plan = StepPlan::default();

        // 1. Deadlines.
        let mut expired: Vec<SeqId> = self
            .seqs
            .iter()
            .filter(|(_, m)| m.deadline.is_some_and(|d| d <= now))
            .map(|(&id, _)| id)
            .collect();
        expired.sort_unstable();
        for id in expired {
            self.finish(id);
            plan.expired.push(id);
        }

        // 2. Room for one more token per decoding sequence, preempting the newest on shortage.
        let decoding: Vec<SeqId> = self
            .running
            .iter()
            .copied()
            .filter(|id| self.seqs[id].is_decoding())
            .collect();
        let mut rows = Vec::new();
        for id in decoding {
            if !self.seqs[&id].running {
                continue; // preempted earlier in this loop
            }
            let need = self.seqs[&id].num_computed + 1;
            loop {
                if self.kv.allocate(id, need).is_some() {
                    rows.push(id);
                    break;
                }
                let Some(&victim) = self.running.last() else {
                    break;
                };
                self.preempt(victim);
                plan.preempted.push(victim);
                if victim == id {
                    break;
                }
            }
        }

        // 3. Admission, only when this step preempted nothing.
        if plan.preempted.is_empty() {
            while self.running.len() < self.cfg.deploy.batch_size as usize {
                let Some(&id) = self.waiting.front() else {
                    break;
                };
                let target = self.seqs[&id].prefill_target();
                let hit = self.allocate_cached_prefix(id, target);
                if self.kv.allocate(id, target).is_none() {
                    self.kv.free(id); // the prefix goes back too
                    break;
                }
                self.waiting.pop_front();
                self.running.push(id);
                let block_len = self.cfg.block_len as usize;
                if let Some(m) = self.seqs.get_mut(&id) {
                    m.running = true;
                    m.num_computed = hit * block_len;
                    m.registered = hit;
                    m.prefix_hit.get_or_insert(hit * block_len);
                }
                plan.admitted.push(id);
            }
        }

        // 4. Prefill chunks, oldest first, out of the step's token budget.
        let mut budget = self.cfg.prefill_budget(!rows.is_empty());
        let prefilling: Vec<SeqId> = self
            .running
            .iter()
            .copied()
            .filter(|id| {
                let m = &self.seqs[id];
                m.num_computed < m.prefill_target()
            })
            .collect();
        // Blocks computed by this step's earlier chunks: a sequence whose next block is one of
        // them waits a step and reads it from the prefix cache instead (an identical prompt
        // admitted in the same step).
        let mut computing: Vec<BlockKey> = Vec::new();
        for id in prefilling {
            if budget == 0 {
                break;
            }
            self.adopt_computed_prefix(id);
            let m = &self.seqs[&id];
            if self.cfg.prefix_caching {
                let next = m.num_computed / self.cfg.block_len as usize;
                if m.keys.get(next).is_some_and(|k| computing.contains(k)) {
                    continue;
                }
            }
            let target = m.prefill_target();
            if m.num_computed >= target {
                continue; // the cache held the rest
            }
            let len = budget.min(target - m.num_computed);
            budget -= len;
            if self.cfg.prefix_caching {
                let block_len = self.cfg.block_len as usize;
                let blocks = m.num_computed / block_len..(m.num_computed + len) / block_len;
                computing.extend(m.keys.iter().skip(blocks.start).take(blocks.len()));
            }
            plan.prefills.push(PrefillPlan {
                seq: id,
                start: m.num_computed,
                len,
                block_table: self.kv.table(id).to_vec(),
                sample: m.generated() == 0 && m.num_computed + len == target,
            });
        }

        // 5. The decode batch in the smallest graph that holds it.
        if !rows.is_empty() {
            let n = rows.len() as u32;
            let graph = self
                .cfg
                .deploy
                .decoder_graph_for(n)
                .unwrap_or(n.max(self.cfg.deploy.batch_size));
            plan.decode = Some(DecodePlan {
                graph,
                rows: rows
                    .into_iter()
                    .map(|id| DecodeRowPlan {
                        seq: id,
                        context_len: self.seqs[&id].num_computed,
                        block_table: self.kv.table(id).to_vec(),
                    })
                    .collect(),
            });
        }
        plan
    }

    /// The cached blocks of `seq`'s longest cached prefix, at most those of `target - 1`
    /// tokens (one token is always computed); the number taken.
    fn allocate_cached_prefix(&mut self, seq: SeqId, target: usize) -> usize {
        if !self.cfg.prefix_caching {
            return 0;
        }
        let m = &self.seqs[&seq];
        let most = (target.saturating_sub(1) / self.cfg.block_len as usize).min(m.keys.len());
        let keys = m.keys[..most].to_vec();
        self.kv.allocate_prefix(seq, &keys)
    }

    /// Before `seq` computes its next chunk: blocks other sequences computed since it was
    /// admitted (an identical prompt admitted in the same step, prefilled first) are read
    /// from the cache instead, as at admission, still leaving one token to compute.
    fn adopt_computed_prefix(&mut self, seq: SeqId) {
        if !self.cfg.prefix_caching {
            return;
        }
        let block_len = self.cfg.block_len as usize;
        let Some(m) = self.seqs.get_mut(&seq) else {
            return;
        };
        if !m.num_computed.is_multiple_of(block_len) {
            return; // mid-block: the next block is partly computed by `seq` itself
        }
        let most = (m.prefill_target().saturating_sub(1) / block_len).min(m.keys.len());
        let mut i = m.num_computed / block_len;
        while i < most && self.kv.adopt_cached(seq, i, &m.keys[i]) {
            m.num_computed += block_len;
            m.registered = i + 1;
            if m.hit_open {
                *m.prefix_hit.get_or_insert(0) += block_len;
            }
            i += 1;
        }
    }

    /// Registers `seq`'s full computed blocks that have keys and are not registered yet.
    fn register_computed(&mut self, seq: SeqId) {
        if !self.cfg.prefix_caching {
            return;
        }
        let block_len = self.cfg.block_len as usize;
        let Some(m) = self.seqs.get_mut(&seq) else {
            return;
        };
        let upto = (m.num_computed / block_len).min(m.keys.len());
        for i in m.registered..upto {
            self.kv.register(seq, i, m.keys[i]);
        }
        m.registered = m.registered.max(upto);
    }

    /// Records that `plan` ran: decode rows cached their token and produced one more; the
    /// prefill chunks are cached (and produced the first token when `sample`). Sequences the
    /// caller removed in between are skipped. Blocks that became full are registered in the
    /// prefix cache.
    pub fn update(&mut self, plan: &StepPlan) {
        if let Some(d) = &plan.decode {
            for r in &d.rows {
                if let Some(m) = self.seqs.get_mut(&r.seq) {
                    m.num_computed += 1;
                    m.num_tokens += 1;
                }
                self.register_computed(r.seq);
            }
        }
        for p in &plan.prefills {
            if let Some(m) = self.seqs.get_mut(&p.seq) {
                m.num_computed += p.len;
                if p.sample {
                    m.num_tokens += 1;
                }
            }
            self.register_computed(p.seq);
        }
    }

    fn preempt(&mut self, seq: SeqId) {
        self.kv.free(seq);
        self.running.retain(|&s| s != seq);
        if let Some(m) = self.seqs.get_mut(&seq) {
            m.num_computed = 0;
            m.running = false;
            m.registered = 0;
            m.hit_open = false;
        }
        // Older preempted sequences end up in front of newer ones: victims are taken newest
        // first, each pushed to the front.
        self.waiting.push_front(seq);
    }
}

#[cfg(test)]
mod tests;
