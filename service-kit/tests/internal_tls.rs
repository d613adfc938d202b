//! Mutual TLS on a served port (`GrpcServer::tls`, `internal_tls::connect`), on loopback:
//! a caller with a certificate the CA signed is served; a plain-text caller, one without a
//! certificate and one whose certificate another CA signed are refused at the handshake; a
//! server whose certificate does not carry the name dialled is refused by the client; and new
//! files (another CA) apply to the next handshake without a restart, while a broken change
//! keeps the last good set.
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::oneshot;
use tonic::transport::{Channel, Endpoint};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};
use vlm_service_kit::internal_tls::connect::{dial, TlsConnector};
use vlm_service_kit::internal_tls::dev_certs::{loopback_names, write_dev_certs, DevCa};
use vlm_service_kit::internal_tls::{InternalTls, TlsFiles};
use vlm_service_kit::server::{self, GrpcServer};

fn endpoint(addr: SocketAddr) -> Endpoint {
    Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
}

/// A health check over a channel made with `tls` (None: plain text), naming the server
/// `name`.
async fn check(
    addr: SocketAddr,
    tls: Option<&Arc<InternalTls>>,
    name: &str,
) -> Result<ServingStatus, String> {
    let tls = tls.map(|t| TlsConnector::new(t.clone(), name).unwrap());
    let ch: Channel = dial(endpoint(addr), tls)
        .await
        .map_err(|e| format!("connect: {e:?}"))?;
    let r = HealthClient::new(ch)
        .check(HealthCheckRequest::default())
        .await
        .map_err(|e| format!("call: {e:?}"))?;
    Ok(ServingStatus::try_from(r.get_ref().status).unwrap())
}

/// A CA of its own and a certificate for loopback under `dir`.
fn own_ca(dir: &Path) -> Arc<InternalTls> {
    InternalTls::load(write_dev_certs(dir, &loopback_names()).unwrap()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_callers_the_ca_signed_get_past_the_handshake_and_files_reload() {
    let dir = tempfile::tempdir().unwrap();
    let files = write_dev_certs(&dir.path().join("ours"), &loopback_names()).unwrap();
    let server_tls = InternalTls::load(files.clone()).unwrap();
    let client_tls = InternalTls::load(files.clone()).unwrap();
    let rogue = own_ca(&dir.path().join("rogue"));

    let listeners = server::bind(
        "127.0.0.1:0".parse().unwrap(),
        "127.0.0.1:0".parse().unwrap(),
    )
    .await
    .unwrap();
    let addr = listeners.grpc_addr;
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(
        GrpcServer::new(listeners, "vlm.v1.Test")
            .tls(Some(server_tls.clone()))
            .serve(async { Ok::<_, std::io::Error>(()) }, async {
                let _ = stopped.await;
            }),
    );

    // Signed by the CA: served, by name and by address.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while check(addr, Some(&client_tls), "localhost").await != Ok(ServingStatus::Serving) {
        assert!(
            std::time::Instant::now() < deadline,
            "never SERVING over TLS"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        check(addr, Some(&client_tls), "127.0.0.1").await,
        Ok(ServingStatus::Serving)
    );
    // Plain text, or a certificate another CA signed: no call gets through.
    assert!(check(addr, None, "localhost").await.is_err());
    assert!(check(addr, Some(&rogue), "localhost").await.is_err());
    // A name the server's certificate does not carry: the client refuses it.
    let e = check(addr, Some(&client_tls), "vision.elsewhere")
        .await
        .unwrap_err();
    assert!(e.to_string().contains("connect"), "{e}");
    // No client certificate at all (a TLS client trusting the CA): refused by the server.
    let ca_only = {
        let mut roots = rustls::RootCertStore::empty();
        let pem = std::fs::read(&files.ca).unwrap();
        use rustls::pki_types::pem::PemObject;
        for c in rustls::pki_types::CertificateDer::pem_slice_iter(&pem) {
            roots.add(c.unwrap()).unwrap();
        }
        let mut cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
        cfg.alpn_protocols = vec![b"h2".to_vec()];
        Arc::new(cfg)
    };
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let refused = match tokio_rustls::TlsConnector::from(ca_only)
        .connect(name, tcp)
        .await
    {
        Err(_) => true,
        // TLS 1.3: the server's refusal arrives after the client's handshake; reading shows it.
        Ok(mut s) => {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let _ = s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await;
            let mut buf = [0u8; 64];
            !matches!(s.read(&mut buf).await, Ok(n) if n > 0)
        }
    };
    assert!(refused, "a caller without a certificate got through");

    // Rotation to another CA: the server reads its new files on the next handshake; callers
    // of the old CA are refused, callers of the new one served.
    let next = write_dev_certs(&dir.path().join("next"), &loopback_names()).unwrap();
    for (from, to) in [
        (&next.cert, &files.cert),
        (&next.key, &files.key),
        (&next.ca, &files.ca),
    ] {
        std::fs::copy(from, to).unwrap();
    }
    server_tls.expire_check();
    let next_client = InternalTls::load(next.clone()).unwrap();
    assert_eq!(
        check(addr, Some(&next_client), "localhost").await,
        Ok(ServingStatus::Serving)
    );
    assert!(check(addr, Some(&rogue), "localhost").await.is_err());

    // A broken change (a key that is not the certificate's) keeps the last good set.
    let other = DevCa::new("other")
        .unwrap()
        .issue(&loopback_names())
        .unwrap();
    std::fs::write(&files.key, other.key_pem).unwrap();
    server_tls.expire_check();
    assert_eq!(
        check(addr, Some(&next_client), "localhost").await,
        Ok(ServingStatus::Serving)
    );

    let _ = stop.send(());
    let stopped = task.await.unwrap().unwrap();
    assert!(stopped.served.is_ok());
}

#[test]
fn bad_files_are_refused_at_start_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let files = write_dev_certs(dir.path(), &loopback_names()).unwrap();
    let missing = TlsFiles {
        ca: dir.path().join("absent.crt"),
        ..files.clone()
    };
    let e = InternalTls::load(missing).unwrap_err().to_string();
    assert!(e.contains("CA file") && e.contains("absent.crt"), "{e}");
    let swapped = TlsFiles {
        cert: files.key.clone(),
        ..files.clone()
    };
    let e = InternalTls::load(swapped).unwrap_err().to_string();
    assert!(
        e.contains("certificate file") && e.contains("tls.key"),
        "{e}"
    );
    let other = DevCa::new("other")
        .unwrap()
        .issue(&loopback_names())
        .unwrap();
    std::fs::write(&files.key, other.key_pem).unwrap();
    let e = InternalTls::load(files).unwrap_err().to_string();
    assert!(e.contains("with key"), "{e}");
}
