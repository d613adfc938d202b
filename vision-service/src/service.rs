//! The tonic `vlm.v1.Vision` implementation: an adapter only. Each method converts the proto,
//! calls the encoder and maps the error (`From<VisionError> for Status`).
use crate::convert;
use crate::encoder::Encoder;
use crate::error::VisionError;
use futures::{Stream, StreamExt};
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use tonic::{Request, Response, Status};
use vlm_proto::v1 as pb;

/// The encoder, once the weights are loaded (until then every call is UNAVAILABLE).
pub type EncoderSlot = Arc<OnceLock<Encoder>>;

pub struct VisionService {
    encoder: EncoderSlot,
    /// What `Info` reports of the gRPC port's connection options.
    grpc_conn: pb::GrpcConnInfo,
}

impl VisionService {
    pub fn new(encoder: EncoderSlot) -> Self {
        VisionService {
            encoder,
            grpc_conn: vlm_service_kit::conn::GrpcConnOptions::default().info(),
        }
    }

    /// `Info` reports `grpc_conn` (the `--grpc-*` flags the server runs with).
    pub fn with_grpc_conn(mut self, grpc_conn: pb::GrpcConnInfo) -> Self {
        self.grpc_conn = grpc_conn;
        self
    }

    fn encoder(&self) -> Result<&Encoder, VisionError> {
        self.encoder
            .get()
            .ok_or_else(|| VisionError::NotReady("the ViT is still loading".into()))
    }
}

type ChunkStream = Pin<Box<dyn Stream<Item = Result<pb::EmbeddingChunk, Status>> + Send>>;

#[tonic::async_trait]
impl pb::vision_server::Vision for VisionService {
    type EncodeStream = ChunkStream;

    async fn encode(
        &self,
        request: Request<pb::EncodeRequest>,
    ) -> Result<Response<ChunkStream>, Status> {
        let deadline = vlm_service_kit::grpc::grpc_timeout(request.metadata())
            .map(|t| tokio::time::Instant::now() + t);
        let span = tracing::info_span!(
            "vision.encode",
            request_id = %request.get_ref().request_id,
            images = request.get_ref().images.len()
        );
        vlm_service_kit::telemetry::extract(request.metadata(), &span);
        let encoder = self.encoder()?;
        let req = convert::encode_request(request.into_inner()).inspect_err(|e| {
            metrics::counter!("vlm_vision_requests_total", "status" => e.metric_label())
                .increment(1);
        })?;
        let chunks = encoder.encode(req, deadline, span)?;
        let stream = chunks.map(|r| r.map(convert::chunk_to_proto).map_err(Status::from));
        Ok(Response::new(Box::pin(stream)))
    }

    async fn info(
        &self,
        _request: Request<pb::VisionInfoRequest>,
    ) -> Result<Response<pb::VisionInfo>, Status> {
        let mut info = convert::info_to_proto(self.encoder()?.info());
        info.grpc_conn = Some(self.grpc_conn);
        Ok(Response::new(info))
    }
}
