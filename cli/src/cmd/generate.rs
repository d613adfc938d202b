//! `vlm generate`: a gRPC client of the gateway that prints the text as it arrives.
use anyhow::Context;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use vlm_proto::v1::{
    content_part::Part, gateway_client::GatewayClient, ChatMessage, ContentPart, FinishReason,
    GenerateRequest, ImagePart, SamplingParams,
};

#[derive(clap::Args, Debug)]
pub struct GenerateArgs {
    /// The gateway's gRPC address (host:port or http://host:port).
    #[arg(long, env = "VLM_GATEWAY", default_value = "127.0.0.1:50051")]
    pub gateway: String,
    /// An image file to put before the prompt (repeatable, in order).
    #[arg(long)]
    pub image: Vec<PathBuf>,
    /// Most tokens to generate (0 = the rest of the context).
    #[arg(long, default_value_t = 128)]
    pub max_tokens: u32,
    /// Softmax temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long)]
    pub top_p: Option<f32>,
    #[arg(long)]
    pub top_k: Option<u32>,
    /// Seed of the sampler.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop string (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// A system message.
    #[arg(long)]
    pub system: Option<String>,
    /// Print the generated token ids after the text.
    #[arg(long)]
    pub show_tokens: bool,
    /// API key, sent as `authorization: Bearer KEY`.
    #[arg(long, env = "VLM_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// The user's prompt.
    pub prompt: String,
}

pub fn run(args: GenerateArgs) -> anyhow::Result<ExitCode> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(generate(args))
}

/// The request `vlm generate` sends.
pub fn request(args: &GenerateArgs) -> anyhow::Result<GenerateRequest> {
    let mut content = Vec::new();
    for p in &args.image {
        let data = std::fs::read(p).with_context(|| format!("reading image {}", p.display()))?;
        content.push(ContentPart {
            part: Some(Part::Image(ImagePart {
                data,
                mime_type: String::new(),
                ..Default::default()
            })),
        });
    }
    content.push(ContentPart {
        part: Some(Part::Text(args.prompt.clone())),
    });
    let mut messages = Vec::new();
    if let Some(s) = &args.system {
        messages.push(ChatMessage {
            role: "system".into(),
            content: vec![ContentPart {
                part: Some(Part::Text(s.clone())),
            }],
        });
    }
    messages.push(ChatMessage {
        role: "user".into(),
        content,
    });
    Ok(GenerateRequest {
        messages,
        sampling: Some(SamplingParams {
            max_tokens: args.max_tokens,
            temperature: args.temperature,
            top_p: args.top_p.unwrap_or(0.0),
            top_k: args.top_k.unwrap_or(0),
            seed: args.seed,
            stop: args.stop.clone(),
            ..Default::default()
        }),
        model: String::new(),
    })
}

async fn generate(args: GenerateArgs) -> anyhow::Result<ExitCode> {
    let url = if args.gateway.starts_with("http") {
        args.gateway.clone()
    } else {
        format!("http://{}", args.gateway)
    };
    let channel = tonic::transport::Endpoint::from_shared(url.clone())?
        .connect()
        .await
        .with_context(|| format!("connecting to the gateway at {url}"))?;
    let mut client = GatewayClient::new(channel)
        .max_decoding_message_size(64 << 20)
        .max_encoding_message_size(256 << 20);
    let mut req = tonic::Request::new(request(&args)?);
    if let Some(k) = &args.api_key {
        req.metadata_mut().insert(
            "authorization",
            format!("Bearer {k}")
                .parse()
                .context("API key is not valid ASCII")?,
        );
    }
    let mut stream = match client.generate(req).await {
        Ok(r) => r.into_inner(),
        Err(s) => {
            eprintln!("error: {:?}: {}", s.code(), s.message());
            return Ok(ExitCode::FAILURE);
        }
    };
    let mut out = std::io::stdout().lock();
    let mut tokens = Vec::new();
    let mut last = None;
    loop {
        match stream.message().await {
            Ok(Some(m)) => {
                out.write_all(m.text.as_bytes())?;
                out.flush()?;
                tokens.extend_from_slice(&m.token_ids);
                if m.finish_reason != FinishReason::Unspecified as i32 {
                    last = Some(m);
                }
            }
            Ok(None) => break,
            Err(s) => {
                writeln!(out)?;
                eprintln!("error: {:?}: {}", s.code(), s.message());
                return Ok(ExitCode::FAILURE);
            }
        }
    }
    writeln!(out)?;
    if args.show_tokens {
        writeln!(out, "tokens: {tokens:?}")?;
    }
    if let Some(m) = last {
        let reason = FinishReason::try_from(m.finish_reason)
            .map(|r| r.as_str_name())
            .unwrap_or("?");
        let u = m.usage.unwrap_or_default();
        eprintln!(
            "[{}] finish={reason} prompt_tokens={} (images {}) completion_tokens={}",
            m.request_id, u.prompt_tokens, u.image_tokens, u.completion_tokens
        );
    }
    Ok(ExitCode::SUCCESS)
}
