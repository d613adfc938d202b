//! The shared gRPC life (`vlm_service_kit::server`) on loopback, with a small `vlm.v1.Gateway`
//! whose one stream stays open until the test releases it: health NOT_SERVING while loading and
//! SERVING after, reflection listing only what is served, the drain order (NOT_SERVING, delay,
//! on_drain while still accepting, stop accepting, in-flight calls finish, /metrics stops), a
//! failed load, a shutdown during loading, readiness following, and bind errors.
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{oneshot, watch};
use tonic::transport::Channel;
use tonic_health::pb::health_check_response::ServingStatus;
use vlm_proto::v1::gateway_server::{Gateway, GatewayServer};
use vlm_proto::v1::{GenerateRequest, GenerateResponse};
use vlm_service_kit::server::{self, GrpcServer, ServeError};

const NAME: &str = "vlm.v1.Gateway";

/// One message at once, the last when `release` turns true.
#[derive(Clone)]
struct Held {
    release: watch::Receiver<bool>,
}

type Stream = Pin<Box<dyn futures::Stream<Item = Result<GenerateResponse, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl Gateway for Held {
    type GenerateStream = Stream;

    async fn generate(
        &self,
        _request: tonic::Request<GenerateRequest>,
    ) -> Result<tonic::Response<Stream>, tonic::Status> {
        use futures::StreamExt;
        let mut release = self.release.clone();
        let message = |text: &str| GenerateResponse {
            text: text.into(),
            ..Default::default()
        };
        let first = message("first");
        let last = message("last");
        let s =
            futures::stream::once(async { Ok(first) }).chain(futures::stream::once(async move {
                let _ = release.wait_for(|r| *r).await;
                Ok(last)
            }));
        Ok(tonic::Response::new(Box::pin(s)))
    }
}

fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

async fn channel(addr: SocketAddr) -> Result<Channel, tonic::transport::Error> {
    tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
}

async fn health(addr: SocketAddr, service: &str) -> Option<ServingStatus> {
    let mut h = tonic_health::pb::health_client::HealthClient::new(channel(addr).await.ok()?);
    let r = h
        .check(tonic_health::pb::HealthCheckRequest {
            service: service.into(),
        })
        .await
        .ok()?;
    ServingStatus::try_from(r.get_ref().status).ok()
}

/// Polls until `service` reports `want`; panics after 10 s.
async fn wait_health(addr: SocketAddr, service: &str, want: ServingStatus) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while health(addr, service).await != Some(want) {
        assert!(Instant::now() < deadline, "{service} never {want:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// `ListServices` through reflection version `$v` (`v1` or `v1alpha`), sorted.
macro_rules! list_services {
    ($v:ident, $addr:expr) => {{
        use tonic_reflection::pb::$v::{
            server_reflection_client::ServerReflectionClient, server_reflection_request,
            server_reflection_response, ServerReflectionRequest,
        };
        let mut client = ServerReflectionClient::new(channel($addr).await.unwrap());
        let req = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(server_reflection_request::MessageRequest::ListServices(
                String::new(),
            )),
        };
        let mut stream = client
            .server_reflection_info(futures::stream::iter(vec![req]))
            .await
            .unwrap()
            .into_inner();
        let reply = stream.message().await.unwrap().unwrap();
        let Some(server_reflection_response::MessageResponse::ListServicesResponse(list)) =
            reply.message_response
        else {
            panic!("not a service list: {reply:?}");
        };
        let mut names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
        names.sort();
        names
    }};
}

/// The services reflection lists, sorted; the same through v1alpha.
async fn listed(addr: SocketAddr) -> Vec<String> {
    let v1 = listed_v1(addr).await;
    assert_eq!(
        listed_v1alpha(addr).await,
        v1,
        "v1alpha lists what v1 lists"
    );
    v1
}

async fn listed_v1alpha(addr: SocketAddr) -> Vec<String> {
    list_services!(v1alpha, addr)
}

async fn listed_v1(addr: SocketAddr) -> Vec<String> {
    list_services!(v1, addr)
}

/// `GET /metrics` over plain HTTP/1.1; None when the port refuses.
async fn metrics(addr: SocketAddr) -> Option<String> {
    http_get(addr, "/metrics").await
}

/// The whole HTTP/1.1 response to `GET path` from the metrics server at `addr`.
async fn http_get(addr: SocketAddr, path: &str) -> Option<String> {
    let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
    let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).await.ok()?;
    Some(out)
}

/// The status line of `GET path`, e.g. "HTTP/1.1 503 Service Unavailable".
async fn http_status(addr: SocketAddr, path: &str) -> String {
    let r = http_get(addr, path).await.unwrap_or_default();
    r.lines().next().unwrap_or("").to_string()
}

