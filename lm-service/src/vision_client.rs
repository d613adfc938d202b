//! Pulls image embeddings from the vision replica named in the request (`Vision.Encode`) and
//! reassembles the streamed chunks into [`ImageEmbeds`], checking every chunk against the grid
//! the request declared and the model's widths.
//!
//! The request names a replica; it is dialled only when it is one of this LM's own vision
//! replicas (`--vision`, a list or a DNS name), so a caller of the internal API cannot make
//! the LM connect anywhere else (server-side request forgery).
use crate::error::LmError;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tonic::transport::{Channel, Endpoint};
use tonic::Code;
use vlm_compute::{HostTensor, ImageEmbeds};
use vlm_proto::vision_client::VisionClient;
use vlm_proto::{DType as WireDType, EmbeddingChunk, EncodeRequest, ImageGrid, ImageInput};
use vlm_service_kit::conn::Keepalive;
use vlm_service_kit::internal_auth::InternalToken;
use vlm_service_kit::internal_tls::connect::{dial, TlsConnector};
use vlm_service_kit::internal_tls::{self, InternalTls};
use vlm_service_kit::replicas::ReplicaSource;

/// What the LM expects of every image's embeddings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EmbedShape {
    /// out_hidden_size of the ViT = hidden_size of the LM.
    pub hidden: usize,
    pub deepstack_levels: usize,
    pub spatial_merge_size: usize,
}

impl EmbedShape {
    /// Rows (LM image tokens) of an image with grid `g` (raw patches).
    pub fn rows_for(&self, g: [usize; 3]) -> usize {
        let m = self.spatial_merge_size.max(1);
        g[0] * (g[1] / m) * (g[2] / m)
    }
}

/// One image to encode: its wire input (content hash and expected grid are filled in here).
#[derive(Debug, Clone)]
pub struct EncodeItem {
    pub input: ImageInput,
    pub content_hash: Vec<u8>,
    pub grid: [usize; 3],
}

/// Clients to vision replicas, one channel per replica, created on first use.
#[derive(Debug)]
pub struct VisionClients {
    channels: Mutex<HashMap<String, Channel>>,
    connect_timeout: Duration,
    /// The replicas this LM may dial (`None`: none, image requests missing the cache fail).
    replicas: Option<ReplicaSource>,
    /// A DNS source's last answer and when it was looked up.
    resolved: tokio::sync::Mutex<(Option<Instant>, HashSet<String>)>,
    /// Sent on every call when the internal APIs need it.
    token: Option<Arc<InternalToken>>,
    /// Mutual TLS to the replicas (`None`: plain HTTP/2).
    tls: Option<Arc<InternalTls>>,
    /// HTTP/2 pings on the channels: a frozen vision replica fails the calls open to it.
    keepalive: Keepalive,
}

/// A DNS source is looked up again for an unknown replica at most this often.
const RESOLVE_EVERY: Duration = Duration::from_secs(1);

impl VisionClients {
    pub fn new(replicas: Option<ReplicaSource>) -> Self {
        VisionClients {
            channels: Mutex::new(HashMap::new()),
            connect_timeout: Duration::from_secs(5),
            replicas,
            resolved: tokio::sync::Mutex::new((None, HashSet::new())),
            token: None,
            tls: None,
            keepalive: Keepalive::default(),
        }
    }

    /// Pings the channels to the replicas; one whose ping goes unanswered is closed and the
    /// calls open on it fail, rather than wait for a frozen replica forever.
    pub fn with_keepalive(mut self, keepalive: Keepalive) -> Self {
        self.keepalive = keepalive;
        self
    }

    /// Sends `token` (the internal APIs' shared token) on every call.
    pub fn with_token(mut self, token: Option<Arc<InternalToken>>) -> Self {
        self.token = token;
        self
    }

