use super::*;
use std::time::Duration;

fn cfg(batch: u32, buckets: &[u32], chunk: u32, blocks: u32, block_len: u32) -> SchedulerConfig {
    let mut d = DeployConfig::default_config();
    d.batch_size = batch;
    d.decoder_batch_sizes = buckets.to_vec();
    d.prefill_chunk_size = chunk;
    d.kvcache_partition_len = block_len;
    SchedulerConfig {
        deploy: d,
        num_blocks: blocks,
        block_len,
        prefix_caching: false,
        prefill_while_decoding: chunk,
    }
}

/// Runs one step, treating every row and sampled chunk as producing a token; returns the plan.
fn step(s: &mut Scheduler, now: Instant) -> StepPlan {
    let p = s.schedule(now);
    s.update(&p);
    p
}

/// Steps until `seq` is decoding (its prompt is in the cache and a token was sampled).
fn run_until_decoding(s: &mut Scheduler, seq: SeqId, now: Instant) -> Vec<StepPlan> {
    let mut plans = Vec::new();
    for _ in 0..100 {
        if s.seqs.get(&seq).is_some_and(|m| m.is_decoding()) {
            return plans;
        }
        plans.push(step(s, now));
    }
    panic!("{seq} never started decoding");
}

#[test]
fn graph_is_the_smallest_bucket_holding_the_batch() {
    let now = Instant::now();
    let mut s = Scheduler::new(cfg(8, &[1, 2, 4, 8], 64, 100, 16));
    let mut graphs = Vec::new();
    for id in 0..8u64 {
        s.add(id, 4, None);
        run_until_decoding(&mut s, id, now);
        let p = step(&mut s, now);
        let d = p.decode.expect("decoding");
        graphs.push((d.rows.len(), d.graph));
    }
    assert_eq!(
        graphs,
        vec![
            (1, 1),
            (2, 2),
            (3, 4),
            (4, 4),
            (5, 8),
            (6, 8),
            (7, 8),
            (8, 8)
        ]
    );
    // Sequences leave: the graph shrinks back.
    for id in 0..6u64 {
        s.finish(id);
    }
    assert_eq!(step(&mut s, now).decode.unwrap().graph, 2);
    s.finish(6);
    assert_eq!(step(&mut s, now).decode.unwrap().graph, 1);
}

#[test]
fn single_graph_config_always_runs_it() {
    let now = Instant::now();
    let mut s = Scheduler::new(cfg(8, &[8], 64, 100, 16));
    s.add(1, 3, None);
    run_until_decoding(&mut s, 1, now);
    assert_eq!(step(&mut s, now).decode.unwrap().graph, 8);
}

#[test]
fn admits_in_arrival_order_up_to_batch_size() {
    let now = Instant::now();
    let mut s = Scheduler::new(cfg(2, &[1, 2], 64, 100, 16));
    for id in [5u64, 3, 9] {
        s.add(id, 10, None);
    }
    let p = s.schedule(now);
    assert_eq!(p.admitted, vec![5, 3]);
    assert_eq!(s.waiting().collect::<Vec<_>>(), vec![9]);
    assert_eq!(
        p.prefills
            .iter()
            .map(|c| (c.seq, c.len))
            .collect::<Vec<_>>(),
        vec![(5, 10), (3, 10)],
        "oldest first, both in the budget"
    );
    s.update(&p);
    s.finish(5);
    let p = s.schedule(now);
    assert_eq!(p.admitted, vec![9]);
    assert_eq!(s.running(), &[3, 9]);
}

#[test]
fn admission_waits_for_blocks_and_keeps_order() {
    let now = Instant::now();
    // 4 blocks of 4 tokens.
    let mut s = Scheduler::new(cfg(4, &[1, 2, 4], 64, 4, 4));
    s.add(1, 12, None); // 3 blocks
    s.add(2, 8, None); // 2 blocks: does not fit next to 1
    s.add(3, 2, None); // 1 block: would fit, but must not overtake 2
    let p = s.schedule(now);
    assert_eq!(p.admitted, vec![1]);
    assert_eq!(s.waiting().collect::<Vec<_>>(), vec![2, 3]);
    s.update(&p);
    s.finish(1);
    let p = s.schedule(now);
    assert_eq!(p.admitted, vec![2, 3]);
}

