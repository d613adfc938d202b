//! Observability end to end: the three real services (vision-service, lm-service, gateway) on
//! the tiny random checkpoint.
//!
//! - traces: with `OTEL_EXPORTER_OTLP_ENDPOINT` pointing at an in-process OTLP collector, one
//!   Gateway.Generate request is one trace across the three services, with the ViT bucket and
//!   the decode graph on its spans;
//! - metrics: after one request, every metric name of deploy/README.md's table is on the
//!   `/metrics` of its service with a plausible value.
// Each test has its own runtime on its own thread; the std mutex only serialises them.
#![allow(clippy::await_holding_lock)]
mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;
use support::otlp::{Collector, SpanRecord};
use support::{generate, grpc_request, png, scrape, serial, Cluster, Metrics};

/// Only the services' own spans: their crates at `info`, everything else (tonic, h2, hyper, the
/// exporter itself) at `warn`.
const TRACE_LOG: &str = "warn,vlm_gateway=info,vlm_lm_service=info,vlm_vision_service=info,gateway=info,lm_service=info,vision_service=info,vlm_service_kit=info";

fn summary(spans: &[SpanRecord]) -> String {
    let mut s = String::new();
    for r in spans {
        s.push_str(&format!(
            "  {:<15} {:<28} trace={} span={} parent={} {:?}\n",
            r.service, r.name, r.trace_id, r.span_id, r.parent_span_id, r.attributes
        ));
    }
    s
}

const SERVICES: [&str; 3] = ["gateway", "lm-service", "vision-service"];

/// Starts the three services exporting to an in-process collector, sends one Gateway.Generate
/// with one 256x256 image and max_tokens 3, SIGTERMs the services (they flush on the way out)
/// and returns every span received.
async fn one_traced_request() -> Vec<SpanRecord> {
    let collector = Collector::start().await;
    let env: Vec<(String, String)> = vec![
        ("OTEL_EXPORTER_OTLP_ENDPOINT".into(), collector.endpoint()),
        ("OTEL_BSP_SCHEDULE_DELAY".into(), "200".into()),
        ("RUST_LOG".into(), TRACE_LOG.into()),
    ];
    let mut c = Cluster::start_env(1, &[], &env).await;
    let out = generate(
        &c.grpc(),
        grpc_request(&[png(256, 256, 5)], "Describe the image.", 3),
    )
    .await
    .expect("Gateway.Generate with one image");
    assert!(!out.tokens.is_empty() && out.tokens.len() <= 3, "{out:?}");

    // SIGTERM: each service drains and flushes its spans on the way out.
    let stuck = c.terminate_all(Duration::from_secs(90));
    assert!(
        stuck.is_empty(),
        "did not exit within 90 s of SIGTERM: {stuck:?}"
    );
    collector
        .wait_until(Duration::from_secs(10), |s| {
            SERVICES.iter().all(|n| s.iter().any(|r| r.service == *n))
        })
        .await
}

/// The spans of each service (asserting each sent some, and nobody else did).
fn by_service(spans: &[SpanRecord]) -> BTreeMap<&'static str, Vec<&SpanRecord>> {
    let all = summary(spans);
    let unknown: BTreeSet<&str> = spans
        .iter()
        .map(|r| r.service.as_str())
        .filter(|s| !SERVICES.contains(s))
        .collect();
    assert!(
        unknown.is_empty(),
        "spans with unexpected service.name {unknown:?} (OTEL_SERVICE_NAME is unset):\n{all}"
    );
    let m: BTreeMap<&'static str, Vec<&SpanRecord>> = SERVICES
        .iter()
        .map(|n| (*n, spans.iter().filter(|r| r.service == *n).collect()))
        .collect();
    for (name, list) in &m {
        assert!(
            !list.is_empty(),
            "no span from {name} reached the collector; received:\n{all}"
        );
    }
    m
}

