//! Replica choice. LM replicas are ranked by their `Lm.Load` (waiting first, then free KV
//! blocks), vision replicas by `Vision.Info` queue depth; a background task polls both every
//! `poll_interval`, takes a replica that fails out and puts it back when it answers again, and
//! re-resolves `dns:///name:port` sources (a Kubernetes headless Service).
//!
//! With prefix caching on, a request whose prompt has a full first KV block goes to the LM
//! replica most likely to hold that block: its [`PrefixKey`] is scored against each eligible
//! replica's address by rendezvous (highest-random-weight) hashing, so the same first block
//! keeps landing on the same replica while the set of replicas stays, and adding or removing
//! another replica moves only the keys that replica wins or held. A preferred replica that is
//! busy (see [`route_lm`]) is passed over for the least-loaded one.
use crate::error::GatewayError;
use sha2::{Digest, Sha256};
use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tokio::sync::watch;
use tonic::transport::{Channel, Endpoint};
use vlm_proto::v1::{
    lm_client::LmClient, vision_client::VisionClient, LoadRequest, VisionInfoRequest,
};
use vlm_service_kit::conn::Keepalive;
use vlm_service_kit::internal_auth::{attach, InternalToken};
use vlm_service_kit::internal_tls::connect::{dial_lazy, TlsConnector};
use vlm_service_kit::internal_tls::{self, InternalTls};

pub use vlm_service_kit::replicas::ReplicaSource;

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

/// The routing key of a prompt: a hash of its first full KV block (its token ids and the
/// (content hash, offset) of every image token in it), the block an LM's prefix cache would
/// reuse first. Prompts that share it share at least that block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PrefixKey([u8; 32]);

impl PrefixKey {
    /// The key of the first `block_len` tokens of `input_ids`; None when the prompt has no full
    /// block (the LM caches full blocks only, so nothing of it could be reused). `images` are
    /// (content hash, tokens) in prompt order: the k-th run of `image_pad_id` tokens belongs to
    /// the k-th image, offsets counting from the image's first token.
    pub fn first_block<'a>(
        input_ids: &[u32],
        image_pad_id: u32,
        images: impl IntoIterator<Item = (&'a [u8; 32], u32)>,
        block_len: u32,
    ) -> Option<PrefixKey> {
        let n = block_len as usize;
        if n == 0 || input_ids.len() < n {
            return None;
        }
        let block = &input_ids[..n];
        let mut h = Sha256::new();
        h.update(b"vlm-prefix-route-v1");
        h.update(block_len.to_le_bytes());
        for id in block {
            h.update(id.to_le_bytes());
        }
        // Placeholder ids are the same for every image: what tells two blocks apart is which
        // image (and which part of it) they cover.
        let mut images = images.into_iter();
        let mut current: Option<(&[u8; 32], u32)> = None;
        let mut offset = 0u32;
        for _ in block.iter().filter(|&&id| id == image_pad_id) {
            let hash = loop {
                match current {
                    Some((hash, tokens)) if offset < tokens => break hash,
                    _ => match images.next() {
                        Some(next) => {
                            current = Some(next);
                            offset = 0;
                        }
                        // More placeholders than images: validation never builds such a
                        // prompt; the token ids alone still key it.
                        None => return Some(PrefixKey(h.finalize().into())),
                    },
                }
            };
            h.update(hash);
            h.update(offset.to_le_bytes());
            offset += 1;
        }
        Some(PrefixKey(h.finalize().into()))
    }

    /// The rendezvous weight of the replica at `addr` for this key.
    pub fn score(&self, addr: &str) -> u64 {
        let mut h = Sha256::new();
        h.update(self.0);
        h.update(addr.as_bytes());
        let d = h.finalize();
        u64::from_le_bytes(d[..8].try_into().expect("a SHA-256 digest has 32 bytes"))
    }
}

/// How [`route_lm`] chose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// The request's preferred replica by prefix.
    Prefix,
    /// The preferred replica was busy: the least-loaded one instead (which may still be it).
    PrefixBusy { preferred: usize },
    /// No key (prompt under one block, or prefix caching off): by load.
    Load,
}

impl Route {
    /// The `route` label of `vlm_gateway_lm_routes_total`.
    pub fn label(self) -> &'static str {
        match self {
            Route::Prefix => "prefix",
            Route::PrefixBusy { .. } => "prefix_busy",
            Route::Load => "load",
        }
    }
}

