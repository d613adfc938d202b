//! Soak: a minute at twice the gateway's admission limit. Every request is served or refused
//! at once with RESOURCE_EXHAUSTED and retry info, admitted requests complete, and the
//! gateway's and the LM's resident memory stay flat.
// Each test has its own runtime on its own thread; the std mutex only serialises them.
#![allow(clippy::await_holding_lock)]
mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::*;

const MIB: u64 = 1 << 20;
/// How long the load runs (after a warm-up of [`WARM_UP`]).
const SOAK: Duration = Duration::from_secs(60);
const WARM_UP: Duration = Duration::from_secs(10);

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v.get(((v.len() as f64 - 1.0) * p).round() as usize)
        .copied()
        .unwrap_or(f64::NAN)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn twice_the_admission_limit_for_a_minute() {
    let _g = serial();
    // Admission holds 2 running + 2 queued; 8 clients keep it at twice that.
    let c = Cluster::start(1, &["--max-in-flight", "2", "--max-queue", "2"]).await;
    let (gw, lm) = (c.gateway.pid(), c.lms[0].pid());
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..8)
        .map(|w| {
            let (addr, stop) = (c.grpc(), stop.clone());
            tokio::spawn(async move {
                let (mut served, mut refused) = (Vec::new(), Vec::new());
                let mut i = 0u32;
                while !stop.load(Ordering::Relaxed) {
                    let t = Instant::now();
                    let req = grpc_request(&[], &format!("client {w} request {i}"), 8);
                    let r = tokio::time::timeout(Duration::from_secs(60), generate(&addr, req))
                        .await
                        .unwrap_or_else(|_| panic!("client {w}: a request hung for 60 s"));
                    let secs = t.elapsed().as_secs_f64();
                    match r {
                        Ok(out) => {
                            assert!(!out.tokens.is_empty());
                            served.push(secs);
                        }
                        Err(e) => {
                            assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
                            use tonic_types::StatusExt;
                            assert!(e.get_details_retry_info().is_some(), "{e:?}");
                            refused.push(secs);
                            // As a client honouring RetryInfo would, a little sooner.
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                    }
                    i += 1;
                }
                (served, refused)
            })
        })
        .collect();
    tokio::time::sleep(WARM_UP).await;
    let start = (vm_rss(gw), vm_rss(lm));
    let mut samples = vec![start];
    let until = Instant::now() + SOAK;
    while Instant::now() < until {
        tokio::time::sleep(Duration::from_secs(5)).await;
        samples.push((vm_rss(gw), vm_rss(lm)));
    }
    stop.store(true, Ordering::Relaxed);
    let (mut served, mut refused) = (Vec::new(), Vec::new());
    for cl in clients {
        let (s, r) = cl.await.unwrap();
        served.extend(s);
        refused.extend(r);
    }
    let end = *samples.last().unwrap();
    eprintln!(
        "soak: {} served (median {:.3} s), {} refused (median {:.4} s, p99 {:.4} s); gateway RSS \
         {} -> {} MiB, LM RSS {} -> {} MiB (samples {:?})",
        served.len(),
        percentile(&mut served, 0.5),
        refused.len(),
        percentile(&mut refused.clone(), 0.5),
        percentile(&mut refused, 0.99),
        start.0 / MIB,
        end.0 / MIB,
        start.1 / MIB,
        end.1 / MIB,
        samples
            .iter()
            .map(|(g, l)| (g / MIB, l / MIB))
            .collect::<Vec<_>>()
    );
    assert!(
        !served.is_empty() && !refused.is_empty(),
        "the load was not at twice the limit"
    );
    assert!(
        end.0 < start.0 + 32 * MIB,
        "gateway memory grew: {samples:?}"
    );
    assert!(end.1 < start.1 + 32 * MIB, "LM memory grew: {samples:?}");
    // Nothing is left admitted or queued.
    let m = scrape(&c.http());
    assert_eq!(m.sum("vlm_gateway_in_flight"), Some(0.0));
    assert_eq!(m.sum("vlm_gateway_queue_depth"), Some(0.0));
}
