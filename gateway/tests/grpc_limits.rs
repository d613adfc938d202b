//! The gateway's gRPC port as `bind` and `serve` run it (in process, no replicas): a request
//! message over the decoding limit is RESOURCE_EXHAUSTED, the gRPC spec's code for a message
//! larger than the configured maximum (issue 42); smaller ones are served as before.
mod support;

use std::time::Duration;
use vlm_gateway::admission::AdmissionLimits;
use vlm_gateway::auth::ApiKeys;
use vlm_gateway::fetch::FetchOptions;
use vlm_gateway::routing::{ReplicaSource, RoutingOptions};
use vlm_gateway::{video, GatewayConfig};
use vlm_proto::v1 as pb;

fn request(image_bytes: usize) -> pb::GenerateRequest {
    use pb::content_part::Part;
    pb::GenerateRequest {
        messages: vec![pb::ChatMessage {
            role: "user".into(),
            content: vec![
                pb::ContentPart {
                    part: Some(Part::Image(pb::ImagePart {
                        data: vec![7u8; image_bytes],
                        mime_type: "image/png".into(),
                        ..Default::default()
                    })),
                },
                pb::ContentPart {
                    part: Some(Part::Text("what is it?".into())),
                },
            ],
        }],
        sampling: Some(pb::SamplingParams {
            max_tokens: 4,
            ..Default::default()
        }),
        model: String::new(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_over_the_limit_is_resource_exhausted() {
    let (_validator, dir) = support::tiny_validator();
    let cfg = GatewayConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        http_listen: "127.0.0.1:0".parse().unwrap(),
        lm: ReplicaSource::Static(vec![]),
        vision: ReplicaSource::Static(vec![]),
        model_dir: dir.path().to_path_buf(),
        deploy: vlm_config::DeployConfig::default_config(),
        api_keys: ApiKeys::load(None, None).unwrap(),
        admission: AdmissionLimits {
            max_in_flight: 4,
            max_queue: 4,
            max_kv_tokens: 0,
        },
        max_images: 2,
        // The decoding limit is max(4 x this, 64 MiB): 64 MiB.
        max_body_bytes: 1 << 20,
        max_videos: video::DEFAULT_MAX_VIDEOS,
        max_video_frames: video::DEFAULT_MAX_VIDEO_FRAMES,
        max_video_source_frames: video::DEFAULT_MAX_VIDEO_SOURCE_FRAMES,
        video_decode_threads: video::DEFAULT_VIDEO_DECODE_THREADS,
        media_decoding: vlm_preprocess::worker::MediaDecoding::InProcess,
        control_tokens_in_content: false,
        generation_config: Default::default(),
        internal_token: None,
        internal_tls: None,
        grpc_conn: Default::default(),
        image_fetch: FetchOptions::deny_all(),
        routing: RoutingOptions::default(),
        http: Default::default(),
        cors: Default::default(),
    };
    let bound = vlm_gateway::bind(cfg).await.unwrap();
    let addr = bound.grpc_addr;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(bound.serve(async {
        let _ = stopped.await;
    }));
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client =
        pb::gateway_client::GatewayClient::new(channel).max_encoding_message_size(usize::MAX);

    let e = client.generate(request(65 << 20)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("too large"), "{e:?}");
    // Under the limit: past the transport, refused by the gateway's own checks (1 MiB bodies).
    let e = client.generate(request(2 << 20)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("--max-body-bytes"), "{e:?}");

    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(30), served)
        .await
        .expect("the gateway drained")
        .unwrap()
        .unwrap();
}