    /// Dials the replicas over mutual TLS; each must present a certificate for the name of
    /// its source ([`internal_tls::server_name`]).
    pub fn with_tls(mut self, tls: Option<Arc<InternalTls>>) -> Self {
        self.tls = tls;
        self
    }

    /// `replica` (`host:port`, `http://` allowed) when it is one of this LM's vision replicas.
    async fn check_replica(&self, replica: &str) -> Result<String, LmError> {
        let id = replica.trim().trim_start_matches("http://").to_string();
        let known =
            match &self.replicas {
                None => return Err(LmError::validation(
                    "this LM has no vision replicas configured (--vision), so images missing from \
                     its embedding cache cannot be encoded",
                )),
                Some(ReplicaSource::Static(list)) => list.contains(&id),
                Some(source @ ReplicaSource::Dns { .. }) => {
                    let mut r = self.resolved.lock().await;
                    if !r.1.contains(&id) && r.0.is_none_or(|t| t.elapsed() >= RESOLVE_EVERY) {
                        let now = source.resolve().await;
                        // A failed lookup keeps the last answer.
                        if !now.is_empty() {
                            r.1 = now.into_iter().collect();
                        }
                        r.0 = Some(Instant::now());
                    }
                    r.1.contains(&id)
                }
            };
        if !known {
            return Err(LmError::validation(format!(
                "vision replica {id:?} is not one of this LM's vision replicas (--vision); \
                 the LM dials no other address"
            )));
        }
        Ok(id)
    }

    async fn channel(&self, endpoint: &str) -> Result<Channel, LmError> {
        if let Some(c) = self.channels.lock().map_err(poisoned)?.get(endpoint) {
            return Ok(c.clone());
        }
        let uri = if endpoint.contains("://") {
            endpoint.to_string()
        } else {
            format!("http://{endpoint}")
        };
        let ep = Endpoint::from_shared(uri)
            .map_err(|e| {
                LmError::validation(format!(
                    "vision endpoint {endpoint:?} is not a valid URI: {e}"
                ))
            })?
            .connect_timeout(self.connect_timeout);
        let ep = self.keepalive.dial(ep);
        let tls = match (&self.tls, &self.replicas) {
            (Some(tls), Some(source)) => Some(
                TlsConnector::new(tls.clone(), &internal_tls::server_name(source, endpoint))
                    .map_err(|e| LmError::VisionUnavailable(e.to_string()))?,
            ),
            _ => None,
        };
        let channel = dial(ep, tls).await.map_err(|e| {
            LmError::VisionUnavailable(format!("vision replica {endpoint} is unreachable: {e}"))
        })?;
        self.channels
            .lock()
            .map_err(poisoned)?
            .insert(endpoint.to_string(), channel.clone());
        Ok(channel)
    }

    fn forget(&self, endpoint: &str) {
        if let Ok(mut m) = self.channels.lock() {
            m.remove(endpoint);
        }
    }

    /// Encodes `items` on `endpoint`; the result is in the order of `items`.
    pub async fn encode(
        &self,
        endpoint: &str,
        request_id: &str,
        items: Vec<EncodeItem>,
        shape: EmbedShape,
    ) -> Result<Vec<ImageEmbeds>, LmError> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        if endpoint.is_empty() {
            return Err(LmError::validation(format!(
                "{} image(s) are not in the embedding cache and the request names no vision_replica",
                items.len()
            )));
        }
        let endpoint = &self.check_replica(endpoint).await?;
        let channel = self.channel(endpoint).await?;
        let mut client = VisionClient::new(channel).max_decoding_message_size(64 << 20);
        let mut asm = Assembler::new(endpoint, &items, shape);
        let images = items
            .into_iter()
            .map(|it| {
                let mut input = it.input;
                input.content_hash = it.content_hash;
                input.expected_grid = Some(ImageGrid {
                    t: it.grid[0] as u32,
                    h: it.grid[1] as u32,
                    w: it.grid[2] as u32,
                });
                input
            })
            .collect();
        let req = EncodeRequest {
            request_id: request_id.to_string(),
            images,
            dtype: WireDType::DtypeF32 as i32,
        };
        let mut request = tonic::Request::new(req);
        vlm_service_kit::telemetry::inject(request.metadata_mut());
        vlm_service_kit::internal_auth::attach(self.token.as_deref(), &mut request);
        let mut stream = match client.encode(request).await {
            Ok(r) => r.into_inner(),
            Err(s) => {
                if s.code() == Code::Unavailable {
                    self.forget(endpoint);
                }
                return Err(status_error(endpoint, s));
            }
        };
        loop {
            match stream.message().await {
                Ok(Some(chunk)) => asm.add(&chunk)?,
                Ok(None) => break,
                Err(s) => return Err(status_error(endpoint, s)),
            }
        }
        asm.finish()
    }
}