#[test]
fn chunked_prefill_interleaves_with_decode() {
    let now = Instant::now();
    let mut s = Scheduler::new(cfg(4, &[1, 2, 4], 4, 100, 4));
    s.add(1, 3, None);
    run_until_decoding(&mut s, 1, now);
    s.add(2, 10, None); // 3 chunks of 4, 4, 2
    let mut chunks = Vec::new();
    for _ in 0..3 {
        let p = step(&mut s, now);
        let d = p.decode.expect("the running stream decodes every step");
        assert_eq!(d.rows.iter().map(|r| r.seq).collect::<Vec<_>>(), vec![1]);
        assert_eq!(p.prefills.len(), 1, "a chunk every step");
        let c = &p.prefills[0];
        chunks.push((c.seq, c.start, c.len, c.sample));
    }
    assert_eq!(
        chunks,
        vec![(2, 0, 4, false), (2, 4, 4, false), (2, 8, 2, true)]
    );
    let p = step(&mut s, now);
    let d = p.decode.unwrap();
    assert_eq!(
        d.rows
            .iter()
            .map(|r| (r.seq, r.context_len))
            .collect::<Vec<_>>(),
        vec![(1, 6), (2, 10)]
    );
    assert!(p.prefills.is_empty());
}

#[test]
fn short_prompts_are_packed_under_the_token_budget() {
    let now = Instant::now();
    // Budget 16: prompts of 5, 6 and 9 tokens; the third gets what is left.
    let mut s = Scheduler::new(cfg(4, &[1, 2, 4], 16, 100, 4));
    s.add(1, 3, None);
    run_until_decoding(&mut s, 1, now);
    for (id, len) in [(2u64, 5usize), (3, 6), (4, 9)] {
        s.add(id, len, None);
    }
    let p = step(&mut s, now);
    assert_eq!(p.admitted, vec![2, 3, 4]);
    let chunks: Vec<_> = p
        .prefills
        .iter()
        .map(|c| (c.seq, c.start, c.len, c.sample))
        .collect();
    assert_eq!(
        chunks,
        vec![(2, 0, 5, true), (3, 0, 6, true), (4, 0, 5, false)]
    );
    assert_eq!(
        p.decode.unwrap().rows.len(),
        1,
        "the running stream decodes too"
    );
    let p = step(&mut s, now);
    let chunks: Vec<_> = p.prefills.iter().map(|c| (c.seq, c.start, c.len)).collect();
    assert_eq!(chunks, vec![(4, 5, 4)]);
    let d = p.decode.unwrap();
    assert_eq!(
        d.rows.iter().map(|r| r.seq).collect::<Vec<_>>(),
        vec![1, 2, 3],
        "packed prompts decode from the next step"
    );
}

#[test]
fn a_long_prompt_takes_the_whole_budget_and_the_next_waits() {
    let now = Instant::now();
    let mut s = Scheduler::new(cfg(4, &[1, 2, 4], 8, 100, 4));
    s.add(1, 20, None);
    s.add(2, 3, None);
    let lens: Vec<Vec<(u64, usize)>> = (0..4)
        .map(|_| {
            step(&mut s, now)
                .prefills
                .iter()
                .map(|c| (c.seq, c.len))
                .collect()
        })
        .collect();
    assert_eq!(
        lens,
        vec![vec![(1, 8)], vec![(1, 8)], vec![(1, 4), (2, 3)], vec![]],
    );
}

