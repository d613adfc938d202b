//! Request bodies (PNG images, gRPC Generate) and a gRPC generation read to its end.
use vlm_proto::v1 as pb;

/// A noisy RGB PNG of `w` x `h`.
pub fn png(w: u32, h: u32, seed: u8) -> Vec<u8> {
    let img = image::RgbImage::from_fn(w, h, |x, y| {
        image::Rgb([
            (x as u8).wrapping_mul(3).wrapping_add(seed),
            (y as u8).wrapping_mul(5),
            seed.wrapping_mul(7) ^ (x ^ y) as u8,
        ])
    });
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    out.into_inner()
}

/// A one-colour image: large in pixels, small in bytes.
pub fn png_flat(w: u32, h: u32) -> Vec<u8> {
    let img = image::RgbImage::from_pixel(w, h, image::Rgb([90, 120, 200]));
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    out.into_inner()
}

/// One user message: the images, then `text`; greedy, at most `max_tokens`.
pub fn grpc_request(images: &[Vec<u8>], text: &str, max_tokens: u32) -> pb::GenerateRequest {
    use pb::content_part::Part;
    let mut content: Vec<pb::ContentPart> = images
        .iter()
        .map(|d| pb::ContentPart {
            part: Some(Part::Image(pb::ImagePart {
                data: d.clone(),
                mime_type: "image/png".into(),
                ..Default::default()
            })),
        })
        .collect();
    content.push(pb::ContentPart {
        part: Some(Part::Text(text.into())),
    });
    pb::GenerateRequest {
        messages: vec![pb::ChatMessage {
            role: "user".into(),
            content,
        }],
        sampling: Some(pb::SamplingParams {
            max_tokens,
            temperature: 0.0,
            ..Default::default()
        }),
        model: String::new(),
    }
}

/// Collected output of one gRPC generation.
#[derive(Debug, Default)]
pub struct Output {
    pub text: String,
    pub tokens: Vec<u32>,
    pub finish: i32,
    pub usage: pb::Usage,
    /// One per token when the request asked for logprobs.
    pub logprobs: Vec<pb::TokenLogprob>,
}

/// Gateway.Generate, read to the end.
pub async fn generate(addr: &str, req: pb::GenerateRequest) -> Result<Output, tonic::Status> {
    let mut client = pb::gateway_client::GatewayClient::new(channel(addr).await)
        .max_decoding_message_size(64 << 20);
    let mut stream = client.generate(req).await?.into_inner();
    let mut out = Output::default();
    while let Some(m) = stream.message().await? {
        out.text.push_str(&m.text);
        out.tokens.extend(m.token_ids);
        out.logprobs.extend(m.logprobs);
        if m.finish_reason != 0 {
            out.finish = m.finish_reason;
            out.usage = m.usage.unwrap_or_default();
        }
    }
    Ok(out)
}

// ---------------------------------------------------------------- HTTP

pub async fn channel(addr: &str) -> tonic::transport::Channel {
    tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

/// A user message's content: each image as a `data:` URL, then the text.
/// `bytes` as a `data:` URL of type `mime`.
pub fn data_url(mime: &str, bytes: &[u8]) -> String {
    use base64::Engine;
    format!(
        "data:{mime};base64,{}",
        base64::engine::general_purpose::STANDARD.encode(bytes)
    )
}

pub fn user_parts(images: &[Vec<u8>], text: &str) -> Vec<serde_json::Value> {
    use base64::Engine;
    let mut parts: Vec<serde_json::Value> = images
        .iter()
        .map(|d| {
            let b64 = base64::engine::general_purpose::STANDARD.encode(d);
            serde_json::json!({"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{b64}")}})
        })
        .collect();
    parts.push(serde_json::json!({"type": "text", "text": text}));
    parts
}