/// The request's trace: the one trace id that spans of all three services share.
fn request_trace(by_service: &BTreeMap<&'static str, Vec<&SpanRecord>>, all: &str) -> String {
    let traces_of = |svc: &str| {
        by_service[svc]
            .iter()
            .map(|r| r.trace_id.clone())
            .collect::<BTreeSet<_>>()
    };
    let shared: Vec<String> = traces_of("gateway")
        .intersection(&traces_of("lm-service"))
        .cloned()
        .collect::<BTreeSet<_>>()
        .intersection(&traces_of("vision-service"))
        .cloned()
        .collect();
    assert_eq!(
        shared.len(),
        1,
        "expected one trace id shared by gateway, lm-service and vision-service; spans:\n{all}"
    );
    shared[0].clone()
}

/// One request with one image through gateway -> lm -> vision is one trace: the services' spans
/// share one trace id (and are parented across the hops), a vision span carries the ViT
/// `bucket`, an LM span the decode `graph`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_request_is_one_trace_across_three_services() {
    let _g = serial();
    let spans = one_traced_request().await;
    let all = summary(&spans);
    let by_service = by_service(&spans);
    let trace = request_trace(&by_service, &all);
    let trace = &trace;
    // One request: every gateway and vision span belongs to it.
    for svc in ["gateway", "vision-service"] {
        let other: Vec<_> = by_service[svc]
            .iter()
            .filter(|r| &r.trace_id != trace)
            .map(|r| r.name.as_str())
            .collect();
        assert!(
            other.is_empty(),
            "{svc} spans outside the request's trace {trace}: {other:?}\n{all}"
        );
    }

    // Parented across the hops, not just the same trace id: the LM's server span is a child of a
    // gateway span, the vision server span a child of an LM span.
    let ids = |svc: &str| {
        by_service[svc]
            .iter()
            .map(|r| r.span_id.clone())
            .collect::<BTreeSet<_>>()
    };
    let (gw_ids, lm_ids) = (ids("gateway"), ids("lm-service"));
    assert!(
        by_service["lm-service"]
            .iter()
            .any(|r| &r.trace_id == trace && gw_ids.contains(&r.parent_span_id)),
        "no lm-service span has a gateway span as parent:\n{all}"
    );
    assert!(
        by_service["vision-service"]
            .iter()
            .any(|r| lm_ids.contains(&r.parent_span_id)),
        "no vision-service span has an lm-service span as parent:\n{all}"
    );

    // A 256x256 image is 256 raw patches: the 1024 bucket.
    let bucket: Vec<&str> = by_service["vision-service"]
        .iter()
        .filter_map(|r| r.attr("bucket"))
        .collect();
    assert!(
        !bucket.is_empty(),
        "no vision-service span has a `bucket` attribute:\n{all}"
    );
    assert!(
        bucket.contains(&"1024"),
        "vision `bucket` attributes {bucket:?}, expected 1024:\n{all}"
    );

    let graphs: Vec<&&SpanRecord> = by_service["lm-service"]
        .iter()
        .filter(|r| r.attr("graph").is_some())
        .collect();
    assert!(
        !graphs.is_empty(),
        "no lm-service span has a decode `graph` attribute:\n{all}"
    );
    for g in &graphs {
        let v = g.attr("graph").unwrap();
        assert!(
            ["1", "2", "4", "8"].contains(&v),
            "decode `graph` {v:?} is not a decoder batch size:\n{all}"
        );
    }
}

/// The decode steps that served the request are visible in its trace (a span with the decode
/// `graph` under the request's LM span, or the step span linked/parented to it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_steps_are_in_the_request_trace() {
    let _g = serial();
    let spans = one_traced_request().await;
    let all = summary(&spans);
    let by_service = by_service(&spans);
    let trace = request_trace(&by_service, &all);
    assert!(
        by_service["lm-service"]
            .iter()
            .any(|r| r.trace_id == trace && r.attr("graph").is_some()),
        "no lm-service span with a decode `graph` attribute in the request's trace {trace}:\n{all}"
    );
}