#[test]
fn a_smaller_budget_while_streams_decode() {
    let now = Instant::now();
    let c = cfg(4, &[1, 2, 4], 16, 100, 4).with_prefill_while_decoding(4);
    assert_eq!((c.prefill_budget(false), c.prefill_budget(true)), (16, 4));
    let mut s = Scheduler::new(c);
    s.add(1, 20, None);
    // Nothing decodes: the whole budget.
    let p = step(&mut s, now);
    assert_eq!(p.prefills[0].len, 16);
    s.add(2, 9, None);
    // 1 ends its prompt (4 left) and starts decoding; 2 is admitted.
    let p = step(&mut s, now);
    assert_eq!(
        p.prefills
            .iter()
            .map(|c| (c.seq, c.len))
            .collect::<Vec<_>>(),
        vec![(1, 4), (2, 9)]
    );
    // 1 and 2 decode now: a third prompt gets 4 tokens a step.
    s.add(3, 10, None);
    let lens: Vec<_> = (0..3)
        .map(|_| {
            let p = step(&mut s, now);
            assert!(p.decode.is_some(), "streams decode every step");
            p.prefills
                .iter()
                .map(|c| (c.seq, c.len))
                .collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(lens, vec![vec![(3, 4)], vec![(3, 4)], vec![(3, 2)]]);
    // Over the chunk size or 0: the chunk size.
    let c = cfg(4, &[4], 16, 100, 4);
    assert_eq!(
        c.clone()
            .with_prefill_while_decoding(0)
            .prefill_budget(true),
        16
    );
    assert_eq!(c.with_prefill_while_decoding(64).prefill_budget(true), 16);
}

#[test]
fn preempts_the_newest_and_recomputes_it() {
    let now = Instant::now();
    // 4 blocks of 4 tokens; three 3-token prompts hold one block each.
    let mut s = Scheduler::new(cfg(4, &[1, 2, 4], 64, 4, 4));
    for id in 1..=3u64 {
        s.add(id, 3, None);
    }
    for id in 1..=3u64 {
        run_until_decoding(&mut s, id, now);
    }
    // The three prompts were packed into one step; the next step fills each one's block.
    let p = step(&mut s, now);
    assert!(p.preempted.is_empty());
    assert_eq!(p.decode.unwrap().rows.len(), 3);
    // Seq 1 takes the last free block; seq 2 now needs a second block: the newest (3) goes.
    let p = step(&mut s, now);
    assert_eq!(p.preempted, vec![3]);
    let d = p.decode.unwrap();
    assert_eq!(d.rows.iter().map(|r| r.seq).collect::<Vec<_>>(), vec![1, 2]);
    assert!(
        p.admitted.is_empty(),
        "no admission in a step that preempted"
    );
    assert_eq!(s.waiting().collect::<Vec<_>>(), vec![3]);
    assert_eq!(s.kv().table(3).len(), 0);
    // Seq 3 comes back once blocks free up, and re-prefills prompt + generated but the last.
    s.finish(1);
    let p = step(&mut s, now);
    assert_eq!(p.admitted, vec![3]);
    let c = &p.prefills[0];
    assert_eq!((c.seq, c.start, c.len, c.sample), (3, 0, 4, false));
    let p = step(&mut s, now);
    let d = p.decode.unwrap();
    assert_eq!(
        d.rows
            .iter()
            .map(|r| (r.seq, r.context_len))
            .collect::<Vec<_>>(),
        vec![(2, 6), (3, 4)]
    );
}

#[test]
fn a_newest_sequence_short_of_blocks_preempts_itself() {
    let now = Instant::now();
    let mut s = Scheduler::new(cfg(2, &[1, 2], 64, 3, 4));
    s.add(1, 4, None);
    s.add(2, 4, None);
    run_until_decoding(&mut s, 1, now);
    run_until_decoding(&mut s, 2, now);
    // 2 blocks used, 1 free; both need a second block.
    let p = step(&mut s, now);
    assert_eq!(p.preempted, vec![2]);
    assert_eq!(p.decode.unwrap().rows.len(), 1);
}

#[test]
fn preempted_sequences_are_not_starved_by_new_arrivals() {
    let now = Instant::now();
    let mut s = Scheduler::new(cfg(2, &[1, 2], 64, 3, 4));
    s.add(1, 4, None);
    s.add(2, 4, None);
    run_until_decoding(&mut s, 1, now);
    run_until_decoding(&mut s, 2, now);
    assert_eq!(step(&mut s, now).preempted, vec![2]);
    // A stream of newcomers must not overtake seq 2.
    for id in 10..20u64 {
        s.add(id, 1, None);
    }
    let mut readmitted = false;
    for _ in 0..50 {
        let p = step(&mut s, now);
        if let Some(&first) = p.admitted.first() {
            assert_eq!(
                first, 2,
                "the preempted sequence is admitted before any newcomer"
            );
            readmitted = true;
            break;
        }
        // Seq 1 finishes after a few tokens.
        if s.seqs.get(&1).is_some_and(|m| m.generated() >= 3) {
            s.finish(1);
        }
    }
    assert!(readmitted);
}

#[test]
fn deadlines_expire_on_the_fake_clock_and_free_blocks() {
    let t0 = Instant::now();
    let mut s = Scheduler::new(cfg(2, &[1, 2], 64, 10, 4));
    s.add(1, 8, Some(t0 + Duration::from_secs(5)));
    s.add(2, 8, None);
    s.add(3, 8, Some(t0 + Duration::from_secs(1)));
    let p = step(&mut s, t0);
    assert_eq!(p.admitted, vec![1, 2]);
    assert_eq!(s.kv().free_blocks(), 6);
    let p = step(&mut s, t0 + Duration::from_secs(2));
    assert_eq!(p.expired, vec![3], "a waiting sequence expires too");
    let p = step(&mut s, t0 + Duration::from_secs(6));
    assert_eq!(p.expired, vec![1]);
    assert!(s.kv().table(1).is_empty());
    assert_eq!(s.kv().free_blocks() as usize, 10 - s.kv().table(2).len());
    assert_eq!(s.running(), &[2]);
}

#[test]
fn finish_frees_blocks_and_load_counts() {
    let now = Instant::now();
    let mut s = Scheduler::new(cfg(2, &[1, 2], 64, 10, 4));
    s.add(1, 5, None);
    s.add(2, 3, None);
    s.add(3, 3, None);
    step(&mut s, now);
    let l = s.load();
    assert_eq!(
        (l.running, l.waiting, l.free_blocks, l.total_blocks),
        (2, 1, 7, 10)
    );
    assert_eq!(
        l.tokens_in_flight, 13,
        "seqs 1 and 2 shared the step and sampled their first tokens"
    );
    assert!(s.finish(1));
    assert!(!s.finish(1));
    assert_eq!(s.load().free_blocks, 9);
}

// ---- prefix caching

fn caching(blocks: u32, block_len: u32) -> Scheduler {
    let mut c = cfg(4, &[1, 2, 4], 64, blocks, block_len);
    c.prefix_caching = true;
    Scheduler::new(c)
}

fn keys(ids: &[u8]) -> Vec<BlockKey> {
    ids.iter().map(|&i| [i; 16]).collect()
}

/// Adds `seq` with its prompt's block keys.
fn add_keyed(s: &mut Scheduler, seq: SeqId, prompt_len: usize, k: &[u8]) {
    s.add(seq, prompt_len, None);
    s.extend_keys(seq, &keys(k));
}

#[test]
fn a_shared_prefix_is_not_computed_again() {
    let now = Instant::now();
    let mut s = caching(20, 4);
    add_keyed(&mut s, 1, 10, &[1, 2]); // 2 full blocks + 2 tokens
    run_until_decoding(&mut s, 1, now);
    assert_eq!(s.prefix_hit(1), Some(0));
    assert_eq!(s.kv().cached_blocks(), 2);
    // The same first two blocks, then other tokens.
    add_keyed(&mut s, 2, 11, &[1, 2]);
    let plans = run_until_decoding(&mut s, 2, now);
    let first = plans
        .iter()
        .find_map(|p| p.prefills.iter().find(|c| c.seq == 2).cloned())
        .unwrap();
    assert_eq!(
        (first.start, first.len),
        (8, 3),
        "prefill starts after the hit"
    );
    assert_eq!(s.prefix_hit(2), Some(8));
    assert_eq!(
        &s.kv().table(2)[..2],
        &s.kv().table(1)[..2],
        "shared blocks"
    );
    // A prompt that is exactly its cached blocks still computes its last block.
    add_keyed(&mut s, 3, 8, &[1, 2]);
    run_until_decoding(&mut s, 3, now);
    assert_eq!(s.prefix_hit(3), Some(4));
}

#[test]
fn without_prefix_caching_nothing_is_shared() {
    let now = Instant::now();
    let mut s = Scheduler::new(cfg(4, &[1, 2, 4], 64, 20, 4));
    add_keyed(&mut s, 1, 10, &[1, 2]);
    run_until_decoding(&mut s, 1, now);
    add_keyed(&mut s, 2, 10, &[1, 2]);
    run_until_decoding(&mut s, 2, now);
    assert_eq!(s.prefix_hit(2), Some(0));
    assert_eq!(s.kv().cached_blocks(), 0);
}

#[test]
fn generated_blocks_are_cached_for_the_next_turn() {
    let now = Instant::now();
    let mut s = caching(20, 4);
    add_keyed(&mut s, 1, 6, &[1]);
    run_until_decoding(&mut s, 1, now);
    // Tokens 6 and 7 are generated: block 1 (tokens 4..8) is then known; its key arrives
    // as the engine samples token 7, and it is registered once token 7 is computed.
    step(&mut s, now); // computes token 6, samples token 7
    s.extend_keys(1, &keys(&[2]));
    assert_eq!(s.kv().cached_blocks(), 1);
    step(&mut s, now); // computes token 7
    assert_eq!(s.kv().cached_blocks(), 2);
    s.finish(1);
    // The next turn: both blocks and more.
    add_keyed(&mut s, 2, 12, &[1, 2, 3]);
    run_until_decoding(&mut s, 2, now);
    assert_eq!(s.prefix_hit(2), Some(8));
}

#[test]
fn cached_blocks_are_evicted_only_under_pressure_and_counts_stay_right() {
    let now = Instant::now();
    let mut s = caching(6, 4);
    add_keyed(&mut s, 1, 8, &[1, 2]);
    run_until_decoding(&mut s, 1, now);
    s.finish(1); // cancelled: its 3 blocks free, 2 of them cached
    assert_eq!((s.kv().free_blocks(), s.kv().cached_free_blocks()), (6, 2));
    // A sequence needing 5 blocks of other content: the plain free ones first, then one
    // cached block is evicted.
    add_keyed(&mut s, 2, 20, &[7, 8, 9, 10, 11]);
    run_until_decoding(&mut s, 2, now);
    assert_eq!(s.prefix_hit(2), Some(0));
    assert_eq!(s.kv().cached_free_blocks(), 1);
    s.finish(2);
    assert_eq!(s.kv().free_blocks(), 6);
    assert_eq!(s.kv().used_blocks(), 0);
}

/// A pool of `blocks` blocks of 4 tokens with sequences 1 and 2 decoding, both 9-token
/// prompts whose first 2 blocks have the same keys (2 reads them from 1's cache).
fn two_sharers_decoding(blocks: u32, now: Instant) -> Scheduler {
    let mut s = caching(blocks, 4);
    add_keyed(&mut s, 1, 9, &[1, 2]);
    run_until_decoding(&mut s, 1, now);
    add_keyed(&mut s, 2, 9, &[1, 2]);
    run_until_decoding(&mut s, 2, now);
    s
}

#[test]
fn preempting_a_sharer_keeps_the_shared_blocks_and_it_hits_again() {
    let now = Instant::now();
    // 7 blocks of 4: two sequences of 9-token prompts sharing 2 blocks hold 2 + 1 + 1 = 4.
    let mut s = two_sharers_decoding(7, now);
    assert_eq!(s.kv().used_blocks(), 4);
    // Both decode until the pool runs out: the newest (2) is preempted, 1 keeps its blocks.
    let mut preempted = false;
    for _ in 0..40 {
        let p = step(&mut s, now);
        if p.preempted.contains(&2) {
            preempted = true;
            assert_eq!(s.kv().table(2).len(), 0);
            assert!(
                s.kv().table(1).len() >= 3,
                "the survivor keeps the shared blocks"
            );
            break;
        }
    }
    assert!(preempted, "sequence 2 was never preempted");
    s.finish(1);
    // Re-admitted, 2 recomputes from its cached prefix, not from zero.
    let plans = run_until_decoding(&mut s, 2, now);
    let first = plans
        .iter()
        .find_map(|p| p.prefills.iter().find(|c| c.seq == 2).cloned())
        .unwrap();
    assert_eq!(first.start, 8);
    assert_eq!(
        s.prefix_hit(2),
        Some(8),
        "usage reports the first admission's hit"
    );
    s.finish(2);
    assert_eq!(s.kv().used_blocks(), 0);
}

#[test]
fn identical_prompts_admitted_together_compute_their_blocks_once() {
    let now = Instant::now();
    let mut s = caching(20, 4);
    // Two 10-token prompts with the same two full blocks, admitted in one step.
    add_keyed(&mut s, 1, 10, &[1, 2]);
    add_keyed(&mut s, 2, 10, &[1, 2]);
    let p = step(&mut s, now);
    assert_eq!(p.admitted, vec![1, 2]);
    assert_eq!(s.prefix_hit(2), Some(0), "nothing was cached at admission");
    let plans = run_until_decoding(&mut s, 2, now);
    let chunks: Vec<(usize, usize)> = plans
        .iter()
        .filter_map(|p| p.prefills.iter().find(|c| c.seq == 2).cloned())
        .map(|c| (c.start, c.len))
        .collect();
    assert_eq!(
        chunks,
        vec![(8, 2)],
        "2 computes only past the shared blocks"
    );
    assert_eq!(s.prefix_hit(2), Some(8));
    assert_eq!(&s.kv().table(2)[..2], &s.kv().table(1)[..2]);
    // 2's own blocks for that prefix went back: 3 + 1 held, nothing leaked.
    assert_eq!(s.kv().used_blocks(), 4);
    s.finish(1);
    s.finish(2);
    assert_eq!(s.kv().used_blocks(), 0);
    assert_eq!(s.kv().cached_free_blocks(), 2);
}

#[test]
fn cancelling_a_sharer_leaves_the_shared_blocks_to_the_other() {
    let now = Instant::now();
    let mut s = two_sharers_decoding(10, now);
    let shared = s.kv().table(1)[..2].to_vec();
    assert_eq!(&s.kv().table(2)[..2], &shared[..]);
    let held = s.kv().used_blocks();
    // Cancelled: only its own block comes back; the shared ones stay held by 1.
    assert!(s.finish(2));
    assert_eq!(s.kv().used_blocks(), held - 1);
    assert_eq!(&s.kv().table(1)[..2], &shared[..]);
    for _ in 0..3 {
        let p = step(&mut s, now);
        assert_eq!(p.decode.map(|d| d.rows.len()), Some(1), "1 keeps decoding");
    }
    // 1 finishes too: everything free, its full blocks still cached for later.
    s.finish(1);
    assert_eq!(s.kv().used_blocks(), 0);
    assert!(s.kv().cached_free_blocks() >= 2);
    add_keyed(&mut s, 3, 9, &[1, 2]);
    run_until_decoding(&mut s, 3, now);
    assert_eq!(s.prefix_hit(3), Some(8));
}
