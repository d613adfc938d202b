//! The services as child processes: started, waited for, stopped, frozen; a whole cluster.
use super::binaries::*;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Starts one service alone (`vision-service` or `lm-service` at `bin`) on `model` with
/// `config`, and waits until it reports SERVING.
pub async fn start_service(name: &str, bin: &Path, model: &Path, config: &Path) -> Proc {
    let args: Vec<String> = [
        "--model",
        &model.display().to_string(),
        "--config",
        &config.display().to_string(),
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let p = Proc::spawn_env(name, bin, &args, &[]);
    wait_serving(&p.addr("grpc")).await;
    p
}

/// Variables the children never inherit from the test's environment (a developer's shell may
/// point them at a real collector); pass them in `env` to set them.
const SCRUBBED_ENV: &[&str] = &[
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_SERVICE_NAME",
    "OTEL_TRACES_EXPORTER",
    "OTEL_RESOURCE_ATTRIBUTES",
];

/// A child process, killed when dropped.
pub struct Proc {
    pub name: String,
    pub child: Child,
    /// Fields of its `listening k=v ...` line.
    pub addrs: Vec<(String, String)>,
}

impl Proc {
    pub fn spawn(name: &str, bin: &Path, args: &[String]) -> Proc {
        Self::spawn_env(name, bin, args, &[])
    }

    /// Starts `bin` with `env` added (`RUST_LOG` defaults to the test's own, else `warn`) and
    /// waits for its `listening ...` line. Its other stdout lines go to stderr, tagged.
    pub fn spawn_env(name: &str, bin: &Path, args: &[String], env: &[(String, String)]) -> Proc {
        let mut cmd = Command::new(bin);
        cmd.args(args)
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for k in SCRUBBED_ENV {
            cmd.env_remove(k);
        }
        cmd.envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", bin.display()));
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let tag = name.to_string();
        std::thread::spawn(move || {
            let mut tx = Some(tx);
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(rest) = line.strip_prefix("listening ") {
                    if let Some(t) = tx.take() {
                        let kv: Vec<(String, String)> = rest
                            .split_whitespace()
                            .filter_map(|f| {
                                f.split_once('=')
                                    .map(|(k, v)| (k.to_string(), v.to_string()))
                            })
                            .collect();
                        let _ = t.send(kv);
                        continue;
                    }
                }
                eprintln!("[{tag}] {line}");
            }
        });
        let addrs = match rx.recv_timeout(Duration::from_secs(120)) {
            Ok(a) => a,
            Err(e) => {
                // Exited early (stdout closed), or still silent after 120 s.
                let mut exited = child.try_wait().ok().flatten();
                let until = Instant::now() + Duration::from_secs(5);
                while exited.is_none()
                    && e == std::sync::mpsc::RecvTimeoutError::Disconnected
                    && Instant::now() < until
                {
                    std::thread::sleep(Duration::from_millis(50));
                    exited = child.try_wait().ok().flatten();
                }
                let _ = child.kill();
                let _ = child.wait();
                match exited {
                    Some(st) => panic!("{name} exited ({st}) before printing its listening line; its stderr is above"),
                    None => panic!("{name} did not print its listening line within 120 s"),
                }
            }
        };
        Proc {
            name: name.to_string(),
            child,
            addrs,
        }
    }

    pub fn addr(&self, key: &str) -> String {
        self.addrs
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
            .unwrap_or_else(|| panic!("{}: no {key}=", self.name))
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends SIGTERM (graceful drain; trace export is flushed on the way out).
    pub fn terminate(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            // SAFETY: kill(2) on our own child's pid; it has not been reaped (try_wait above).
            unsafe {
                libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
            }
        }
    }

    /// Waits up to `timeout` for the process to exit: its exit status, or None (still running).
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(st)) = self.child.try_wait() {
                return Some(st);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Polls `grpc.health.v1` (service "") until SERVING; panics after 180 s.
pub async fn wait_serving(addr: &str) {
    use tonic_health::pb::{
        health_check_response::ServingStatus, health_client::HealthClient, HealthCheckRequest,
    };
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        if let Ok(ch) = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
        {
            if let Ok(r) = HealthClient::new(ch)
                .check(HealthCheckRequest {
                    service: String::new(),
                })
                .await
            {
                if r.get_ref().status == ServingStatus::Serving as i32 {
                    return;
                }
            }
        }
        assert!(Instant::now() < deadline, "{addr} never became SERVING");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Polls the metrics server's `GET /readyz` until 200 (the probe a kubelet uses when the
/// gRPC port needs mutual TLS); panics after 180 s.
pub async fn wait_ready_http(metrics: &str) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        if let Ok(mut s) = tokio::net::TcpStream::connect(metrics).await {
            let _ = s
                .write_all(b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                .await;
            let mut out = String::new();
            let _ = s.read_to_string(&mut out).await;
            if out.starts_with("HTTP/1.1 200") {
                return;
            }
        }
        assert!(Instant::now() < deadline, "{metrics}/readyz never 200");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until `p` is ready: its gRPC health, or `/readyz` when its gRPC port needs mutual
/// TLS (`tls`).
async fn wait_ready(p: &Proc, tls: bool) {
    if tls {
        wait_ready_http(&p.addr("metrics")).await
    } else {
        wait_serving(&p.addr("grpc")).await
    }
}

/// `--model`, `--config`, `--listen 127.0.0.1:0` (and `--metrics-listen 127.0.0.1:0`).
pub fn service_args(listen_metrics: bool) -> Vec<String> {
    service_args_with(&config_file(), listen_metrics)
}

/// [`service_args`] with another config file.
pub fn service_args_with(config: &Path, listen_metrics: bool) -> Vec<String> {
    let mut a = vec![
        "--model".to_string(),
        tiny_model().display().to_string(),
        "--config".into(),
        config.display().to_string(),
        "--listen".into(),
        "127.0.0.1:0".into(),
    ];
    if listen_metrics {
        a.extend(["--metrics-listen".into(), "127.0.0.1:0".into()]);
    }
    a
}

/// `args` plus the LM's `--vision` naming `vision` (the only replica it may dial).
pub fn lm_args(args: &[String], vision: &Proc) -> Vec<String> {
    let mut a = args.to_vec();
    a.extend(["--vision".into(), vision.addr("grpc")]);
    a
}

pub struct Cluster {
    pub gateway: Proc,
    pub lms: Vec<Proc>,
    pub vision: Proc,
}

impl Cluster {
    pub async fn start(lms: usize, gateway_args: &[&str]) -> Cluster {
        Self::start_env(lms, gateway_args, &[]).await
    }

    /// Like [`Cluster::start`], with `env` set for all three kinds of process.
    pub async fn start_env(lms: usize, gateway_args: &[&str], env: &[(String, String)]) -> Cluster {
        Self::start_config(&config_file(), lms, gateway_args, env).await
    }

    /// Like [`Cluster::start_env`], every process reading `config` (see [`write_config`]).
    pub async fn start_config(
        config: &Path,
        lms: usize,
        gateway_args: &[&str],
        env: &[(String, String)],
    ) -> Cluster {
        let args = service_args_with(config, true);
        let vision = Proc::spawn_env("vision", &bin("vision-service"), &args, env);
        let lm_args = lm_args(&args, &vision);
        let lms: Vec<Proc> = (0..lms)
            .map(|i| Proc::spawn_env(&format!("lm{i}"), &bin("lm-service"), &lm_args, env))
            .collect();
        let tls = env.iter().any(|(k, _)| k == "VLM_INTERNAL_TLS_CERT");
        wait_ready(&vision, tls).await;
        for lm in &lms {
            wait_ready(lm, tls).await;
        }
        let gateway = Self::gateway_config(config, &vision, &lms, gateway_args, env).await;
        Cluster {
            gateway,
            lms,
            vision,
        }
    }

    /// One more gateway in front of the same replicas.
    pub async fn gateway(vision: &Proc, lms: &[Proc], extra: &[&str]) -> Proc {
        Self::gateway_env(vision, lms, extra, &[]).await
    }

    pub async fn gateway_env(
        vision: &Proc,
        lms: &[Proc],
        extra: &[&str],
        env: &[(String, String)],
    ) -> Proc {
        Self::gateway_config(&config_file(), vision, lms, extra, env).await
    }

    /// A gateway reading `config`, in front of `vision` and `lms`.
    pub async fn gateway_config(
        config: &Path,
        vision: &Proc,
        lms: &[Proc],
        extra: &[&str],
        env: &[(String, String)],
    ) -> Proc {
        let lms: Vec<String> = lms.iter().map(|l| l.addr("grpc")).collect();
        Self::gateway_at(config, &vision.addr("grpc"), &lms, extra, env).await
    }

    /// A gateway reading `config` that dials vision at `vision` and the LMs at `lms` (a relay
    /// in front of a replica, say).
    pub async fn gateway_at(
        config: &Path,
        vision: &str,
        lms: &[String],
        extra: &[&str],
        env: &[(String, String)],
    ) -> Proc {
        let mut args = service_args_with(config, false);
        args.extend([
            "--http-listen".into(),
            "127.0.0.1:0".into(),
            "--vision".into(),
            vision.to_string(),
            "--lm".into(),
            lms.join(","),
        ]);
        args.extend(extra.iter().map(|s| s.to_string()));
        let g = Proc::spawn_env("gateway", &bin("gateway"), &args, env);
        wait_serving(&g.addr("grpc")).await;
        g
    }

    pub fn grpc(&self) -> String {
        self.gateway.addr("grpc")
    }

    pub fn http(&self) -> String {
        self.gateway.addr("http")
    }

    /// SIGTERM to every process (gateway first), then waits up to `timeout` for each to exit.
    /// Returns the names of those that did not exit in time (they are killed on drop).
    pub fn terminate_all(&mut self, timeout: Duration) -> Vec<String> {
        self.gateway.terminate();
        for lm in &mut self.lms {
            lm.terminate();
        }
        self.vision.terminate();
        let deadline = Instant::now() + timeout;
        let mut stuck = Vec::new();
        for p in std::iter::once(&mut self.gateway)
            .chain(self.lms.iter_mut())
            .chain(std::iter::once(&mut self.vision))
        {
            let left = deadline.saturating_duration_since(Instant::now());
            match p.wait_exit(left) {
                Some(st) if !st.success() => eprintln!("{} exited with {st} after SIGTERM", p.name),
                Some(_) => {}
                None => stuck.push(p.name.clone()),
            }
        }
        stuck
    }
}

// ---------------------------------------------------------------- requests

/// A process stopped (SIGSTOP) until this is dropped (SIGCONT).
pub struct Frozen(libc::pid_t);

impl Frozen {
    pub fn new(pid: u32) -> Frozen {
        // SAFETY: kill(2) on a child process of this test.
        assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGSTOP) }, 0);
        Frozen(pid as libc::pid_t)
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        // SAFETY: as in `new`.
        unsafe { libc::kill(self.0, libc::SIGCONT) };
    }
}
