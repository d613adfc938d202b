//! Image embeddings as they travel from the ViT to the LM, on the host.
use crate::tensor::HostTensor;

/// The ViT's output for one image: the merged embeddings that replace the image's
/// `<|image_pad|>` tokens, and one deepstack feature per level, added to the output of text
/// layer k at the same rows (reference: `Qwen3VLModel.get_image_features`,
/// `Qwen3VLTextModel._deepstack_process`).
#[derive(Debug, Clone, PartialEq)]
pub struct ImageEmbeds {
    /// (tokens, out_hidden) where tokens = t*h*w / merge^2.
    pub embeds: HostTensor,
    /// Per deepstack level, (tokens, out_hidden).
    pub deepstack: Vec<HostTensor>,
    /// `image_grid_thw` in raw patches.
    pub grid_thw: [usize; 3],
}

impl ImageEmbeds {
    pub fn tokens(&self) -> usize {
        self.embeds.rows()
    }
    /// Bytes held (embeddings and every deepstack level).
    pub fn byte_len(&self) -> usize {
        self.embeds.byte_len() + self.deepstack.iter().map(|d| d.byte_len()).sum::<usize>()
    }
}
