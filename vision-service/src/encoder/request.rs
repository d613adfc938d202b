//! The domain's view of a call: what comes in (images, already decoded from the proto) and what
//! goes out (chunks of raw little-endian rows). No proto types here; `convert` maps both ways.
use std::sync::Arc;

/// Where an image's pixels come from.
#[derive(Debug, Clone)]
pub enum ImageSource {
    /// An image file (PNG, JPEG, WebP, GIF, BMP, TIFF); the service decodes and resizes it.
    Encoded { data: Vec<u8>, mime_type: String },
    /// RGB8 pixels the caller already resized (sides multiples of patch * merge).
    Pixels {
        width: u32,
        height: u32,
        rgb8: Vec<u8>,
        /// A video temporal group's second frame (same layout); empty for an image.
        second_frame: Vec<u8>,
    },
}

/// One image of a request.
#[derive(Debug, Clone)]
pub struct ImageInput {
    pub source: ImageSource,
    /// Echoed on every chunk of the image; may be empty.
    pub content_hash: Vec<u8>,
    /// The grid (t, h, w) the caller expects; refused when the service computes another.
    pub expected_grid: Option<[u32; 3]>,
    /// The request's pixel budget for the resize (within the config's).
    pub budget: vlm_config::PixelBudget,
}

/// Element type of the raw bytes on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WireDtype {
    F32,
    F16,
    Bf16,
}

impl WireDtype {
    pub fn size_in_bytes(self) -> usize {
        match self {
            WireDtype::F32 => 4,
            WireDtype::F16 | WireDtype::Bf16 => 2,
        }
    }

    /// The host dtype of the same name.
    pub fn host(self) -> vlm_compute::HostDtype {
        match self {
            WireDtype::F32 => vlm_compute::HostDtype::F32,
            WireDtype::F16 => vlm_compute::HostDtype::F16,
            WireDtype::Bf16 => vlm_compute::HostDtype::Bf16,
        }
    }

    pub fn from_config(d: vlm_config::Dtype) -> WireDtype {
        match d {
            vlm_config::Dtype::F32 => WireDtype::F32,
            vlm_config::Dtype::F16 => WireDtype::F16,
            vlm_config::Dtype::Bf16 => WireDtype::Bf16,
        }
    }
}

/// A validated-at-the-edge Encode call.
#[derive(Debug, Clone)]
pub struct EncodeRequest {
    pub request_id: String,
    pub images: Vec<ImageInput>,
    /// `None`: the service's compute dtype.
    pub dtype: Option<WireDtype>,
}

/// Rows `[row_start, row_end)` of one image's merged embeddings and of every deepstack level.
#[derive(Debug, Clone, PartialEq)]
pub struct Chunk {
    pub image_index: u32,
    pub content_hash: Arc<Vec<u8>>,
    /// (t, h, w) in raw patches.
    pub grid: [u32; 3],
    pub row_start: u32,
    pub row_end: u32,
    pub total_rows: u32,
    pub hidden_size: u32,
    pub dtype: WireDtype,
    /// (row_end - row_start) x hidden_size values, row-major, little-endian.
    pub embeds: Vec<u8>,
    /// One entry per deepstack level, same layout as `embeds`.
    pub deepstack: Vec<Vec<u8>>,
    /// The ViT bucket (raw patches) the image ran in.
    pub bucket: u32,
}

impl Chunk {
    /// Raw value bytes carried (all levels).
    pub fn payload_bytes(&self) -> usize {
        self.embeds.len() + self.deepstack.iter().map(Vec::len).sum::<usize>()
    }
}
