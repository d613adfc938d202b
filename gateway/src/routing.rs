//! Replica choice. LM replicas are ranked by their `Lm.Load` (waiting first, then free KV
//! blocks), vision replicas by `Vision.Info` queue depth; a background task polls both every
//! `poll_interval`, takes a replica that fails out and puts it back when it answers again, and
//! re-resolves `dns:///name:port` sources (a Kubernetes headless Service).
use crate::error::GatewayError;
use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tokio::sync::watch;
use tonic::transport::{Channel, Endpoint};
use vlm_proto::v1::{
    lm_client::LmClient, vision_client::VisionClient, LoadRequest, VisionInfoRequest,
};

/// Where replicas come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplicaSource {
    /// Fixed `host:port` list.
    Static(Vec<String>),
    /// `dns:///name:port`: every address the name resolves to, re-resolved periodically.
    Dns { host: String, port: u16 },
}

impl ReplicaSource {
    /// Parses `host:port,host:port` or `dns:///name:port`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if let Some(rest) = s
            .strip_prefix("dns:///")
            .or_else(|| s.strip_prefix("dns://"))
        {
            let (host, port) = rest
                .rsplit_once(':')
                .ok_or_else(|| format!("{s:?}: expected dns:///name:port"))?;
            let port = port
                .parse()
                .map_err(|_| format!("{s:?}: port {port:?} is not a number"))?;
            return Ok(ReplicaSource::Dns {
                host: host.to_string(),
                port,
            });
        }
        let list: Vec<String> = s
            .split(',')
            .map(|a| a.trim().trim_start_matches("http://").to_string())
            .filter(|a| !a.is_empty())
            .collect();
        if list.is_empty() {
            return Err("the replica list is empty".into());
        }
        if let Some(bad) = list.iter().find(|a| !a.contains(':')) {
            return Err(format!("{bad:?}: expected host:port"));
        }
        Ok(ReplicaSource::Static(list))
    }

    async fn resolve(&self) -> Vec<String> {
        match self {
            ReplicaSource::Static(list) => list.clone(),
            ReplicaSource::Dns { host, port } => {
                match tokio::net::lookup_host((host.as_str(), *port)).await {
                    Ok(addrs) => {
                        let mut v: Vec<String> = addrs.map(|a| a.to_string()).collect();
                        v.sort();
                        v.dedup();
                        v
                    }
                    Err(e) => {
                        tracing::warn!(host, port, error = %e, "replica DNS lookup failed; keeping the last list");
                        Vec::new()
                    }
                }
            }
        }
    }
}

/// What routing knows about one LM replica.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LmLoad {
    pub healthy: bool,
    pub draining: bool,
    pub running: u32,
    pub waiting: u32,
    pub free_kv_blocks: u32,
    /// Requests this gateway has open on it now (fresher than the last poll).
    pub local_in_flight: usize,
}

/// What routing knows about one vision replica.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VisionLoad {
    pub healthy: bool,
    pub queue_depth: u32,
    pub images_in_flight: u32,
    pub local_in_flight: usize,
}

/// The LM replica to use: healthy, not draining, not excluded; fewest waiting, then fewest
/// opened by us, then most free KV blocks, then first in the list.
pub fn choose_lm(loads: &[LmLoad], excluded: &[usize]) -> Option<usize> {
    loads
        .iter()
        .enumerate()
        .filter(|(i, l)| l.healthy && !l.draining && !excluded.contains(i))
        .min_by_key(|(i, l)| {
            (
                l.waiting,
                l.local_in_flight,
                std::cmp::Reverse(l.free_kv_blocks),
                *i,
            )
        })
        .map(|(i, _)| i)
}

/// The vision replica to use: healthy; shortest queue (plus images in flight), then fewest
/// opened by us, then first.
pub fn choose_vision(loads: &[VisionLoad]) -> Option<usize> {
    loads
        .iter()
        .enumerate()
        .filter(|(_, l)| l.healthy)
        .min_by_key(|(i, l)| (l.queue_depth + l.images_in_flight, l.local_in_flight, *i))
        .map(|(i, _)| i)
}

struct Replica<L> {
    addr: String,
    channel: Channel,
    load: L,
    local: Arc<AtomicUsize>,
}

impl<L: Default> Replica<L> {
    fn new(addr: String) -> Result<Self, String> {
        let channel = Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| format!("{addr:?}: {e}"))?
            .connect_timeout(Duration::from_secs(2))
            .tcp_nodelay(true)
            .connect_lazy();
        Ok(Replica {
            addr,
            channel,
            load: L::default(),
            local: Arc::new(AtomicUsize::new(0)),
        })
    }
}

/// A replica handed to one request; counts as in flight there until dropped.
pub struct Lease {
    pub addr: String,
    pub channel: Channel,
    local: Arc<AtomicUsize>,
}