/// The LM replica for a request with routing key `key`: among the eligible replicas (healthy,
/// not draining, not excluded) the one with the highest [`PrefixKey::score`] of its address
/// (`addrs[i]` is replica `i`'s), unless it is busy: it has waiting requests while another
/// eligible replica has none, or it has more than `busy_margin` requests opened by us beyond
/// the least-loaded eligible replica. A busy preferred replica, and no key, fall back to
/// [`choose_lm`].
pub fn route_lm(
    loads: &[LmLoad],
    addrs: &[&str],
    excluded: &[usize],
    key: Option<&PrefixKey>,
    busy_margin: usize,
) -> Option<(usize, Route)> {
    debug_assert_eq!(loads.len(), addrs.len());
    let Some(key) = key else {
        return choose_lm(loads, excluded).map(|i| (i, Route::Load));
    };
    let eligible = || {
        loads
            .iter()
            .enumerate()
            .filter(|(i, l)| l.healthy && !l.draining && !excluded.contains(i))
    };
    // Ties (two addresses with the same 64-bit weight) go to the lower address, so that every
    // gateway agrees whatever order its list is in.
    let (preferred, p) = eligible().max_by(|(i, _), (j, _)| {
        key.score(addrs[*i])
            .cmp(&key.score(addrs[*j]))
            .then_with(|| addrs[*j].cmp(addrs[*i]))
    })?;
    let someone_idle = eligible().any(|(_, l)| l.waiting == 0);
    let least_local = eligible().map(|(_, l)| l.local_in_flight).min()?;
    let busy = (p.waiting > 0 && someone_idle)
        || p.local_in_flight > least_local.saturating_add(busy_margin);
    if !busy {
        return Some((preferred, Route::Prefix));
    }
    choose_lm(loads, excluded).map(|i| (i, Route::PrefixBusy { preferred }))
}

struct Replica<L> {
    addr: String,
    dialer: Dialer,
    channel: Channel,
    load: L,
    local: Arc<AtomicUsize>,
}

/// How to dial one replica: its endpoint (timeouts, keepalive) and TLS connector.
#[derive(Clone)]
struct Dialer {
    endpoint: Endpoint,
    tls: Option<TlsConnector>,
}

impl Dialer {
    /// A channel that connects on first use, on a connection of its own.
    fn dial(&self) -> Channel {
        dial_lazy(self.endpoint.clone(), self.tls.clone())
    }
}

impl<L: Default> Replica<L> {
    /// A replica at `addr`, dialled over mutual TLS when `tls` is set (its certificate must
    /// name what [`internal_tls::server_name`] says for `source`).
    fn new(
        addr: String,
        source: &ReplicaSource,
        tls: Option<&Arc<InternalTls>>,
        keepalive: Keepalive,
    ) -> Result<Self, String> {
        let endpoint = Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| format!("{addr:?}: {e}"))?
            .connect_timeout(Duration::from_secs(2))
            .tcp_nodelay(true);
        let endpoint = keepalive.dial(endpoint);
        let tls = tls
            .map(|t| TlsConnector::new(t.clone(), &internal_tls::server_name(source, &addr)))
            .transpose()
            .map_err(|e| format!("{addr:?}: {e}"))?;
        let dialer = Dialer { endpoint, tls };
        Ok(Replica {
            addr,
            channel: dialer.dial(),
            dialer,
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
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.local.fetch_sub(1, Ordering::Relaxed);
    }
}

/// An LM replica chosen for one request, and how.
pub struct LmPick {
    pub lease: Lease,
    pub route: Route,
    /// The prefix-preferred replica's address when it was busy and another was chosen.
    pub passed_over: Option<String>,
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
    /// A request's prefix-preferred LM replica counts as busy when it has more than this many
    /// requests opened by this gateway beyond the least-loaded eligible replica.
    pub prefix_busy_margin: usize,
}

impl Default for RoutingOptions {
    fn default() -> Self {
        RoutingOptions {
            poll_interval: Duration::from_millis(500),
            poll_timeout: Duration::from_secs(2),
            dns_interval: Duration::from_secs(5),
            prefix_busy_margin: 4,
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
    /// Tokens per LM KV block when the LMs cache prefixes; None = route by load only.
    prefix_block_len: Option<u32>,
    /// The internal APIs' shared token, sent on every call to a replica.
    token: Option<Arc<InternalToken>>,
    /// Mutual TLS to the replicas (`None`: plain HTTP/2).
    tls: Option<Arc<InternalTls>>,
    /// HTTP/2 pings on the channels to the replicas.
    keepalive: Keepalive,
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
            prefix_block_len: None,
            token: None,
            tls: None,
            keepalive: Keepalive::default(),
            ready_tx: Arc::new(ready_tx),
        }
    }

    /// Routes requests by their first KV block of `block_len` tokens (the LMs'
    /// `kvcache_partition_len`) when `Some`: the LMs cache prefixes. None = by load only.
    pub fn with_prefix_routing(mut self, block_len: Option<u32>) -> Self {
        self.prefix_block_len = block_len.filter(|&b| b > 0);
        self
    }

    /// Sends `token` (the internal APIs' shared token) on every call to a replica.
    pub fn with_internal_token(mut self, token: Option<Arc<InternalToken>>) -> Self {
        self.token = token;
        self
    }

    /// Dials the replicas over mutual TLS (set before [`Router::start`]: replicas already
    /// known keep their channels).
    pub fn with_internal_tls(mut self, tls: Option<Arc<InternalTls>>) -> Self {
        self.tls = tls;
        self
    }

