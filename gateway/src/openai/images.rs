//! Image parts: `data:` URLs decoded, http(s) URLs checked against the allow-list and fetched,
//! and OpenAI's `detail` as a pixel budget.
use crate::error::GatewayError;
use crate::fetch::{ImageFetcher, Target};
use crate::validation::InputPart;
use base64::Engine;
use bytes::Bytes;
use vlm_config::PixelBudget;

/// OpenAI's `detail: "low"`: at most a 512x512 image (256 image tokens on Qwen3-VL).
pub const LOW_DETAIL_PIXELS: u64 = 512 * 512;

/// An image part's budget: the request's, with OpenAI's `detail` (`low`: at most
/// [`LOW_DETAIL_PIXELS`]; `high`: up to the server's max_pixels; `auto`: the request's, else
/// the server's resolution rules).
pub(crate) fn detail_budget(
    detail: Option<&str>,
    request: PixelBudget,
    param: &str,
) -> Result<PixelBudget, GatewayError> {
    match detail {
        None | Some("auto") => Ok(request),
        Some("low") => Ok(PixelBudget {
            max_pixels: Some(
                request
                    .max_pixels
                    .map_or(LOW_DETAIL_PIXELS, |m| m.min(LOW_DETAIL_PIXELS)),
            ),
            min_pixels: request.min_pixels.map(|m| m.min(LOW_DETAIL_PIXELS)),
        }),
        Some("high") => Ok(PixelBudget {
            max_pixels: Some(request.max_pixels.unwrap_or(u64::MAX)),
            ..request
        }),
        Some(d) => Err(GatewayError::param(
            param,
            format!("{param} {d:?} is not one of low, high, auto"),
        )),
    }
}

pub(crate) fn with_budget(part: InputPart, budget: PixelBudget) -> InputPart {
    match part {
        InputPart::Image {
            data, mime_type, ..
        } => InputPart::Image {
            data,
            mime_type,
            budget,
        },
        text => text,
    }
}

/// Decodes a `data:` URL.
pub fn image_from_data_url(url: &str) -> Result<InputPart, GatewayError> {
    let (mime_type, data) = decode_data_url(url, "image_url", "data:image/png;base64,...")?;
    Ok(InputPart::Image {
        data,
        mime_type,
        budget: Default::default(),
    })
}

/// The MIME type and bytes of a base64 `data:` URL; `what` names the field in errors and
/// `example` shows the expected form.
pub(crate) fn decode_data_url(
    url: &str,
    what: &str,
    example: &str,
) -> Result<(String, Bytes), GatewayError> {
    let rest = url.strip_prefix("data:").ok_or_else(|| {
        GatewayError::validation(format!("{what} must be a data: URL ({example})"))
    })?;
    let (meta, data) = rest.split_once(',').ok_or_else(|| {
        GatewayError::validation(format!("{what} data: URL has no ',' before the data"))
    })?;
    let mime = meta.split(';').next().unwrap_or("").to_string();
    if !meta.split(';').any(|p| p == "base64") {
        return Err(GatewayError::validation(format!(
            "{what} data: URL must be base64 ({example})"
        )));
    }
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(data.trim())
        .map_err(|e| {
            GatewayError::validation(format!("{what} data: URL is not valid base64: {e}"))
        })?;
    Ok((mime, bytes.into()))
}

/// Where an `image_url` part's bytes come from.
#[derive(Debug)]
pub enum ImageSource {
    /// A `data:` URL, already decoded.
    Inline(InputPart),
    /// An http(s) URL on an allow-listed host, not fetched yet.
    Remote(Target),
}

/// The synchronous part of an `image_url`: a `data:` URL is decoded; an http(s) URL is checked
/// against the scheme and the allow-list (refused at once when the host is not listed).
pub fn image_source(url: &str, fetcher: &ImageFetcher) -> Result<ImageSource, GatewayError> {
    if url.starts_with("data:") {
        return image_from_data_url(url).map(ImageSource::Inline);
    }
    fetcher.check(url).map(ImageSource::Remote)
}

/// An `image_url` to image bytes: `data:` URLs decoded, allow-listed http URLs fetched under
/// the fetcher's byte and time limits.
pub async fn image_from_url(url: &str, fetcher: &ImageFetcher) -> Result<InputPart, GatewayError> {
    match image_source(url, fetcher)? {
        ImageSource::Inline(p) => Ok(p),
        ImageSource::Remote(t) => fetch_part(fetcher, &t).await,
    }
}

pub(crate) async fn fetch_part(
    fetcher: &ImageFetcher,
    t: &Target,
) -> Result<InputPart, GatewayError> {
    let f = fetcher.fetch_target(t).await?;
    Ok(InputPart::Image {
        data: f.data,
        mime_type: f.mime_type,
        budget: Default::default(),
    })
}
