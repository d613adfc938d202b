//! Logging and tracing setup.
//!
//! - `RUST_LOG` filters (default `info`); `VLM_LOG_FORMAT=json` for structured logs.
//! - OpenTelemetry trace export over OTLP/gRPC when `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//!   `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set, configured by the standard `OTEL_*`
//!   variables (`OTEL_SERVICE_NAME` overrides the service name; `OTEL_BSP_SCHEDULE_DELAY` etc.
//!   tune the batch processor). Off when unset.
//! - W3C trace context (`traceparent`) is propagated in gRPC metadata: [`inject`] on the
//!   client side, [`extract`] on the server side, so one request is one trace across the
//!   gateway, the LM and the vision service.
use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{fmt, EnvFilter, Layer};

/// Flushes and shuts down trace export when dropped (keep it alive for the process's life).
#[must_use = "dropping the guard stops trace export"]
pub struct TelemetryGuard {
    provider: Option<SdkTracerProvider>,
    /// The tonic exporter's connection tasks live here, independent of the service's own
    /// runtime (which is built after `init` and dropped before the guard).
    runtime: Option<tokio::runtime::Runtime>,
}

impl TelemetryGuard {
    /// Exports every finished span now.
    pub fn flush(&self) {
        if let Some(p) = &self.provider {
            let _ = p.force_flush();
        }
    }
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take() {
            let _ = p.force_flush();
            let _ = p.shutdown();
        }
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_timeout(std::time::Duration::from_secs(1));
        }
    }
}

/// True when the standard variables ask for OTLP trace export.
pub fn otlp_enabled() -> bool {
    [
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    ]
    .iter()
    .any(|k| std::env::var(k).is_ok_and(|v| !v.trim().is_empty()))
        && !std::env::var("OTEL_TRACES_EXPORTER").is_ok_and(|v| v == "none")
}

/// Installs the global subscriber for `service` (a second call in one process is a no-op and
/// returns an inert guard).
pub fn init(service: &'static str) -> TelemetryGuard {
    opentelemetry::global::set_text_map_propagator(
        opentelemetry_sdk::propagation::TraceContextPropagator::new(),
    );
    let filter = || EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let json = std::env::var("VLM_LOG_FORMAT").is_ok_and(|v| v.eq_ignore_ascii_case("json"));
    // VLM_LOG_SPANS=1: one line per closed span with its busy and idle time (a per-phase
    // profile of requests, no collector needed).
    let spans = if std::env::var("VLM_LOG_SPANS").is_ok_and(|v| v == "1") {
        fmt::format::FmtSpan::CLOSE
    } else {
        fmt::format::FmtSpan::NONE
    };
    let fmt_layer = if json {
        fmt::layer()
            .json()
            .with_current_span(true)
            .with_span_events(spans)
            .with_filter(filter())
            .boxed()
    } else {
        fmt::layer()
            .with_target(false)
            .with_span_events(spans)
            .with_filter(filter())
            .boxed()
    };
    let mut provider = None;
    let mut runtime = None;
    let otel_layer = if otlp_enabled() {
        match export_runtime().and_then(|rt| {
            let p = {
                let _enter = rt.enter();
                build_provider(service)?
            };
            runtime = Some(rt);
            Ok(p)
        }) {
            Ok(p) => {
                let tracer = p.tracer(service);
                provider = Some(p);
                Some(
                    tracing_opentelemetry::layer()
                        .with_tracer(tracer)
                        .with_filter(filter()),
                )
            }
            Err(e) => {
                eprintln!("warning: OTLP trace export disabled: {e}");
                None
            }
        }
    } else {
        None
    };
    if tracing_subscriber::registry()
        .with(fmt_layer)
        .with(otel_layer)
        .try_init()
        .is_err()
    {
        return TelemetryGuard {
            provider: None,
            runtime: None,
        };
    }
    if let Some(p) = &provider {
        opentelemetry::global::set_tracer_provider(p.clone());
        tracing::info!(service, "OTLP trace export on");
    }
    TelemetryGuard { provider, runtime }
}

/// A one-thread runtime for the OTLP exporter's gRPC channel.
fn export_runtime() -> Result<tokio::runtime::Runtime, Box<dyn std::error::Error>> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("otlp-export")
        .enable_all()
        .build()?)
}

fn build_provider(service: &'static str) -> Result<SdkTracerProvider, Box<dyn std::error::Error>> {
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .build()?;
    let name = std::env::var("OTEL_SERVICE_NAME").unwrap_or_else(|_| service.to_string());
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(name)
        .build();
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource)
        .build())
}

struct MetadataInjector<'a>(&'a mut tonic::metadata::MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (
            tonic::metadata::MetadataKey::from_bytes(key.as_bytes()),
            tonic::metadata::MetadataValue::try_from(value.as_str()),
        ) {
            self.0.insert(k, v);
        }
    }
}

struct MetadataExtractor<'a>(&'a tonic::metadata::MetadataMap);

impl Extractor for MetadataExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }
    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                tonic::metadata::KeyRef::Ascii(k) => Some(k.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

/// Writes the current span's trace context into outgoing gRPC metadata.
pub fn inject(metadata: &mut tonic::metadata::MetadataMap) {
    let cx = tracing::Span::current().context();
    opentelemetry::global::get_text_map_propagator(|p| {
        p.inject_context(&cx, &mut MetadataInjector(metadata))
    });
}

/// Makes `span` a child of the trace context found in incoming gRPC metadata (if any).
pub fn extract(metadata: &tonic::metadata::MetadataMap, span: &tracing::Span) {
    let cx =
        opentelemetry::global::get_text_map_propagator(|p| p.extract(&MetadataExtractor(metadata)));
    let _ = span.set_parent(cx);
}

/// Same as [`inject`], for HTTP headers (the gateway's OpenAI API receives `traceparent` too).
pub fn extract_http(headers: &axum::http::HeaderMap, span: &tracing::Span) {
    struct H<'a>(&'a axum::http::HeaderMap);
    impl Extractor for H<'_> {
        fn get(&self, key: &str) -> Option<&str> {
            self.0.get(key).and_then(|v| v.to_str().ok())
        }
        fn keys(&self) -> Vec<&str> {
            self.0.keys().map(|k| k.as_str()).collect()
        }
    }
    let cx = opentelemetry::global::get_text_map_propagator(|p| p.extract(&H(headers)));
    let _ = span.set_parent(cx);
}