impl Lease {
    fn new(addr: String, channel: Channel, local: Arc<AtomicUsize>) -> Self {
        local.fetch_add(1, Ordering::Relaxed);
        Lease {
            addr,
            channel,
            local,
        }
    }
    /// `http://host:port`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.local.fetch_sub(1, Ordering::Relaxed);
    }
}

#[derive(Default)]
struct Sets {
    lm: Vec<Replica<LmLoad>>,
    vision: Vec<Replica<VisionLoad>>,
}

/// Routing timing.
#[derive(Debug, Clone, Copy)]
pub struct RoutingOptions {
    pub poll_interval: Duration,
    pub poll_timeout: Duration,
    /// DNS sources are re-resolved every this often.
    pub dns_interval: Duration,
}

impl Default for RoutingOptions {
    fn default() -> Self {
        RoutingOptions {
            poll_interval: Duration::from_millis(500),
            poll_timeout: Duration::from_secs(2),
            dns_interval: Duration::from_secs(5),
        }
    }
}

/// Cheap to clone.
#[derive(Clone)]
pub struct Router {
    sets: Arc<RwLock<Sets>>,
    lm_source: Arc<ReplicaSource>,
    vision_source: Arc<ReplicaSource>,
    opts: RoutingOptions,
    ready_tx: Arc<watch::Sender<bool>>,
}

impl Router {
    pub fn new(lm: ReplicaSource, vision: ReplicaSource, opts: RoutingOptions) -> Self {
        let (ready_tx, _) = watch::channel(false);
        Router {
            sets: Arc::new(RwLock::new(Sets::default())),
            lm_source: Arc::new(lm),
            vision_source: Arc::new(vision),
            opts,
            ready_tx: Arc::new(ready_tx),
        }
    }

    /// True while at least one LM and one vision replica are healthy.
    pub fn ready(&self) -> watch::Receiver<bool> {
        self.ready_tx.subscribe()
    }

