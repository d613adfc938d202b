//! The tonic adapter: decode the request, call the plain async function, map the error.
use crate::convert;
use crate::generate::{self, Context};
use futures::{Stream, StreamExt};
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::time::Instant;
use tonic::{Request, Response, Status};
use tracing::Instrument;
use vlm_proto as pb;

/// The `vlm.v1.Lm` handlers. The context is set once the engine has warmed up; until then
/// every call is UNAVAILABLE (and health says NOT_SERVING).
pub struct LmService {
    ctx: Arc<OnceLock<Arc<Context>>>,
    /// What `Info` reports of the gRPC port's connection options.
    grpc_conn: pb::GrpcConnInfo,
}

impl LmService {
    pub fn new(ctx: Arc<OnceLock<Arc<Context>>>) -> Self {
        LmService {
            ctx,
            grpc_conn: vlm_service_kit::conn::GrpcConnOptions::default().info(),
        }
    }

    /// `Info` reports `grpc_conn` (the `--grpc-*` flags the server runs with).
    pub fn with_grpc_conn(mut self, grpc_conn: pb::GrpcConnInfo) -> Self {
        self.grpc_conn = grpc_conn;
        self
    }

    fn ctx(&self) -> Result<&Arc<Context>, Status> {
        self.ctx.get().ok_or_else(|| {
            Status::unavailable("the LM service is loading the model and warming up its graphs")
        })
    }
}

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::TokenEvent, Status>> + Send>>;

#[tonic::async_trait]
impl pb::lm_server::Lm for LmService {
    type GenerateStream = EventStream;

    async fn generate(
        &self,
        request: Request<pb::LmGenerateRequest>,
    ) -> Result<Response<EventStream>, Status> {
        let deadline =
            vlm_service_kit::grpc::grpc_timeout(request.metadata()).map(|d| Instant::now() + d);
        let span = tracing::info_span!(
            "generate",
            request_id = tracing::field::Empty,
            prompt_tokens = tracing::field::Empty,
            // The decode graph (decoder batch bucket) of the sequence's latest step.
            graph = tracing::field::Empty
        );
        vlm_service_kit::telemetry::extract(request.metadata(), &span);
        let req = request.into_inner();
        span.record("request_id", req.request_id.as_str());
        span.record("prompt_tokens", req.input_ids.len());
        let input = convert::generate_input(req, deadline);
        let ctx = self.ctx()?;
        let rx = generate::generate(ctx, input, span.clone())
            .instrument(span.clone())
            .await
            .map_err(|e| {
                tracing::info!(parent: &span, error = %e, kind = e.kind(), "generate refused");
                Status::from(e)
            })?;
        let stream = crate::coalesce::coalesced(rx)
            .map(|r| r.map(convert::token_event).map_err(Status::from));
        Ok(Response::new(Box::pin(stream)))
    }

    async fn info(&self, _: Request<pb::LmInfoRequest>) -> Result<Response<pb::LmInfo>, Status> {
        let mut info = convert::info(self.ctx()?.engine.info());
        info.grpc_conn = Some(self.grpc_conn);
        Ok(Response::new(info))
    }

    async fn load(&self, _: Request<pb::LoadRequest>) -> Result<Response<pb::LoadReport>, Status> {
        let ctx = self.ctx()?;
        Ok(Response::new(convert::load(
            ctx.engine.load(),
            ctx.is_draining(),
        )))
    }
}