    /// Pings the channels to the replicas (set before [`Router::start`]): one whose ping goes
    /// unanswered is closed, and the calls open on it fail, so a frozen replica (a hung
    /// process, a partition) cannot hold a request forever.
    pub fn with_keepalive(mut self, keepalive: Keepalive) -> Self {
        self.keepalive = keepalive;
        self
    }

    pub fn internal_token(&self) -> Option<&InternalToken> {
        self.token.as_deref()
    }

    /// The block length prefix keys are computed over; None when routing by load only.
    pub fn prefix_block_len(&self) -> Option<u32> {
        self.prefix_block_len
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
        let (tls, keepalive) = (self.tls.as_ref(), self.keepalive);
        reconcile(&mut sets.lm, lm, &self.lm_source, tls, keepalive);
        reconcile(
            &mut sets.vision,
            vision,
            &self.vision_source,
            tls,
            keepalive,
        );
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
        let token = &self.token;
        let lm_res = futures::future::join_all(lm.into_iter().map(|(addr, ch)| async move {
            let mut req = tonic::Request::new(LoadRequest {});
            attach(token.as_deref(), &mut req);
            let r = tokio::time::timeout(t, LmClient::new(ch).load(req)).await;
            (addr, r.ok().and_then(|r| r.ok()).map(|r| r.into_inner()))
        }));
        let vision_res =
            futures::future::join_all(vision.into_iter().map(|(addr, ch)| async move {
                let mut req = tonic::Request::new(VisionInfoRequest {});
                attach(token.as_deref(), &mut req);
                let r = tokio::time::timeout(t, VisionClient::new(ch).info(req)).await;
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

    /// Picks an LM replica for a request with routing key `key` (see [`route_lm`]), skipping
    /// `excluded` addresses.
    pub fn pick_lm(
        &self,
        excluded: &[String],
        key: Option<&PrefixKey>,
    ) -> Result<LmPick, GatewayError> {
        let sets = self.sets.read().unwrap_or_else(|p| p.into_inner());
        let loads: Vec<LmLoad> = sets
            .lm
            .iter()
            .map(|r| LmLoad {
                local_in_flight: r.local.load(Ordering::Relaxed),
                ..r.load
            })
            .collect();
        let addrs: Vec<&str> = sets.lm.iter().map(|r| r.addr.as_str()).collect();
        let ex: Vec<usize> = sets
            .lm
            .iter()
            .enumerate()
            .filter(|(_, r)| excluded.contains(&r.addr))
            .map(|(i, _)| i)
            .collect();
        let (i, route) = route_lm(&loads, &addrs, &ex, key, self.opts.prefix_busy_margin)
            .ok_or_else(|| {
                let healthy = loads.iter().filter(|l| l.healthy && !l.draining).count();
                GatewayError::Unavailable(format!(
                    "no healthy LM replica to use ({} configured, {healthy} healthy, {} already tried)",
                    loads.len(),
                    excluded.len()
                ))
            })?;
        let r = &sets.lm[i];
        let passed_over = match route {
            Route::PrefixBusy { preferred } if preferred != i => Some(addrs[preferred].to_string()),
            _ => None,
        };
        Ok(LmPick {
            lease: Lease::new(r.addr.clone(), r.channel.clone(), r.local.clone()),
            route,
            passed_over,
        })
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
                "no healthy vision replica to encode this request's images ({} configured); \
                 requests without images are still served",
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

    /// A lease on LM replica `addr` over a new connection, which also replaces the replica's
    /// channel for the requests after: a call failed on the old one below gRPC (an HTTP/2
    /// error, a keepalive timeout, a reset), which says the connection died, not that the
    /// replica did. None when `addr` is no longer a replica.
    pub fn redial_lm(&self, addr: &str) -> Option<Lease> {
        let mut sets = self.sets.write().unwrap_or_else(|p| p.into_inner());
        let r = sets.lm.iter_mut().find(|r| r.addr == addr)?;
        r.channel = r.dialer.dial();
        Some(Lease::new(
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

    /// Takes a vision replica out at once (the LM could not encode on it); the next good poll
    /// puts it back.
    pub fn mark_vision_failed(&self, addr: &str) {
        let mut sets = self.sets.write().unwrap_or_else(|p| p.into_inner());
        if let Some(r) = sets.vision.iter_mut().find(|r| r.addr == addr) {
            log_change("vision", addr, r.load.healthy, false);
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
fn reconcile<L: Default>(
    set: &mut Vec<Replica<L>>,
    addrs: Vec<String>,
    source: &ReplicaSource,
    tls: Option<&Arc<InternalTls>>,
    keepalive: Keepalive,
) {
    if addrs.is_empty() {
        return;
    }
    let want: HashSet<&String> = addrs.iter().collect();
    set.retain(|r| want.contains(&r.addr));
    for a in &addrs {
        if !set.iter().any(|r| &r.addr == a) {
            match Replica::new(a.clone(), source, tls, keepalive) {
                Ok(r) => set.push(r),
                Err(e) => tracing::warn!(error = %e, "bad replica address"),
            }
        }
    }
    set.sort_by_key(|r| addrs.iter().position(|a| a == &r.addr));
}

#[cfg(test)]
mod tests;
