use super::*;

fn lm(healthy: bool, waiting: u32, free: u32, local: usize) -> LmLoad {
    LmLoad {
        healthy,
        draining: false,
        running: 0,
        waiting,
        free_kv_blocks: free,
        local_in_flight: local,
    }
}

#[test]
fn lm_choice_prefers_idle_then_free_blocks_and_skips_unhealthy() {
    assert_eq!(
        choose_lm(&[lm(true, 1, 100, 0), lm(true, 0, 10, 0)], &[]),
        Some(1)
    );
    assert_eq!(
        choose_lm(&[lm(true, 0, 10, 0), lm(true, 0, 50, 0)], &[]),
        Some(1)
    );
    assert_eq!(
        choose_lm(&[lm(true, 0, 50, 2), lm(true, 0, 10, 1)], &[]),
        Some(1)
    );
    assert_eq!(
        choose_lm(&[lm(false, 0, 99, 0), lm(true, 5, 1, 0)], &[]),
        Some(1)
    );
    assert_eq!(
        choose_lm(&[lm(true, 0, 9, 0), lm(true, 0, 9, 0)], &[]),
        Some(0)
    );
    assert_eq!(
        choose_lm(&[lm(true, 0, 9, 0), lm(true, 0, 9, 0)], &[0]),
        Some(1)
    );
    assert_eq!(choose_lm(&[lm(true, 0, 9, 0)], &[0]), None);
    let mut d = lm(true, 0, 99, 0);
    d.draining = true;
    assert_eq!(choose_lm(&[d, lm(true, 3, 1, 0)], &[]), Some(1));
    assert_eq!(choose_lm(&[], &[]), None);
}

const PAD: u32 = 9;

fn key(ids: &[u32]) -> PrefixKey {
    PrefixKey::first_block(ids, PAD, [], 4).unwrap()
}

#[test]
fn prefix_key_covers_the_first_full_block_only() {
    let img_a = [1u8; 32];
    let img_b = [2u8; 32];
    // No full block: nothing to key on.
    assert_eq!(PrefixKey::first_block(&[1, 2, 3], PAD, [], 4), None);
    assert_eq!(PrefixKey::first_block(&[1, 2, 3], PAD, [], 0), None);
    // Exactly one block, and what follows it does not matter.
    assert_eq!(key(&[1, 2, 3, 4]), key(&[1, 2, 3, 4, 5, 6]));
    assert_ne!(key(&[1, 2, 3, 4]), key(&[1, 2, 3, 5]));
    // The block length is part of the key.
    assert_ne!(
        PrefixKey::first_block(&[1, 2, 3, 4], PAD, [], 4),
        PrefixKey::first_block(&[1, 2, 3, 4], PAD, [], 2)
    );
    // Same placeholder ids, different images: different keys.
    let ids = [1, PAD, PAD, PAD, PAD, 2];
    let with = |imgs: &[(&[u8; 32], u32)]| {
        PrefixKey::first_block(&ids, PAD, imgs.iter().copied(), 4).unwrap()
    };
    assert_ne!(with(&[(&img_a, 4)]), with(&[(&img_b, 4)]));
    assert_eq!(with(&[(&img_a, 4)]), with(&[(&img_a, 4)]));
    // Two images in the block: their order counts; an image past the block does not.
    assert_ne!(
        with(&[(&img_a, 2), (&img_b, 2)]),
        with(&[(&img_b, 2), (&img_a, 2)])
    );
    let late = [1, 2, 3, 4, PAD, PAD];
    assert_eq!(
        PrefixKey::first_block(&late, PAD, [(&img_a, 2)], 4),
        PrefixKey::first_block(&late, PAD, [(&img_b, 2)], 4)
    );
    // Which part of an image the block covers counts (offsets), not only which image:
    // a block ending in the first 2 tokens of a 2-token image differs from one whose
    // placeholders are the last 2 of a longer run of the same image started earlier.
    let a = PrefixKey::first_block(&[1, 2, PAD, PAD], PAD, [(&img_a, 2)], 4);
    let b = PrefixKey::first_block(&[1, 2, PAD, PAD], PAD, [(&img_a, 5)], 4);
    assert_eq!(a, b, "the same tokens of the same image");
    let c = PrefixKey::first_block(&[PAD, PAD, PAD, PAD], PAD, [(&img_a, 4)], 4);
    let d = PrefixKey::first_block(&[PAD, PAD, PAD, PAD], PAD, [(&img_a, 2), (&img_a, 2)], 4);
    assert_ne!(c, d, "offsets 0..4 of one image vs 0..2 twice");
}