    /// Resolves, polls once, then keeps polling in the background until `stop` fires.
    pub async fn start(&self, stop: tokio_util::sync::CancellationToken) {
        self.refresh_sources().await;
        self.poll().await;
        let me = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(me.opts.poll_interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await; // the first tick is immediate: the poll above was it
            let mut last_dns = tokio::time::Instant::now();
            loop {
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tick.tick() => {}
                }
                if last_dns.elapsed() >= me.opts.dns_interval {
                    me.refresh_sources().await;
                    last_dns = tokio::time::Instant::now();
                }
                me.poll().await;
            }
        });
    }

    async fn refresh_sources(&self) {
        let lm = self.lm_source.resolve().await;
        let vision = self.vision_source.resolve().await;
        let mut sets = self.sets.write().unwrap_or_else(|p| p.into_inner());
        reconcile(&mut sets.lm, lm);
        reconcile(&mut sets.vision, vision);
    }

    /// Polls every replica once (in parallel) and updates health and load.
    pub async fn poll(&self) {
        let (lm, vision): (Vec<_>, Vec<_>) = {
            let sets = self.sets.read().unwrap_or_else(|p| p.into_inner());
            (
                sets.lm
                    .iter()
                    .map(|r| (r.addr.clone(), r.channel.clone()))
                    .collect(),
                sets.vision
                    .iter()
                    .map(|r| (r.addr.clone(), r.channel.clone()))
                    .collect(),
            )
        };
        let t = self.opts.poll_timeout;
        let lm_res = futures::future::join_all(lm.into_iter().map(|(addr, ch)| async move {
            let r = tokio::time::timeout(t, LmClient::new(ch).load(LoadRequest {})).await;
            (addr, r.ok().and_then(|r| r.ok()).map(|r| r.into_inner()))
        }));
        let vision_res =
            futures::future::join_all(vision.into_iter().map(|(addr, ch)| async move {
                let r =
                    tokio::time::timeout(t, VisionClient::new(ch).info(VisionInfoRequest {})).await;
                (addr, r.ok().and_then(|r| r.ok()).map(|r| r.into_inner()))
            }));
        let (lm_res, vision_res) = futures::join!(lm_res, vision_res);
        let ready = {
            let mut sets = self.sets.write().unwrap_or_else(|p| p.into_inner());
            for (addr, rep) in lm_res {
                if let Some(r) = sets.lm.iter_mut().find(|r| r.addr == addr) {
                    let was = r.load.healthy;
                    r.load = match rep {
                        Some(l) => LmLoad {
                            healthy: true,
                            draining: l.draining,
                            running: l.running,
                            waiting: l.waiting,
                            free_kv_blocks: l.free_kv_blocks,
                            local_in_flight: 0,
                        },
                        None => LmLoad::default(),
                    };
                    log_change("lm", &addr, was, r.load.healthy);
                }
            }
            for (addr, info) in vision_res {
                if let Some(r) = sets.vision.iter_mut().find(|r| r.addr == addr) {
                    let was = r.load.healthy;
                    r.load = match info {
                        Some(i) => VisionLoad {
                            healthy: true,
                            queue_depth: i.queue_depth,
                            images_in_flight: i.images_in_flight,
                            local_in_flight: 0,
                        },
                        None => VisionLoad::default(),
                    };
                    log_change("vision", &addr, was, r.load.healthy);
                }
            }
            sets.lm.iter().any(|r| r.load.healthy && !r.load.draining)
                && sets.vision.iter().any(|r| r.load.healthy)
        };
        self.ready_tx
            .send_if_modified(|v| std::mem::replace(v, ready) != ready);
    }

    /// Picks an LM replica, skipping `excluded` addresses.
    pub fn pick_lm(&self, excluded: &[String]) -> Result<Lease, GatewayError> {
        let sets = self.sets.read().unwrap_or_else(|p| p.into_inner());
        let loads: Vec<LmLoad> = sets
            .lm
            .iter()
            .map(|r| LmLoad {
                local_in_flight: r.local.load(Ordering::Relaxed),
                ..r.load
            })
            .collect();
        let ex: Vec<usize> = sets
            .lm
            .iter()
            .enumerate()
            .filter(|(_, r)| excluded.contains(&r.addr))
            .map(|(i, _)| i)
            .collect();
        let i = choose_lm(&loads, &ex).ok_or_else(|| {
            let healthy = loads.iter().filter(|l| l.healthy && !l.draining).count();
            GatewayError::Unavailable(format!(
                "no healthy LM replica to use ({} configured, {healthy} healthy, {} already tried)",
                loads.len(),
                excluded.len()
            ))
        })?;
        let r = &sets.lm[i];
        Ok(Lease::new(
            r.addr.clone(),
            r.channel.clone(),
            r.local.clone(),
        ))
    }

    pub fn pick_vision(&self) -> Result<Lease, GatewayError> {
        let sets = self.sets.read().unwrap_or_else(|p| p.into_inner());
        let loads: Vec<VisionLoad> = sets
            .vision
            .iter()
            .map(|r| VisionLoad {
                local_in_flight: r.local.load(Ordering::Relaxed),
                ..r.load
            })
            .collect();
        let i = choose_vision(&loads).ok_or_else(|| {
            GatewayError::Unavailable(format!(
                "no healthy vision replica to use ({} configured)",
                loads.len()
            ))
        })?;
        let r = &sets.vision[i];
        Ok(Lease::new(
            r.addr.clone(),
            r.channel.clone(),
            r.local.clone(),
        ))
    }

    /// Takes an LM replica out at once (a call to it failed); the next good poll puts it back.
    pub fn mark_lm_failed(&self, addr: &str) {
        let mut sets = self.sets.write().unwrap_or_else(|p| p.into_inner());
        if let Some(r) = sets.lm.iter_mut().find(|r| r.addr == addr) {
            log_change("lm", addr, r.load.healthy, false);
            r.load.healthy = false;
        }
    }

    /// (addr, healthy) of every LM replica.
    pub fn lm_replicas(&self) -> Vec<(String, bool)> {
        let sets = self.sets.read().unwrap_or_else(|p| p.into_inner());
        sets.lm
            .iter()
            .map(|r| (r.addr.clone(), r.load.healthy))
            .collect()
    }
}

fn log_change(kind: &str, addr: &str, was: bool, now: bool) {
    match (was, now) {
        (false, true) => tracing::info!(kind, addr, "replica healthy: in rotation"),
        (true, false) => tracing::warn!(kind, addr, "replica failing: out of rotation"),
        _ => {}
    }
}

