//! An in-process OTLP/gRPC trace collector for tests: a tonic `TraceService` on 127.0.0.1:0
//! that keeps every span it receives, flattened to [`SpanRecord`]s.
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{any_value::Value, AnyValue, KeyValue};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One received span. Ids are lower-case hex ("" for an absent parent).
#[derive(Clone, Debug)]
pub struct SpanRecord {
    /// `service.name` of the resource that sent it.
    pub service: String,
    pub name: String,
    pub trace_id: String,
    pub span_id: String,
    pub parent_span_id: String,
    /// Every span attribute, its value written as a string.
    pub attributes: BTreeMap<String, String>,
}

impl SpanRecord {
    pub fn attr(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).map(String::as_str)
    }
}

#[derive(Clone, Default)]
struct Store(Arc<Mutex<Vec<SpanRecord>>>);

#[tonic::async_trait]
impl TraceService for Store {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut got = Vec::new();
        for rs in request.into_inner().resource_spans {
            let service = rs
                .resource
                .as_ref()
                .and_then(|r| r.attributes.iter().find(|kv| kv.key == "service.name"))
                .and_then(|kv| kv.value.as_ref())
                .map(any_to_string)
                .unwrap_or_default();
            for ss in rs.scope_spans {
                for s in ss.spans {
                    got.push(SpanRecord {
                        service: service.clone(),
                        name: s.name,
                        trace_id: hex(&s.trace_id),
                        span_id: hex(&s.span_id),
                        parent_span_id: hex(&s.parent_span_id),
                        attributes: attributes(&s.attributes),
                    });
                }
            }
        }
        self.0.lock().unwrap_or_else(|p| p.into_inner()).extend(got);
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// The running collector; stops serving when dropped.
pub struct Collector {
    addr: SocketAddr,
    store: Store,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Collector {
    /// Binds 127.0.0.1:0 and serves on the current tokio runtime.
    pub async fn start() -> Collector {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the OTLP collector");
        let addr = listener.local_addr().unwrap();
        let store = Store::default();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let svc = TraceServiceServer::new(store.clone()).max_decoding_message_size(64 << 20);
        tokio::spawn(async move {
            let incoming = tonic::transport::server::TcpIncoming::from(listener);
            let _ = tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming_shutdown(incoming, async {
                    let _ = stopped.await;
                })
                .await;
        });
        Collector {
            addr,
            store,
            stop: Some(stop),
        }
    }

    /// The value for `OTEL_EXPORTER_OTLP_ENDPOINT`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<SpanRecord> {
        self.store
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Waits until `done` holds for the spans received (or `timeout` passes) and returns them.
    pub async fn wait_until(
        &self,
        timeout: Duration,
        done: impl Fn(&[SpanRecord]) -> bool,
    ) -> Vec<SpanRecord> {
        let deadline = Instant::now() + timeout;
        loop {
            let spans = self.spans();
            if done(&spans) || Instant::now() >= deadline {
                return spans;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn attributes(kvs: &[KeyValue]) -> BTreeMap<String, String> {
    kvs.iter()
        .map(|kv| {
            (
                kv.key.clone(),
                kv.value.as_ref().map(any_to_string).unwrap_or_default(),
            )
        })
        .collect()
}

fn any_to_string(v: &AnyValue) -> String {
    match &v.value {
        None => String::new(),
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::BoolValue(b)) => b.to_string(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        Some(Value::BytesValue(b)) => hex(b),
        Some(Value::ArrayValue(a)) => {
            format!(
                "[{}]",
                a.values
                    .iter()
                    .map(any_to_string)
                    .collect::<Vec<_>>()
                    .join(",")
            )
        }
        Some(Value::KvlistValue(l)) => format!(
            "{{{}}}",
            l.values
                .iter()
                .map(|kv| format!(
                    "{}={}",
                    kv.key,
                    kv.value.as_ref().map(any_to_string).unwrap_or_default()
                ))
                .collect::<Vec<_>>()
                .join(",")
        ),
        #[allow(unreachable_patterns)]
        Some(_) => format!("{v:?}"),
    }
}
