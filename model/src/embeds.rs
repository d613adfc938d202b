//! Image embeddings as they travel from the ViT to the LM.
use candle_core::Tensor;

/// The ViT's output for one image: the merged embeddings that replace the image's
/// `<|image_pad|>` tokens, and one deepstack feature per level, added to the output of text
/// layer k at the same rows (reference: `Qwen3VLModel.get_image_features`,
/// `Qwen3VLTextModel._deepstack_process`).
#[derive(Debug, Clone)]
pub struct ImageEmbeds {
    /// (tokens, out_hidden) where tokens = t*h*w / merge^2.
    pub embeds: Tensor,
    /// Per deepstack level, (tokens, out_hidden).
    pub deepstack: Vec<Tensor>,
    /// `image_grid_thw` in raw patches.
    pub grid_thw: [usize; 3],
}

impl ImageEmbeds {
    pub fn tokens(&self) -> usize {
        self.embeds.dims().first().copied().unwrap_or(0)
    }
}