/// Makes `set` hold exactly `addrs`, keeping the state of replicas already known. An empty
/// `addrs` (a failed lookup) leaves the set alone.
fn reconcile<L: Default>(set: &mut Vec<Replica<L>>, addrs: Vec<String>) {
    if addrs.is_empty() {
        return;
    }
    let want: HashSet<&String> = addrs.iter().collect();
    set.retain(|r| want.contains(&r.addr));
    for a in &addrs {
        if !set.iter().any(|r| &r.addr == a) {
            match Replica::new(a.clone()) {
                Ok(r) => set.push(r),
                Err(e) => tracing::warn!(error = %e, "bad replica address"),
            }
        }
    }
    set.sort_by_key(|r| addrs.iter().position(|a| a == &r.addr));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lm(healthy: bool, waiting: u32, free: u32, local: usize) -> LmLoad {
        LmLoad {
            healthy,
            draining: false,
            running: 0,
            waiting,
            free_kv_blocks: free,
            local_in_flight: local,
        }
    }

    #[test]
    fn lm_choice_prefers_idle_then_free_blocks_and_skips_unhealthy() {
        assert_eq!(
            choose_lm(&[lm(true, 1, 100, 0), lm(true, 0, 10, 0)], &[]),
            Some(1)
        );
        assert_eq!(
            choose_lm(&[lm(true, 0, 10, 0), lm(true, 0, 50, 0)], &[]),
            Some(1)
        );
        assert_eq!(
            choose_lm(&[lm(true, 0, 50, 2), lm(true, 0, 10, 1)], &[]),
            Some(1)
        );
        assert_eq!(
            choose_lm(&[lm(false, 0, 99, 0), lm(true, 5, 1, 0)], &[]),
            Some(1)
        );
        assert_eq!(
            choose_lm(&[lm(true, 0, 9, 0), lm(true, 0, 9, 0)], &[]),
            Some(0)
        );
        assert_eq!(
            choose_lm(&[lm(true, 0, 9, 0), lm(true, 0, 9, 0)], &[0]),
            Some(1)
        );
        assert_eq!(choose_lm(&[lm(true, 0, 9, 0)], &[0]), None);
        let mut d = lm(true, 0, 99, 0);
        d.draining = true;
        assert_eq!(choose_lm(&[d, lm(true, 3, 1, 0)], &[]), Some(1));
        assert_eq!(choose_lm(&[], &[]), None);
    }

    #[test]
    fn vision_choice_prefers_short_queue() {
        let v = |healthy, q, f| VisionLoad {
            healthy,
            queue_depth: q,
            images_in_flight: f,
            local_in_flight: 0,
        };
        assert_eq!(choose_vision(&[v(true, 3, 0), v(true, 1, 1)]), Some(1));
        assert_eq!(choose_vision(&[v(false, 0, 0), v(true, 9, 0)]), Some(1));
        assert_eq!(choose_vision(&[v(false, 0, 0)]), None);
    }

    #[test]
    fn parses_sources() {
        assert_eq!(
            ReplicaSource::parse("a:1, http://b:2").unwrap(),
            ReplicaSource::Static(vec!["a:1".into(), "b:2".into()])
        );
        assert_eq!(
            ReplicaSource::parse("dns:///lm.ns.svc:50052").unwrap(),
            ReplicaSource::Dns {
                host: "lm.ns.svc".into(),
                port: 50052
            }
        );
        assert!(ReplicaSource::parse("").is_err());
        assert!(ReplicaSource::parse("nohost").is_err());
    }

    #[tokio::test]
    async fn dns_source_resolves_every_address() {
        let addrs = ReplicaSource::parse("dns:///localhost:7")
            .unwrap()
            .resolve()
            .await;
        assert!(
            addrs.iter().any(|a| a == "127.0.0.1:7" || a == "[::1]:7"),
            "{addrs:?}"
        );
    }

    #[tokio::test]
    async fn failing_replica_goes_out_and_comes_back() {
        // Nothing listens on these ports: polls fail, so nothing is healthy.
        let r = Router::new(
            ReplicaSource::parse("127.0.0.1:1").unwrap(),
            ReplicaSource::parse("127.0.0.1:1").unwrap(),
            RoutingOptions {
                poll_timeout: Duration::from_millis(300),
                ..Default::default()
            },
        );
        r.refresh_sources().await;
        r.poll().await;
        assert!(!*r.ready().borrow());
        let e = r.pick_lm(&[]).err().unwrap();
        assert!(e.to_string().contains("no healthy LM replica"), "{e}");
        // Marked healthy by hand, then failed by a call: out again.
        r.sets.write().unwrap().lm[0].load.healthy = true;
        assert!(r.pick_lm(&[]).is_ok());
        r.mark_lm_failed("127.0.0.1:1");
        assert!(r.pick_lm(&[]).is_err());
    }

    #[tokio::test]
    async fn reconcile_keeps_known_replicas_adds_new_drops_gone_and_ignores_empty_lookups() {
        let addrs = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let mut set: Vec<Replica<LmLoad>> = Vec::new();
        reconcile(&mut set, addrs(&["10.0.0.1:5", "10.0.0.2:5"]));
        assert_eq!(set.len(), 2);
        set[1].load.healthy = true; // state learned by polls
                                    // A re-resolution: .1 is gone, .3 is new, .2 keeps its state; order follows the lookup.
        reconcile(&mut set, addrs(&["10.0.0.3:5", "10.0.0.2:5"]));
        let got: Vec<(&str, bool)> = set
            .iter()
            .map(|r| (r.addr.as_str(), r.load.healthy))
            .collect();
        assert_eq!(got, vec![("10.0.0.3:5", false), ("10.0.0.2:5", true)]);
        // A failed lookup (no addresses) leaves the set as it was.
        reconcile(&mut set, Vec::new());
        assert_eq!(set.len(), 2);
    }
}