fn poisoned<T>(_: T) -> LmError {
    LmError::internal("vision channel map lock poisoned")
}

fn status_error(endpoint: &str, s: tonic::Status) -> LmError {
    let msg = format!("vision replica {endpoint}: {}", s.message());
    match s.code() {
        Code::InvalidArgument | Code::OutOfRange | Code::FailedPrecondition => {
            LmError::Validation(msg)
        }
        Code::ResourceExhausted => LmError::Overloaded(msg),
        Code::Unavailable | Code::DeadlineExceeded | Code::Unknown => LmError::VisionUnavailable(
            format!("vision replica {endpoint} is unavailable: {}", s.message()),
        ),
        Code::Cancelled => LmError::Cancelled(msg),
        _ => LmError::Internal(msg),
    }
}

/// Chunks to whole images.
#[derive(Debug)]
pub struct Assembler {
    endpoint: String,
    shape: EmbedShape,
    images: Vec<Partial>,
}

#[derive(Debug)]
struct Partial {
    grid: [usize; 3],
    rows: usize,
    embeds: Vec<f32>,
    deepstack: Vec<Vec<f32>>,
    filled: Vec<bool>,
    filled_count: usize,
}

impl Assembler {
    pub fn new(endpoint: &str, items: &[EncodeItem], shape: EmbedShape) -> Self {
        let images = items
            .iter()
            .map(|it| {
                let rows = shape.rows_for(it.grid);
                Partial {
                    grid: it.grid,
                    rows,
                    embeds: vec![0.0; rows * shape.hidden],
                    deepstack: vec![vec![0.0; rows * shape.hidden]; shape.deepstack_levels],
                    filled: vec![false; rows],
                    filled_count: 0,
                }
            })
            .collect();
        Assembler {
            endpoint: endpoint.to_string(),
            shape,
            images,
        }
    }

    fn bad(&self, msg: String) -> LmError {
        LmError::Validation(format!("vision endpoint {}: {msg}", self.endpoint))
    }