fn signal() -> (oneshot::Sender<()>, impl Future<Output = ()>) {
    let (tx, rx) = oneshot::channel::<()>();
    (tx, async move {
        let _ = rx.await;
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loads_serves_and_drains_in_order() {
    let listeners = server::bind(loopback(), loopback()).await.unwrap();
    let (grpc, metrics_addr) = (listeners.grpc_addr, listeners.metrics_addr);
    let (release_tx, release) = watch::channel(false);
    let (loaded_tx, loaded) = signal();
    let (shutdown_tx, shutdown) = signal();
    // on_drain checks what a client sees while it runs: NOT_SERVING, and still accepting.
    let (drained_tx, drained) = oneshot::channel::<Option<ServingStatus>>();
    let server = GrpcServer::new(listeners, NAME)
        .add_service(GatewayServer::new(Held { release }))
        .drain_delay(Duration::from_millis(300))
        .on_drain(async move {
            let _ = drained_tx.send(health(grpc, NAME).await);
        });
    let task = tokio::spawn(server.serve(
        async move {
            loaded.await;
            Ok::<_, std::io::Error>(42)
        },
        shutdown,
    ));

    // Loading: health answers NOT_SERVING, overall and by name; reflection lists only what
    // this server serves.
    wait_health(grpc, "", ServingStatus::NotServing).await;
    assert_eq!(health(grpc, NAME).await, Some(ServingStatus::NotServing));
    assert_eq!(
        listed(grpc).await,
        [
            "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection",
            "vlm.v1.Gateway"
        ]
    );
    assert!(metrics(metrics_addr)
        .await
        .unwrap()
        .starts_with("HTTP/1.1 200"));
    // The HTTP probes (for a kubelet when the gRPC port needs mutual TLS) say the same.
    assert_eq!(http_status(metrics_addr, "/livez").await, "HTTP/1.1 200 OK");
    assert!(http_status(metrics_addr, "/readyz").await.contains(" 503 "));

    // Loaded: SERVING.
    loaded_tx.send(()).unwrap();
    wait_health(grpc, "", ServingStatus::Serving).await;
    assert_eq!(health(grpc, NAME).await, Some(ServingStatus::Serving));
    assert_eq!(
        http_status(metrics_addr, "/readyz").await,
        "HTTP/1.1 200 OK"
    );

    // An in-flight call, then shutdown.
    let mut client =
        vlm_proto::v1::gateway_client::GatewayClient::new(channel(grpc).await.unwrap());
    let mut stream = client
        .generate(GenerateRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stream.message().await.unwrap().unwrap().text, "first");
    shutdown_tx.send(()).unwrap();
    // NOT_SERVING first, while the drain delay keeps the port open...
    wait_health(grpc, NAME, ServingStatus::NotServing).await;
    assert!(http_status(metrics_addr, "/readyz").await.contains(" 503 "));
    // ...on_drain saw the same and could still connect...
    assert_eq!(drained.await.unwrap(), Some(ServingStatus::NotServing));
    // ...then no new connections, but the in-flight call finishes.
    let deadline = Instant::now() + Duration::from_secs(10);
    while channel(grpc).await.is_ok() {
        assert!(Instant::now() < deadline, "still accepting after on_drain");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(!task.is_finished(), "returned with a call in flight");
    release_tx.send(true).unwrap();
    assert_eq!(stream.message().await.unwrap().unwrap().text, "last");
    assert!(stream.message().await.unwrap().is_none());

    let stopped = task.await.unwrap().unwrap();
    assert_eq!(stopped.loaded, 42);
    assert!(stopped.served.is_ok());
    // /metrics stops last.
    let deadline = Instant::now() + Duration::from_secs(10);
    while metrics(metrics_addr).await.is_some() {
        assert!(Instant::now() < deadline, "/metrics still served");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_load_stops_the_server_and_returns_the_error() {
    let listeners = server::bind(loopback(), loopback()).await.unwrap();
    let grpc = listeners.grpc_addr;
    let (fail_tx, fail) = signal();
    let (_release_tx, release) = watch::channel(false);
    let (ran_tx, ran) = oneshot::channel::<()>();
    let task = tokio::spawn(
        GrpcServer::new(listeners, NAME)
            .add_service(GatewayServer::new(Held { release }))
            .on_drain(async move {
                let _ = ran_tx.send(());
            })
            .serve(
                async move {
                    fail.await;
                    Err::<(), _>(std::io::Error::other("no weights"))
                },
                std::future::pending(),
            ),
    );
    wait_health(grpc, NAME, ServingStatus::NotServing).await;
    fail_tx.send(()).unwrap();
    match task.await.unwrap() {
        Err(ServeError::Load(e)) => assert_eq!(e.to_string(), "no weights"),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("served after a failed load"),
    }
    ran.await.expect("on_drain runs when loading fails");
    assert!(channel(grpc).await.is_err(), "still accepting");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_while_loading_drains_then_hands_back_what_loaded() {
    let listeners = server::bind(loopback(), loopback()).await.unwrap();
    let grpc = listeners.grpc_addr;
    let (loaded_tx, loaded) = signal();
    let (shutdown_tx, shutdown) = signal();
    let (_release_tx, release) = watch::channel(false);
    let task = tokio::spawn(
        GrpcServer::new(listeners, NAME)
            .add_service(GatewayServer::new(Held { release }))
            .serve(
                async move {
                    loaded.await;
                    Ok::<_, std::io::Error>("engine")
                },
                shutdown,
            ),
    );
    wait_health(grpc, "", ServingStatus::NotServing).await;
    shutdown_tx.send(()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while channel(grpc).await.is_ok() {
        assert!(Instant::now() < deadline, "still accepting after shutdown");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(!task.is_finished(), "returned before loading ended");
    loaded_tx.send(()).unwrap();
    let stopped = task.await.unwrap().unwrap();
    assert_eq!(stopped.loaded, "engine");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_follows_readiness_once_loaded() {
    let grpc_listener = server::bind_grpc(loopback()).await.unwrap();
    let grpc = grpc_listener.addr;
    let (ready_tx, ready) = watch::channel(false);
    let (shutdown_tx, shutdown) = signal();
    let (_release_tx, release) = watch::channel(false);
    let task = tokio::spawn(
        GrpcServer::on_listener(grpc_listener, NAME)
            .add_service(GatewayServer::new(Held { release }))
            .health_follows(ready)
            .serve(async { Ok::<_, std::convert::Infallible>(()) }, shutdown),
    );
    wait_health(grpc, NAME, ServingStatus::NotServing).await;
    ready_tx.send(true).unwrap();
    wait_health(grpc, NAME, ServingStatus::Serving).await;
    ready_tx.send(false).unwrap();
    wait_health(grpc, "", ServingStatus::NotServing).await;
    ready_tx.send(true).unwrap();
    wait_health(grpc, "", ServingStatus::Serving).await;
    shutdown_tx.send(()).unwrap();
    let stopped = task.await.unwrap().unwrap();
    assert!(stopped.served.is_ok());
}

#[tokio::test]
async fn bind_errors_name_the_listener_and_the_address() {
    let taken = tokio::net::TcpListener::bind(loopback()).await.unwrap();
    let addr = taken.local_addr().unwrap();
    let e = server::bind(addr, loopback())
        .await
        .err()
        .expect("port taken");
    assert_eq!((e.what, e.addr), ("gRPC", addr));
    assert!(e.to_string().contains(&format!("gRPC on {addr}")), "{e}");
    let e = server::bind(loopback(), addr)
        .await
        .err()
        .expect("port taken");
    assert_eq!((e.what, e.addr), ("metrics", addr));
    assert!(e.to_string().contains(&format!("metrics on {addr}")), "{e}");
}

/// One HTTP/2 frame read from `s`: (type, flags, payload).
async fn read_frame(s: &mut tokio::net::TcpStream) -> std::io::Result<(u8, u8, Vec<u8>)> {
    let mut head = [0u8; 9];
    s.read_exact(&mut head).await?;
    let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
    let mut payload = vec![0u8; len];
    s.read_exact(&mut payload).await?;
    Ok((head[3], head[4], payload))
}

/// The gRPC port bounds each connection: its SETTINGS cap the calls open at once, and a peer
/// that stops answering pings (gone without a FIN) is dropped. A raw HTTP/2 client that does
/// the handshake, then never answers, sees the cap, a PING, and the connection closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_stops_answering_pings_is_dropped() {
    const SETTINGS: u8 = 0x4;
    const PING: u8 = 0x6;
    const MAX_CONCURRENT_STREAMS: u16 = 0x3;
    let grpc_listener = server::bind_grpc(loopback()).await.unwrap();
    let grpc = grpc_listener.addr;
    let (shutdown_tx, shutdown) = signal();
    let (_release_tx, release) = watch::channel(false);
    let task = tokio::spawn(
        GrpcServer::on_listener(grpc_listener, NAME)
            .add_service(GatewayServer::new(Held { release }))
            .http2_keepalive(Duration::from_millis(200), Duration::from_millis(300))
            .serve(async { Ok::<_, std::convert::Infallible>(()) }, shutdown),
    );
    let mut s = tokio::net::TcpStream::connect(grpc).await.unwrap();
    s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        .await
        .unwrap();
    let patience = Duration::from_secs(20);
    let (mut max_streams, mut pinged) = (None, false);
    let closed = tokio::time::timeout(patience, async {
        loop {
            let (kind, flags, payload) = match read_frame(&mut s).await {
                Ok(f) => f,
                Err(_) => return,
            };
            if kind == SETTINGS && flags & 1 == 0 {
                for p in payload.chunks_exact(6) {
                    if u16::from_be_bytes([p[0], p[1]]) == MAX_CONCURRENT_STREAMS {
                        max_streams = Some(u32::from_be_bytes([p[2], p[3], p[4], p[5]]));
                    }
                }
                // Acknowledge the server's settings: the handshake is done.
                s.write_all(b"\x00\x00\x00\x04\x01\x00\x00\x00\x00")
                    .await
                    .unwrap();
            }
            // Never answered.
            pinged |= kind == PING && flags & 1 == 0;
        }
    })
    .await;
    assert!(
        closed.is_ok(),
        "the connection was still open after {patience:?}"
    );
    assert!(pinged, "no PING before the close");
    assert_eq!(max_streams, Some(server::MAX_CONCURRENT_STREAMS));
    shutdown_tx.send(()).unwrap();
    task.await.unwrap().unwrap().served.unwrap();
}
