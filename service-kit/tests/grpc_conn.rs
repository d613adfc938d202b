//! The gRPC port's edges (issue 42) on loopback, with a small `vlm.v1.Gateway` standing for any
//! service a [`GrpcServer`] serves (the LM's and vision's ports run the same code): a request
//! message over the service's decoding limit is RESOURCE_EXHAUSTED, not tonic's OUT_OF_RANGE;
//! connections over `--grpc-max-connections` are closed as they are accepted; and one that
//! sends nothing, or half its preface, is closed after `--grpc-handshake-timeout-ms`.
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use vlm_proto::v1::gateway_client::GatewayClient;
use vlm_proto::v1::gateway_server::{Gateway, GatewayServer};
use vlm_proto::v1::{GenerateRequest, GenerateResponse};
use vlm_service_kit::conn::GrpcConnOptions;
use vlm_service_kit::server::{self, GrpcServer};

const NAME: &str = "vlm.v1.Gateway";
/// The service's decoding limit in these tests.
const LIMIT: usize = 4096;

/// Refuses every request it decodes, so that a refusal from the service itself tells apart a
/// message that got past the transport.
#[derive(Clone)]
struct Refuse;

type Stream =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<GenerateResponse, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl Gateway for Refuse {
    type GenerateStream = Stream;

    async fn generate(
        &self,
        _request: tonic::Request<GenerateRequest>,
    ) -> Result<tonic::Response<Stream>, tonic::Status> {
        Err(tonic::Status::invalid_argument("decoded and refused"))
    }
}

/// A running server; dropping `stop` drains it.
struct Running {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<
        Result<server::Stopped<()>, server::ServeError<std::convert::Infallible>>,
    >,
}

impl Running {
    async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        self.task.await.unwrap().unwrap().served.unwrap();
    }
}

async fn start(configure: impl FnOnce(GrpcServer) -> GrpcServer) -> Running {
    let listener = server::bind_grpc("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let addr = listener.addr;
    let (stop, stopped) = oneshot::channel::<()>();
    let server = GrpcServer::on_listener(listener, NAME)
        .add_service(GatewayServer::new(Refuse).max_decoding_message_size(LIMIT));
    let task = tokio::spawn(configure(server).serve(
        async { Ok::<_, std::convert::Infallible>(()) },
        async {
            let _ = stopped.await;
        },
    ));
    Running {
        addr,
        stop: Some(stop),
        task,
    }
}

async fn client(addr: SocketAddr) -> GatewayClient<tonic::transport::Channel> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    GatewayClient::new(channel).max_encoding_message_size(usize::MAX)
}

fn request(bytes: usize) -> GenerateRequest {
    GenerateRequest {
        model: "m".repeat(bytes),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_over_the_decoding_limit_is_resource_exhausted() {
    let s = start(|s| s).await;
    let mut c = client(s.addr).await;
    let e = c.generate(request(2 * LIMIT)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("too large"), "{e:?}");
    // Under the limit: decoded, and refused by the service itself.
    let e = c.generate(request(LIMIT / 2)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert_eq!(e.message(), "decoded and refused");
    s.stop().await;
}

/// HTTP/2's client preface and an empty SETTINGS frame: a connection past its handshake.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00";

/// Far longer than any bound under test: a read still waiting after it means "open".
const PATIENCE: Duration = Duration::from_secs(10);

/// Reads until the server closes `s`: Some(how long it took), None when still open after
/// [`PATIENCE`]. Frames the server sends (its SETTINGS) are skipped.
async fn closed_within(s: &mut TcpStream) -> Option<Duration> {
    let t = Instant::now();
    let mut buf = [0u8; 1024];
    tokio::time::timeout(PATIENCE, async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return t.elapsed(),
                Ok(_) => {}
            }
        }
    })
    .await
    .ok()
}

/// A connection that did its part of the handshake and got the server's SETTINGS back (the
/// server holds it).
async fn held(addr: SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(PREFACE).await.unwrap();
    let mut head = [0u8; 9];
    tokio::time::timeout(PATIENCE, s.read_exact(&mut head))
        .await
        .expect("the server's SETTINGS")
        .unwrap();
    assert_eq!(head[3], 0x4, "a SETTINGS frame first");
    s
}

/// A health check over a fresh channel: the port still serves.
async fn serves(addr: SocketAddr) -> bool {
    let Ok(channel) = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(2))
        .connect()
        .await
    else {
        return false;
    };
    tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest::default())
        .await
        .is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_over_the_cap_are_closed_at_accept() {
    let conn = GrpcConnOptions {
        max_connections: 3,
        handshake_timeout: Duration::from_secs(60),
        ..Default::default()
    };
    let s = start(|s| s.conn(conn)).await;
    let mut open = Vec::new();
    for _ in 0..3 {
        open.push(held(s.addr).await);
    }
    // The fourth (TCP-connected by the kernel) is closed as it is accepted, long before the
    // handshake timeout.
    let mut over = TcpStream::connect(s.addr).await.unwrap();
    let took = closed_within(&mut over)
        .await
        .expect("over the cap: closed");
    assert!(took < Duration::from_secs(5), "{took:?}");
    assert!(!serves(s.addr).await, "a caller over the cap is not served");
    // One closes: its place is free again.
    drop(open.pop());
    let t = Instant::now();
    while !serves(s.addr).await {
        assert!(t.elapsed() < PATIENCE, "not served again under the cap");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(open);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_without_its_preface_is_closed_after_the_handshake_timeout() {
    let timeout = Duration::from_millis(300);
    let conn = GrpcConnOptions {
        handshake_timeout: timeout,
        ..Default::default()
    };
    let s = start(|s| s.conn(conn)).await;
    let connected = Instant::now();
    let mut silent = TcpStream::connect(s.addr).await.unwrap();
    let mut half = TcpStream::connect(s.addr).await.unwrap();
    half.write_all(&PREFACE[..10]).await.unwrap();
    // A caller that does its handshake stays, however long it idles past the timeout.
    let mut good = held(s.addr).await;
    for (what, c) in [("silent", &mut silent), ("half a preface", &mut half)] {
        closed_within(c)
            .await
            .unwrap_or_else(|| panic!("{what}: still open"));
        let took = connected.elapsed();
        eprintln!("{what}: closed {took:?} after its connect");
        assert!(
            took >= timeout,
            "{what}: closed before the timeout, {took:?}"
        );
    }
    let mut buf = [0u8; 64];
    let still = tokio::time::timeout(Duration::from_secs(1), good.read(&mut buf)).await;
    assert!(
        !matches!(still, Ok(Ok(0)) | Ok(Err(_))),
        "a connection past its handshake was closed: {still:?}"
    );
    assert!(serves(s.addr).await);
    // The drain waits for open connections: this one would stay until its pings timed out.
    drop(good);
    s.stop().await;
}