/// The documented kind of a metric (deploy/README.md's table).
#[derive(Clone, Copy, Debug)]
enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// Each metric, its kind and the least value it must have after one request with one image
/// (for histograms: the least `_count`).
const VISION: &[(&str, Kind, f64)] = &[
    ("vlm_vision_encode_seconds", Kind::Histogram, 1.0),
    ("vlm_vision_images_total", Kind::Counter, 1.0),
    ("vlm_vision_padding_fraction", Kind::Histogram, 1.0),
    ("vlm_vision_queue_depth", Kind::Gauge, 0.0),
    ("vlm_vision_images_in_flight", Kind::Gauge, 0.0),
    ("vlm_vision_requests_total", Kind::Counter, 1.0),
    ("vlm_vision_spread_images_total", Kind::Counter, 0.0),
];
const LM: &[(&str, Kind, f64)] = &[
    ("vlm_lm_time_to_first_token_seconds", Kind::Histogram, 1.0),
    // Three tokens: at least two gaps between tokens.
    ("vlm_lm_time_per_output_token_seconds", Kind::Histogram, 1.0),
    ("vlm_lm_running", Kind::Gauge, 0.0),
    ("vlm_lm_waiting", Kind::Gauge, 0.0),
    ("vlm_lm_kv_blocks_used", Kind::Gauge, 0.0),
    // Checked > 0 below.
    ("vlm_lm_kv_blocks_free", Kind::Gauge, 1.0),
    ("vlm_lm_decode_steps_total", Kind::Counter, 1.0),
    ("vlm_lm_preemptions_total", Kind::Counter, 0.0),
    ("vlm_lm_embedding_cache_hits_total", Kind::Counter, 0.0),
    // The image was new to the LM.
    ("vlm_lm_embedding_cache_misses_total", Kind::Counter, 1.0),
    ("vlm_lm_generated_tokens_total", Kind::Counter, 1.0),
    (
        "vlm_lm_prefix_cache_prompt_tokens_total",
        Kind::Counter,
        1.0,
    ),
    ("vlm_lm_prefix_cache_hit_tokens_total", Kind::Counter, 0.0),
    ("vlm_lm_kv_blocks_cached", Kind::Gauge, 0.0),
];
const GATEWAY: &[(&str, Kind, f64)] = &[
    ("vlm_gateway_requests_total", Kind::Counter, 1.0),
    ("vlm_gateway_queue_depth", Kind::Gauge, 0.0),
    ("vlm_gateway_in_flight", Kind::Gauge, 0.0),
    ("vlm_gateway_admission_refusals_total", Kind::Counter, 0.0),
    (
        "vlm_gateway_time_to_first_token_seconds",
        Kind::Histogram,
        1.0,
    ),
    ("vlm_gateway_request_duration_seconds", Kind::Histogram, 1.0),
    ("vlm_gateway_prompt_tokens_total", Kind::Counter, 1.0),
    ("vlm_gateway_completion_tokens_total", Kind::Counter, 1.0),
    ("vlm_gateway_cached_prompt_tokens_total", Kind::Counter, 0.0),
    ("vlm_gateway_lm_routes_total", Kind::Counter, 1.0),
];

/// What is wrong with `m` against `table` (empty when all is well).
fn check(service: &str, m: &Metrics, table: &[(&str, Kind, f64)]) -> Vec<String> {
    let mut bad = Vec::new();
    for &(name, kind, least) in table {
        let (sample, what) = match kind {
            Kind::Histogram => (format!("{name}_count"), "_count"),
            Kind::Counter | Kind::Gauge => (name.to_string(), "value"),
        };
        match m.sum(&sample) {
            None => bad.push(format!("{service}: {name} ({kind:?}) is absent")),
            Some(v) if !v.is_finite() || v < least => bad.push(format!(
                "{service}: {name} {what} is {v}, expected >= {least}"
            )),
            Some(_) => {}
        }
        if let Kind::Histogram = kind {
            if m.sum(&format!("{name}_sum")).is_none() || m.sum(&format!("{name}_bucket")).is_none()
            {
                bad.push(format!(
                    "{service}: histogram {name} lacks _sum or _bucket series"
                ));
            }
        }
    }
    bad
}