    pub fn add(&mut self, c: &EmbeddingChunk) -> Result<(), LmError> {
        let k = c.image_index as usize;
        let hidden = self.shape.hidden;
        let levels = self.shape.deepstack_levels;
        let Some(p) = self.images.get(k) else {
            return Err(self.bad(format!(
                "chunk for image {k}, but {} were sent",
                self.images.len()
            )));
        };
        let grid = c.grid.map(|g| [g.t as usize, g.h as usize, g.w as usize]);
        if grid != Some(p.grid) {
            return Err(self.bad(format!(
                "image {k}: embeddings for grid {grid:?}, the request declared grid {:?}",
                p.grid
            )));
        }
        if c.total_rows as usize != p.rows {
            return Err(self.bad(format!(
                "image {k}: {} embedding rows, its grid {:?} needs {}",
                c.total_rows, p.grid, p.rows
            )));
        }
        if c.hidden_size as usize != hidden {
            return Err(self.bad(format!(
                "image {k}: embedding width {}, the LM's hidden size is {hidden}",
                c.hidden_size
            )));
        }
        if c.deepstack.len() != levels {
            return Err(self.bad(format!(
                "image {k}: {} deepstack levels, the LM takes {levels}",
                c.deepstack.len()
            )));
        }
        let (start, end) = (c.row_start as usize, c.row_end as usize);
        if start >= end || end > p.rows {
            return Err(self.bad(format!(
                "image {k}: chunk rows {start}..{end} of {}",
                p.rows
            )));
        }
        let dtype = WireDType::try_from(c.dtype).unwrap_or(WireDType::DtypeUnspecified);
        let n = (end - start) * hidden;
        let embeds = decode_values(&c.embeds, dtype, n)
            .map_err(|m| self.bad(format!("image {k} embeddings: {m}")))?;
        let mut deep = Vec::with_capacity(levels);
        for (l, d) in c.deepstack.iter().enumerate() {
            deep.push(
                decode_values(d, dtype, n)
                    .map_err(|m| self.bad(format!("image {k} deepstack {l}: {m}")))?,
            );
        }
        let p = &mut self.images[k];
        if p.filled[start..end].iter().any(|&f| f) {
            return Err(LmError::Validation(format!(
                "vision endpoint {}: image {k}: rows {start}..{end} sent twice",
                self.endpoint
            )));
        }
        p.embeds[start * hidden..end * hidden].copy_from_slice(&embeds);
        for (dst, src) in p.deepstack.iter_mut().zip(deep) {
            dst[start * hidden..end * hidden].copy_from_slice(&src);
        }
        p.filled[start..end].iter_mut().for_each(|f| *f = true);
        p.filled_count += end - start;
        Ok(())
    }

    /// The whole images, as f32 host tensors (tokens, hidden).
    pub fn finish(self) -> Result<Vec<ImageEmbeds>, LmError> {
        let hidden = self.shape.hidden;
        let mut out = Vec::with_capacity(self.images.len());
        for (k, p) in self.images.into_iter().enumerate() {
            if p.filled_count != p.rows {
                return Err(LmError::Validation(format!(
                    "vision endpoint {}: image {k}: the stream ended with {} of {} embedding rows",
                    self.endpoint, p.filled_count, p.rows
                )));
            }
            let embeds = HostTensor::from_f32(&p.embeds, vec![p.rows, hidden])?;
            let deepstack = p
                .deepstack
                .iter()
                .map(|d| HostTensor::from_f32(d, vec![p.rows, hidden]))
                .collect::<Result<Vec<_>, _>>()?;
            out.push(ImageEmbeds {
                embeds,
                deepstack,
                grid_thw: p.grid,
            });
        }
        Ok(out)
    }
}