fn addrs(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("10.0.0.{i}:50052")).collect()
}

fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[test]
fn the_same_key_picks_the_same_replica_whatever_the_list_order() {
    let a = addrs(4);
    let idle = vec![lm(true, 0, 10, 0); 4];
    let mut won = [0usize; 4];
    for k in 0..200u32 {
        let key = key(&[k, k + 1, k + 2, k + 3]);
        let (i, route) = route_lm(&idle, &refs(&a), &[], Some(&key), 4).unwrap();
        assert_eq!(route, Route::Prefix);
        assert_eq!(route_lm(&idle, &refs(&a), &[], Some(&key), 4).unwrap().0, i);
        // Another gateway listing the replicas the other way round agrees.
        let rev: Vec<String> = a.iter().rev().cloned().collect();
        let (j, _) = route_lm(&idle, &refs(&rev), &[], Some(&key), 4).unwrap();
        assert_eq!(rev[j], a[i]);
        won[i] += 1;
    }
    // Keys spread over every replica (not all to the first, as load alone would do).
    assert!(won.iter().all(|&w| w >= 20), "{won:?}");
}

#[test]
fn removing_an_unrelated_replica_keeps_the_choice() {
    let a = addrs(5);
    let idle = vec![lm(true, 0, 10, 0); 5];
    let mut moved_to_runner_up = 0;
    for k in 0..100u32 {
        let key = key(&[7, k, 7, k]);
        let (i, _) = route_lm(&idle, &refs(&a), &[], Some(&key), 4).unwrap();
        for gone in 0..a.len() {
            let rest: Vec<String> = a
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != gone)
                .map(|(_, s)| s.clone())
                .collect();
            let (j, _) = route_lm(&idle[1..], &refs(&rest), &[], Some(&key), 4).unwrap();
            if gone != i {
                assert_eq!(rest[j], a[i], "key {k}: removing {} moved it", a[gone]);
            } else {
                // Only the keys the removed replica held move; and to where the retry
                // (it excluded) would go.
                let (r, _) = route_lm(&idle, &refs(&a), &[i], Some(&key), 4).unwrap();
                assert_eq!(rest[j], a[r]);
                moved_to_runner_up += 1;
            }
        }
        // Down (unhealthy) is the same as removed.
        let mut down = idle.clone();
        let other = (i + 1) % a.len();
        down[other].healthy = false;
        assert_eq!(route_lm(&down, &refs(&a), &[], Some(&key), 4).unwrap().0, i);
    }
    assert_eq!(moved_to_runner_up, 100);
}

#[test]
fn a_busy_preferred_replica_falls_back_to_the_least_loaded() {
    let a = addrs(3);
    let k = key(&[1, 2, 3, 4]);
    let idle = vec![lm(true, 0, 10, 0); 3];
    let (p, _) = route_lm(&idle, &refs(&a), &[], Some(&k), 4).unwrap();
    let (q, r) = ((p + 1) % 3, (p + 2) % 3);

    // Waiting requests while another replica has none: busy.
    let mut l = idle.clone();
    l[p].waiting = 1;
    l[q].free_kv_blocks = 50;
    assert_eq!(
        route_lm(&l, &refs(&a), &[], Some(&k), 4),
        Some((q, Route::PrefixBusy { preferred: p }))
    );
    assert_eq!(
        route_lm(&l, &refs(&a), &[], Some(&k), 4).unwrap().0,
        choose_lm(&l, &[]).unwrap()
    );
    // Every replica has waiting requests: the prefix still wins.
    for x in &mut l {
        x.waiting = 2;
    }
    assert_eq!(
        route_lm(&l, &refs(&a), &[], Some(&k), 4),
        Some((p, Route::Prefix))
    );

    // Opened by us: up to the margin over the least loaded is fine, past it is busy.
    let mut l = idle.clone();
    l[p].local_in_flight = 5;
    l[q].local_in_flight = 1;
    l[r].local_in_flight = 3;
    assert_eq!(
        route_lm(&l, &refs(&a), &[], Some(&k), 4),
        Some((p, Route::Prefix))
    );
    l[p].local_in_flight = 6;
    assert_eq!(
        route_lm(&l, &refs(&a), &[], Some(&k), 4),
        Some((q, Route::PrefixBusy { preferred: p }))
    );
    // The margin is the option's.
    assert_eq!(
        route_lm(&l, &refs(&a), &[], Some(&k), 8),
        Some((p, Route::Prefix))
    );
    // The least loaded is counted over eligible replicas only.
    l[q].healthy = false;
    assert_eq!(
        route_lm(&l, &refs(&a), &[], Some(&k), 4),
        Some((p, Route::Prefix))
    );
}

