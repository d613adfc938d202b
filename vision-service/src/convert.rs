//! The only place that touches the generated `vlm.v1` types: proto -> domain for requests,
//! domain -> proto for chunks and info, and the caller's deadline from gRPC metadata.
use crate::encoder::request::{Chunk, EncodeRequest, ImageInput, ImageSource, WireDtype};
use crate::encoder::Info;
use crate::error::VisionError;
use vlm_proto::v1 as pb;

/// The wire dtype asked for; `None` for UNSPECIFIED.
fn dtype_from_proto(value: i32) -> Result<Option<WireDtype>, VisionError> {
    match pb::DType::try_from(value) {
        Ok(pb::DType::DtypeUnspecified) => Ok(None),
        Ok(pb::DType::DtypeF32) => Ok(Some(WireDtype::F32)),
        Ok(pb::DType::DtypeF16) => Ok(Some(WireDtype::F16)),
        Ok(pb::DType::DtypeBf16) => Ok(Some(WireDtype::Bf16)),
        Err(_) => Err(VisionError::invalid_request(format!(
            "dtype {value} is not a vlm.v1.DType (use DTYPE_F32, DTYPE_F16 or DTYPE_BF16)"
        ))),
    }
}

pub fn dtype_to_proto(d: WireDtype) -> pb::DType {
    match d {
        WireDtype::F32 => pb::DType::DtypeF32,
        WireDtype::F16 => pb::DType::DtypeF16,
        WireDtype::Bf16 => pb::DType::DtypeBf16,
    }
}

/// An Encode request in domain terms. Structural problems (no source) are refused here; the
/// image checks proper are the encoder's.
pub fn encode_request(req: pb::EncodeRequest) -> Result<EncodeRequest, VisionError> {
    let dtype = dtype_from_proto(req.dtype)?;
    let images = req
        .images
        .into_iter()
        .enumerate()
        .map(|(i, img)| {
            let source = match img.source {
                Some(pb::image_input::Source::Encoded(e)) => ImageSource::Encoded {
                    data: e.data,
                    mime_type: e.mime_type,
                },
                Some(pb::image_input::Source::Pixels(p)) => ImageSource::Pixels {
                    width: p.width,
                    height: p.height,
                    rgb8: p.rgb8,
                    second_frame: p.second_frame,
                },
                None => {
                    return Err(VisionError::invalid(
                        i,
                        "no image source: set `encoded` or `pixels`",
                    ))
                }
            };
            Ok(ImageInput {
                source,
                content_hash: img.content_hash,
                expected_grid: img.expected_grid.map(|g| [g.t, g.h, g.w]),
                budget: vlm_config::PixelBudget {
                    min_pixels: (img.min_pixels > 0).then_some(img.min_pixels),
                    max_pixels: (img.max_pixels > 0).then_some(img.max_pixels),
                },
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(EncodeRequest {
        request_id: req.request_id,
        images,
        dtype,
    })
}

pub fn chunk_to_proto(c: Chunk) -> pb::EmbeddingChunk {
    pb::EmbeddingChunk {
        image_index: c.image_index,
        content_hash: c.content_hash.as_ref().clone(),
        grid: Some(pb::ImageGrid {
            t: c.grid[0],
            h: c.grid[1],
            w: c.grid[2],
        }),
        row_start: c.row_start,
        row_end: c.row_end,
        total_rows: c.total_rows,
        hidden_size: c.hidden_size,
        dtype: dtype_to_proto(c.dtype) as i32,
        embeds: c.embeds,
        deepstack: c.deepstack,
        bucket: c.bucket,
    }
}

pub fn info_to_proto(info: Info) -> pb::VisionInfo {
    let f = info.fixed;
    pb::VisionInfo {
        model_id: f.model_id,
        buckets: f.buckets,
        patch_size: f.patch_size,
        spatial_merge_size: f.spatial_merge_size,
        temporal_patch_size: f.temporal_patch_size,
        out_hidden_size: f.out_hidden_size,
        deepstack_levels: f.deepstack_levels,
        dtype: dtype_to_proto(f.dtype) as i32,
        device: f.device,
        min_pixels: f.min_pixels,
        max_pixels: f.max_pixels,
        oversize: f.oversize.to_string(),
        queue_capacity: f.queue_capacity,
        queue_depth: info.queue_depth,
        images_in_flight: info.images_in_flight,
        backend: Some(vlm_service_kit::backend_info::to_proto(
            f.backend.backend,
            &f.backend.device,
            &f.backend.kernels,
        )),
        spread_lone_images: f.spread_lone_images,
        embed_cache_bytes: info.embed_cache.capacity_bytes,
        embed_cache_used_bytes: info.embed_cache.used_bytes,
        embed_cache_hits: info.embed_cache.hits,
        embed_cache_misses: info.embed_cache.misses,
        images_waiting: info.images_waiting,
        max_waiting_images: f.max_waiting_images,
        grpc_conn: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_without_a_source_names_the_image() {
        let req = pb::EncodeRequest {
            request_id: "r".into(),
            images: vec![pb::ImageInput::default(), pb::ImageInput::default()],
            dtype: 0,
        };
        let e = encode_request(req).unwrap_err();
        assert!(e.to_string().starts_with("image 0: no image source"), "{e}");
        let bad = pb::EncodeRequest {
            request_id: "r".into(),
            images: vec![],
            dtype: 9,
        };
        assert!(encode_request(bad)
            .unwrap_err()
            .to_string()
            .contains("dtype 9"));
    }
}
