//! A TCP relay in front of a service: a link the test can slow or silently cut.
//! - `delay`: each chunk is held this long before it is passed on, each way (this kernel has no
//!   `tc netem`).
//! - `cut_open_connections`: the connections open now stop passing bytes but stay open, as
//!   through a middlebox that dropped the flow or after a peer's stall; the client learns only
//!   from its own keepalive. Connections made after pass again.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[derive(Clone)]
pub struct Relay {
    /// Where it listens.
    pub addr: String,
    delay_ms: Arc<AtomicU64>,
    /// Bumped by each cut; a connection passes bytes while it equals the value at its accept.
    generation: Arc<AtomicU64>,
}

impl Relay {
    /// Listens on `listen` (port 0 for any) and dials `upstream` for each connection; its
    /// tasks run on `rt`.
    pub fn start(rt: &tokio::runtime::Handle, listen: &str, upstream: String) -> Relay {
        let listener = std::net::TcpListener::bind(listen).expect("the relay's listener");
        listener.set_nonblocking(true).unwrap();
        let relay = Relay {
            addr: listener.local_addr().unwrap().to_string(),
            delay_ms: Arc::new(AtomicU64::new(0)),
            generation: Arc::new(AtomicU64::new(0)),
        };
        let r = relay.clone();
        rt.spawn(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            while let Ok((down, _)) = listener.accept().await {
                let Ok(up) = tokio::net::TcpStream::connect(&upstream).await else {
                    continue;
                };
                let born = r.generation.load(Ordering::SeqCst);
                let (dr, dw) = down.into_split();
                let (ur, uw) = up.into_split();
                tokio::spawn(r.clone().pipe(dr, uw, born));
                tokio::spawn(r.clone().pipe(ur, dw, born));
            }
        });
        relay
    }

    pub fn set_delay(&self, d: Duration) {
        self.delay_ms.store(d.as_millis() as u64, Ordering::Relaxed);
    }

    pub fn cut_open_connections(&self) {
        self.generation.fetch_add(1, Ordering::SeqCst);
    }

    async fn pipe(
        self,
        mut r: tokio::net::tcp::OwnedReadHalf,
        mut w: tokio::net::tcp::OwnedWriteHalf,
        born: u64,
    ) {
        let (tx, mut rx) =
            tokio::sync::mpsc::unbounded_channel::<(tokio::time::Instant, Vec<u8>)>();
        let writer = tokio::spawn(async move {
            while let Some((due, buf)) = rx.recv().await {
                tokio::time::sleep_until(due).await;
                if w.write_all(&buf).await.is_err() {
                    break;
                }
            }
            let _ = w.shutdown().await;
        });
        let mut buf = vec![0u8; 64 * 1024];
        while let Ok(n @ 1..) = r.read(&mut buf).await {
            if self.generation.load(Ordering::SeqCst) != born {
                // Cut: swallow what comes, keep both sockets open, pass nothing.
                continue;
            }
            let due = tokio::time::Instant::now()
                + Duration::from_millis(self.delay_ms.load(Ordering::Relaxed));
            if tx.send((due, buf[..n].to_vec())).is_err() {
                break;
            }
        }
        drop(tx);
        let _ = writer.await;
    }
}