#[test]
fn no_key_routes_by_load_as_before() {
    let a = addrs(3);
    let cases: Vec<(Vec<LmLoad>, Vec<usize>)> = vec![
        (
            vec![lm(true, 1, 100, 0), lm(true, 0, 10, 0), lm(true, 0, 5, 0)],
            vec![],
        ),
        (
            vec![lm(true, 0, 10, 0), lm(true, 0, 50, 0), lm(true, 0, 50, 0)],
            vec![],
        ),
        (
            vec![lm(true, 0, 50, 2), lm(true, 0, 10, 1), lm(false, 0, 99, 0)],
            vec![],
        ),
        (
            vec![lm(true, 0, 9, 0), lm(true, 0, 9, 0), lm(true, 0, 9, 0)],
            vec![0],
        ),
        (
            vec![lm(true, 0, 9, 0), lm(false, 0, 9, 0), lm(true, 0, 9, 0)],
            vec![0, 2],
        ),
    ];
    for (loads, ex) in cases {
        assert_eq!(
            route_lm(&loads, &refs(&a), &ex, None, 4),
            choose_lm(&loads, &ex).map(|i| (i, Route::Load)),
            "{loads:?} excluding {ex:?}"
        );
    }
    // A keyed request with every replica out: none.
    let k = key(&[1, 2, 3, 4]);
    let down = vec![lm(false, 0, 9, 0); 3];
    assert_eq!(route_lm(&down, &refs(&a), &[], Some(&k), 4), None);
    assert_eq!(route_lm(&down[..1], &refs(&a[..1]), &[], Some(&k), 4), None);
}

#[test]
fn vision_choice_prefers_short_queue() {
    let v = |healthy, q, f| VisionLoad {
        healthy,
        queue_depth: q,
        images_in_flight: f,
        local_in_flight: 0,
    };
    assert_eq!(choose_vision(&[v(true, 3, 0), v(true, 1, 1)]), Some(1));
    assert_eq!(choose_vision(&[v(false, 0, 0), v(true, 9, 0)]), Some(1));
    assert_eq!(choose_vision(&[v(false, 0, 0)]), None);
}

#[tokio::test]
async fn failing_replica_goes_out_and_comes_back() {
    // Nothing listens on these ports: polls fail, so nothing is healthy.
    let r = Router::new(
        ReplicaSource::parse("127.0.0.1:1").unwrap(),
        ReplicaSource::parse("127.0.0.1:1").unwrap(),
        RoutingOptions {
            poll_timeout: Duration::from_millis(300),
            ..Default::default()
        },
    );
    r.refresh_sources().await;
    r.poll().await;
    assert!(!*r.ready().borrow());
    let e = r.pick_lm(&[], None).err().unwrap();
    assert!(e.to_string().contains("no healthy LM replica"), "{e}");
    // Marked healthy by hand, then failed by a call: out again.
    r.sets.write().unwrap().lm[0].load.healthy = true;
    assert!(r.pick_lm(&[], None).is_ok());
    r.mark_lm_failed("127.0.0.1:1");
    assert!(r.pick_lm(&[], None).is_err());
}

#[tokio::test]
async fn reconcile_keeps_known_replicas_adds_new_drops_gone_and_ignores_empty_lookups() {
    let addrs = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let mut set: Vec<Replica<LmLoad>> = Vec::new();
    let src = ReplicaSource::parse("10.0.0.1:5").unwrap();
    let reconcile =
        |set: &mut Vec<Replica<LmLoad>>, a| reconcile(set, a, &src, None, Keepalive::default());
    reconcile(&mut set, addrs(&["10.0.0.1:5", "10.0.0.2:5"]));
    assert_eq!(set.len(), 2);
    set[1].load.healthy = true; // state learned by polls
                                // A re-resolution: .1 is gone, .3 is new, .2 keeps its state; order follows the lookup.
    reconcile(&mut set, addrs(&["10.0.0.3:5", "10.0.0.2:5"]));
    let got: Vec<(&str, bool)> = set
        .iter()
        .map(|r| (r.addr.as_str(), r.load.healthy))
        .collect();
    assert_eq!(got, vec![("10.0.0.3:5", false), ("10.0.0.2:5", true)]);
    // A failed lookup (no addresses) leaves the set as it was.
    reconcile(&mut set, Vec::new());
    assert_eq!(set.len(), 2);
}
