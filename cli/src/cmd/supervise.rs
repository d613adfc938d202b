//! `vlm up`'s supervision: a child that dies is restarted on the addresses it had, with
//! backoff, while the others keep serving (as a kubelet restarts a container of a pod).
use super::child::{spawn_service, Service};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The first restart waits this long; each failure in a row doubles it up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// A child that served this long before dying starts again from [`FIRST_BACKOFF`].
const STABLE_AFTER: Duration = Duration::from_secs(60);

/// One child under supervision.
pub struct Supervised {
    pub service: Service,
    bin: PathBuf,
    /// Its arguments with every `0` port replaced by the port it bound, so that a restart
    /// comes back where the others (and clients) expect it.
    args: Vec<String>,
    started: Instant,
    /// Deaths in a row without [`STABLE_AFTER`] of service in between.
    failures: u32,
    /// When the next start is due, while it is down.
    restart_at: Option<Instant>,
    pub restarts: u32,
}

impl Supervised {
    pub fn new(service: Service, bin: PathBuf, args: &[String]) -> Self {
        let args = pin_ports(args, &service);
        Supervised {
            service,
            bin,
            args,
            started: Instant::now(),
            failures: 0,
            restart_at: None,
            restarts: 0,
        }
    }

    /// Notices a death and restarts when due; returns what happened, for the log.
    pub fn tick(&mut self, timeout: Duration) -> Option<String> {
        let name = self.service.name;
        let now = Instant::now();
        if self.restart_at.is_none() {
            let status = match self.service.child.try_wait() {
                Ok(Some(status)) => status,
                _ => return None,
            };
            if now.duration_since(self.started) >= STABLE_AFTER {
                self.failures = 0;
            }
            let wait = backoff(self.failures);
            self.failures += 1;
            self.restart_at = Some(now + wait);
            return Some(format!(
                "{name} exited ({status}); restarting it in {wait:?}, the others keep serving"
            ));
        }
        if self.restart_at.is_some_and(|t| now < t) {
            return None;
        }
        match spawn_service(name, &self.bin, &self.args, timeout) {
            Ok(service) => {
                self.service = service;
                self.started = Instant::now();
                self.restart_at = None;
                self.restarts += 1;
                Some(format!(
                    "restarted {name} grpc={} pid={} (restart {})",
                    self.service.grpc,
                    self.service.child.id(),
                    self.restarts
                ))
            }
            Err(e) => {
                let wait = backoff(self.failures);
                self.failures += 1;
                self.restart_at = Some(Instant::now() + wait);
                Some(format!(
                    "restarting {name} failed: {e:#}; next try in {wait:?}"
                ))
            }
        }
    }
}

/// 1 s, 2 s, 4 s, ... up to 30 s.
fn backoff(failures: u32) -> Duration {
    FIRST_BACKOFF
        .saturating_mul(1u32 << failures.min(5))
        .min(MAX_BACKOFF)
}

/// `args` with the values of `--listen` and `--http-listen` set to the addresses `service`
/// reported (port 0 becomes the port it bound).
fn pin_ports(args: &[String], service: &Service) -> Vec<String> {
    let mut out = args.to_vec();
    for (flag, addr) in [
        ("--listen", &service.grpc),
        ("--http-listen", &service.http),
    ] {
        if addr.is_empty() {
            continue;
        }
        if let Some(i) = out.iter().position(|a| a == flag) {
            if let Some(v) = out.get_mut(i + 1) {
                *v = addr.clone();
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_a_cap() {
        let secs: Vec<u64> = (0..8).map(|f| backoff(f).as_secs()).collect();
        assert_eq!(secs, [1, 2, 4, 8, 16, 30, 30, 30]);
    }
}
