//! A request message over the gRPC port's decoding limit is answered RESOURCE_EXHAUSTED, the
//! code the gRPC spec gives a message larger than the configured maximum (`statuscodes.md`);
//! tonic's decoder says OUT_OF_RANGE. [`OversizeIsResourceExhausted`] rewrites that one answer
//! (tonic sends it as a trailers-only response: the status is in the headers).
//! [`super::GrpcServer::add_service`] wraps every service in it, so the three services' ports
//! answer alike.
use std::convert::Infallible;
use tonic::codegen::http::{HeaderValue, Request, Response};
use tonic::codegen::{Context, Poll, Service};
use tonic::server::NamedService;

/// The start of tonic's message for a request over `max_decoding_message_size`, as sent
/// (percent-encoded) in `grpc-message`.
const TOO_LARGE: &str = "Error,%20decoded%20message%20length%20too%20large";

/// Wraps a gRPC service; see the module docs.
#[derive(Debug, Clone)]
pub struct OversizeIsResourceExhausted<S>(pub S);

impl<S: NamedService> NamedService for OversizeIsResourceExhausted<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, B, RB> Service<Request<B>> for OversizeIsResourceExhausted<S>
where
    S: Service<Request<B>, Response = Response<RB>, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = Response<RB>;
    type Error = Infallible;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Response<RB>, Infallible>> + Send>,
    >;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let answer = self.0.call(req);
        Box::pin(async move {
            let mut resp = answer.await?;
            rewrite(resp.headers_mut());
            Ok(resp)
        })
    }
}

fn rewrite(h: &mut tonic::codegen::http::HeaderMap) {
    let out_of_range = h.get("grpc-status").is_some_and(|s| s.as_bytes() == b"11");
    let too_large = h
        .get("grpc-message")
        .and_then(|m| m.to_str().ok())
        .is_some_and(|m| m.starts_with(TOO_LARGE));
    if out_of_range && too_large {
        h.insert(
            "grpc-status",
            HeaderValue::from(tonic::Code::ResourceExhausted as i32),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_decoders_size_refusal_is_rewritten() {
        let headers = |status: tonic::Status| {
            let mut h = tonic::codegen::http::HeaderMap::new();
            status.add_header(&mut h).unwrap();
            rewrite(&mut h);
            h.get("grpc-status").unwrap().to_str().unwrap().to_string()
        };
        let too_large = tonic::Status::out_of_range(
            "Error, decoded message length too large: found 70000000 bytes, the limit is: 67108864 bytes",
        );
        assert_eq!(headers(too_large), "8");
        assert_eq!(headers(tonic::Status::out_of_range("other")), "11");
        assert_eq!(headers(tonic::Status::invalid_argument("x")), "3");
    }
}
