//! One service child process of `vlm up`: started with the arguments `vlm up` chose, its
//! `listening grpc=ADDR` line awaited, and stopped with a graceful drain.
use anyhow::{bail, Context};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A started child and the address it reported.
pub struct Service {
    pub name: &'static str,
    pub child: Child,
    pub grpc: String,
    /// The gateway's HTTP address (empty for the others).
    pub http: String,
}

/// Starts `bin` with `args`, waits for its `listening grpc=ADDR ...` line (its other output is
/// forwarded to stderr with a prefix), and returns it.
pub fn spawn_service(
    name: &'static str,
    bin: &Path,
    args: &[String],
    timeout: Duration,
) -> anyhow::Result<Service> {
    let mut cmd = Command::new(bin);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    // A child outlives no `vlm up`, even one killed with SIGKILL: the kernel sends it SIGTERM
    // (its drain) when the thread that started it exits. `vlm up` starts every child on its
    // main thread (the runtime's `block_on`), which lives as long as the process.
    #[cfg(target_os = "linux")]
    unsafe {
        use std::os::unix::process::CommandExt;
        // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let stdout = child.stdout.take().context("child stdout")?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(rest) = line.strip_prefix("listening ") {
                if let Some(t) = tx.take() {
                    let _ = t.send(rest.to_string());
                    continue;
                }
            }
            eprintln!("[{name}] {line}");
        }
    });
    let deadline = Instant::now() + timeout;
    loop {
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(fields) => {
                let field = |k: &str| {
                    fields
                        .split_whitespace()
                        .find_map(|f| f.strip_prefix(k).and_then(|v| v.strip_prefix('=')))
                        .unwrap_or("")
                        .to_string()
                };
                let grpc = field("grpc");
                if grpc.is_empty() {
                    let _ = child.kill();
                    bail!("{name} printed `listening {fields}` without grpc=ADDR");
                }
                return Ok(Service {
                    name,
                    child,
                    grpc,
                    http: field("http"),
                });
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                if let Some(status) = child.try_wait()? {
                    bail!("{name} exited with {status} before it was listening");
                }
                if Instant::now() > deadline {
                    let _ = child.kill();
                    bail!("{name} did not report its address within {timeout:?}");
                }
            }
            Err(_) => {
                let status = child.wait()?;
                bail!("{name} exited with {status} before it was listening");
            }
        }
    }
}

/// Waits for every service to answer SERVING, in order; fails as soon as any of them exits
/// (a service killed while loading, e.g. by the kernel's OOM killer, is reported at once, not
/// after the whole timeout).
/// Sends SIGTERM (graceful drain), waits up to `grace`, then kills.
pub fn stop_child(child: &mut Child, grace: Duration) {
    if matches!(child.try_wait(), Ok(Some(_))) {
        return;
    }
    #[cfg(unix)]
    unsafe {
        // SAFETY: plain syscall on a pid we spawned and have not reaped.
        libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
    }
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        if matches!(child.try_wait(), Ok(Some(_))) {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
}