/// After one request, `/metrics` of vision, LM and gateway lists every documented metric name
/// with a plausible value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_have_documented_names_after_a_request() {
    let _g = serial();
    metrics_after_one_request(&[]).await;
}

async fn metrics_after_one_request(skip: &[&str]) {
    let c = Cluster::start(1, &[]).await;
    let mut req = grpc_request(&[png(256, 256, 6)], "What is in the picture?", 3);
    req.sampling.as_mut().unwrap().ignore_eos = true;
    let out = generate(&c.grpc(), req)
        .await
        .expect("Gateway.Generate with one image");
    assert_eq!(out.tokens.len(), 3, "{out:?}");

    let keep = |t: &[(&'static str, Kind, f64)]| -> Vec<(&'static str, Kind, f64)> {
        t.iter()
            .copied()
            .filter(|(n, _, _)| !skip.contains(n))
            .collect()
    };
    let targets = [
        ("vision", c.vision.addr("metrics"), keep(VISION)),
        ("lm", c.lms[0].addr("metrics"), keep(LM)),
        ("gateway", c.http(), keep(GATEWAY)),
    ];
    // The gateway and the LM account a request as its stream ends, which may be just after the
    // client has read the last message: scrape until all is well or 10 s have passed.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let (bad, scraped) = loop {
        let scraped: Vec<(&str, Metrics)> = targets
            .iter()
            .map(|(s, addr, _)| (*s, scrape(addr)))
            .collect();
        let bad: Vec<String> = targets
            .iter()
            .zip(&scraped)
            .flat_map(|((s, _, table), (_, m))| check(s, m, table))
            .collect();
        if bad.is_empty() || std::time::Instant::now() >= deadline {
            break (bad, scraped);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    if !bad.is_empty() {
        for (s, m) in &scraped {
            eprintln!("----- {s} /metrics\n{}", m.text);
        }
    }
    assert!(
        bad.is_empty(),
        "metrics missing or implausible:\n  {}",
        bad.join("\n  ")
    );

    // Labels the table documents.
    let (vision, lm, gateway) = (&scraped[0].1, &scraped[1].1, &scraped[2].1);
    assert!(
        vision
            .labels("vlm_vision_images_total")
            .iter()
            .any(|l| l.contains("bucket=\"1024\"")),
        "vlm_vision_images_total has no bucket=\"1024\" series: {:?}",
        vision.labels("vlm_vision_images_total")
    );
    assert!(
        lm.labels("vlm_lm_decode_steps_total")
            .iter()
            .all(|l| l.contains("graph=\"")),
        "vlm_lm_decode_steps_total without a graph label: {:?}",
        lm.labels("vlm_lm_decode_steps_total")
    );
    assert!(
        gateway
            .labels("vlm_gateway_requests_total")
            .iter()
            .all(|l| l.contains("status=\"")),
        "vlm_gateway_requests_total without a status label: {:?}",
        gateway.labels("vlm_gateway_requests_total")
    );
    // Idle again: nothing running or queued.
    for (m, name) in [
        (lm, "vlm_lm_running"),
        (lm, "vlm_lm_waiting"),
        (gateway, "vlm_gateway_in_flight"),
        (gateway, "vlm_gateway_queue_depth"),
        (vision, "vlm_vision_queue_depth"),
        (vision, "vlm_vision_images_in_flight"),
    ] {
        assert_eq!(m.sum(name), Some(0.0), "{name} after the request finished");
    }
    assert_eq!(
        lm.sum("vlm_lm_kv_blocks_used"),
        Some(0.0),
        "KV blocks still used after the request"
    );
    assert!(lm.sum("vlm_lm_generated_tokens_total").unwrap() >= 3.0);
    assert!(gateway.sum("vlm_gateway_completion_tokens_total").unwrap() >= 3.0);
}