/// Little-endian `dtype` bytes to `n` f32 values.
fn decode_values(bytes: &[u8], dtype: WireDType, n: usize) -> Result<Vec<f32>, String> {
    let size = match dtype {
        WireDType::DtypeF32 => 4,
        WireDType::DtypeF16 | WireDType::DtypeBf16 => 2,
        WireDType::DtypeUnspecified => return Err("dtype unspecified".into()),
    };
    if bytes.len() != n * size {
        return Err(format!(
            "{} bytes, {n} values of {size} bytes need {}",
            bytes.len(),
            n * size
        ));
    }
    Ok(match dtype {
        WireDType::DtypeF32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        WireDType::DtypeF16 => bytes
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        WireDType::DtypeBf16 => bytes
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        WireDType::DtypeUnspecified => unreachable!(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn item(grid: [usize; 3]) -> EncodeItem {
        EncodeItem {
            input: ImageInput::default(),
            content_hash: vec![1],
            grid,
        }
    }

    fn chunk(
        rows: std::ops::Range<u32>,
        total: u32,
        hidden: u32,
        grid: [u32; 3],
    ) -> EmbeddingChunk {
        let n = ((rows.end - rows.start) * hidden) as usize;
        let vals: Vec<f32> = (0..n)
            .map(|i| (rows.start * hidden) as f32 + i as f32)
            .collect();
        EmbeddingChunk {
            image_index: 0,
            content_hash: vec![1],
            grid: Some(ImageGrid {
                t: grid[0],
                h: grid[1],
                w: grid[2],
            }),
            row_start: rows.start,
            row_end: rows.end,
            total_rows: total,
            hidden_size: hidden,
            dtype: WireDType::DtypeF32 as i32,
            embeds: f32_bytes(&vals),
            deepstack: vec![f32_bytes(&vals)],
            bucket: 64,
        }
    }

    const SHAPE: EmbedShape = EmbedShape {
        hidden: 2,
        deepstack_levels: 1,
        spatial_merge_size: 2,
    };

    #[test]
    fn reassembles_out_of_order_chunks() {
        // grid 1x4x4 -> 4 rows.
        let mut a = Assembler::new("v", &[item([1, 4, 4])], SHAPE);
        a.add(&chunk(2..4, 4, 2, [1, 4, 4])).unwrap();
        a.add(&chunk(0..2, 4, 2, [1, 4, 4])).unwrap();
        let out = a.finish().unwrap();
        let v: Vec<f32> = out[0].embeds.to_f32();
        assert_eq!(v, (0..8).map(|i| i as f32).collect::<Vec<_>>());
        assert_eq!(out[0].deepstack.len(), 1);
    }

    #[test]
    fn refuses_embeddings_that_do_not_match_the_grid() {
        let mut a = Assembler::new("vision:1", &[item([1, 4, 4])], SHAPE);
        let e = a.add(&chunk(0..2, 6, 2, [1, 4, 4])).unwrap_err();
        assert!(matches!(e, LmError::Validation(_)));
        assert!(
            e.to_string().contains("vision:1") && e.to_string().contains("needs 4"),
            "{e}"
        );
        let e = a.add(&chunk(0..2, 4, 2, [1, 4, 6])).unwrap_err();
        assert!(e.to_string().contains("declared grid"), "{e}");
        let e = a.add(&chunk(0..2, 4, 3, [1, 4, 4])).unwrap_err();
        assert!(e.to_string().contains("hidden size is 2"), "{e}");
        // Incomplete stream.
        a.add(&chunk(0..2, 4, 2, [1, 4, 4])).unwrap();
        let e = a.finish().unwrap_err();
        assert!(e.to_string().contains("2 of 4"), "{e}");
    }

    #[tokio::test]
    async fn unreachable_endpoint_is_unavailable_and_named() {
        let c = VisionClients::new(Some(ReplicaSource::parse("127.0.0.1:1").unwrap()));
        let e = c
            .encode("http://127.0.0.1:1", "r", vec![item([1, 4, 4])], SHAPE)
            .await
            .unwrap_err();
        assert!(matches!(e, LmError::VisionUnavailable(_)), "{e:?}");
        assert!(e.to_string().contains("127.0.0.1:1"), "{e}");
    }

    #[tokio::test]
    async fn only_configured_replicas_are_dialled() {
        // A listener the request names but the LM's configuration does not: never connected to.
        let outsider = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = outsider.local_addr().unwrap().to_string();
        for replicas in [
            None,
            Some(ReplicaSource::parse("127.0.0.1:1").unwrap()),
            Some(ReplicaSource::parse("dns:///localhost:1").unwrap()),
        ] {
            let c = VisionClients::new(replicas.clone());
            let e = c
                .encode(&addr, "r", vec![item([1, 4, 4])], SHAPE)
                .await
                .unwrap_err();
            assert!(matches!(e, LmError::Validation(_)), "{e:?}");
            assert!(e.to_string().contains("--vision"), "{e}");
        }
        let accepted = tokio::time::timeout(Duration::from_millis(200), outsider.accept()).await;
        assert!(
            accepted.is_err(),
            "the LM connected to a caller-named address"
        );
    }
}
