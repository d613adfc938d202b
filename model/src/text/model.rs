//! `Qwen3VLTextModel` + `lm_head`: token embedding with image rows scattered in, the decoder
//! layers with deepstack injection, final norm, logits of the last position of each row.
use super::attention::{Segment, Step};
use super::batch::{BatchInput, DecodeBatch};
use super::kv_cache::PagedKvCache;
use super::layer::DecoderLayer;
use super::linear::Linear;
use super::norm::RmsNorm;
use super::rope::MRope;
use super::step::{causal_mask, take_rows, AttnRows};
use crate::error::{ModelError, Result};
use crate::kernels::Kernels;
use crate::weights::Weights;
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use std::path::Path;
use vlm_compute::Position3;
use vlm_compute::{DecodeRow, PrefillChunk, Qwen3VlConfig, TextConfig};

/// `embed_tokens`: (vocab, hidden) in the weight storage dtype; looked-up rows are f32. When
/// the checkpoint ties `lm_head` to it, the rows are read from the head's weight (one copy).
#[derive(Debug, Clone)]
enum Embedding {
    Table(Tensor),
    TiedToHead,
}

/// The Qwen3-VL language model (decoder + lm_head). Holds weights only: the KV cache is the
/// caller's ([`PagedKvCache`]). Activations are f32 whatever the weight storage dtype.
#[derive(Debug, Clone)]
pub struct TextModel<K: Kernels> {
    k: K,
    embed_tokens: Embedding,
    layers: Vec<DecoderLayer<K>>,
    norm: RmsNorm,
    lm_head: Linear<K>,
    /// `lm_head` is `embed_tokens` (tie_word_embeddings).
    tied: bool,
    rope: MRope,
    cfg: TextConfig,
    image_token_id: u32,
    video_token_id: u32,
    deepstack_levels: usize,
    weight_dtype: DType,
    /// The KV cache's: the kernels' choice for `weight_dtype`, or FP8 E4M3 by
    /// [`TextModel::with_fp8_kv_cache`].
    kv_dtype: DType,
    /// (values, output rows) of the decoder linears stored int8 (a W8A8 checkpoint: a byte a
    /// value, 8 per output row); the rest are `weight_dtype`.
    int8_linears: (usize, usize),
    /// (values, scales) of the decoder linears stored 4-bit (W4A16).
    int4_linears: (usize, usize),
    /// Values of the decoder linears stored FP8, and the block's input width.
    fp8_linears: (usize, usize),
    device: Device,
}

impl<K: Kernels> TextModel<K> {
    /// Loads the LM part of a checkpoint directory (tensors under `model.language_model` and
    /// `lm_head` only), storing the linear and embedding weights as `dtype` (f32, f16 or bf16).
    pub fn load(k: &K, dir: &Path, dtype: DType) -> Result<TextModel<K>> {
        let cfg = Qwen3VlConfig::from_dir(dir)?;
        let w = Weights::open(dir, dtype, k.device())?;
        Self::from_weights(k, &cfg, w)
    }

    /// Builds the model from a [`VarBuilder`] rooted at the checkpoint's top level; the weight
    /// storage dtype is the builder's.
    pub fn new(k: &K, cfg: &Qwen3VlConfig, vb: VarBuilder<'static>) -> Result<TextModel<K>> {
        Self::from_weights(k, cfg, Weights::new(vb, None))
    }

    /// [`Self::new`] over [`Weights`], which may hold block-quantized linear weights.
    pub fn from_weights(k: &K, cfg: &Qwen3VlConfig, w: Weights) -> Result<TextModel<K>> {
        Self::build(k, cfg, w).map_err(|e| match e {
            ModelError::Candle(c) => ModelError::weights(c.to_string()),
            other => other,
        })
    }

    fn build(k: &K, cfg: &Qwen3VlConfig, w: Weights) -> Result<TextModel<K>> {
        let t = &cfg.text;
        let vb = w.vb().clone();
        let weight_dtype = vb.dtype();
        if !matches!(weight_dtype, DType::F32 | DType::F16 | DType::BF16) {
            return Err(ModelError::invalid(format!(
                "text weight dtype {weight_dtype:?} is not supported (f32, f16, bf16)"
            )));
        }
        if !t.num_attention_heads.is_multiple_of(t.num_key_value_heads)
            || !t.head_dim.is_multiple_of(2)
        {
            return Err(ModelError::weights(format!(
                "{} heads / {} kv heads / head_dim {} is not a valid Qwen3 attention",
                t.num_attention_heads, t.num_key_value_heads, t.head_dim
            )));
        }
        let deepstack_levels = cfg.vision.deepstack_visual_indexes.len();
        if deepstack_levels > t.num_hidden_layers {
            return Err(ModelError::weights(format!(
                "{deepstack_levels} deepstack levels but only {} text layers",
                t.num_hidden_layers
            )));
        }
        let lm = w.pp("model.language_model");
        let layers = (0..t.num_hidden_layers)
            .map(|i| DecoderLayer::new(k, t, lm.pp("layers").pp(i)))
            .collect::<Result<Vec<_>>>()?;
        let norm = RmsNorm::new(t.hidden_size, t.rms_norm_eps, lm.vb().pp("norm"))?;
        let quantized_table = match cfg.tie_word_embeddings {
            true => lm.pp("embed_tokens").quantized("weight")?,
            false => None,
        };
        let (embed_tokens, lm_head) = if let Some(q) = quantized_table {
            // A tied quantized table (GGUF token_embd) stays quantized: the head multiplies
            // by it and embeddings are its rows, dequantized per lookup.
            (Embedding::TiedToHead, Linear::from_quantized(k, q)?)
        } else if cfg.tie_word_embeddings {
            let table = lm
                .vb()
                .pp("embed_tokens")
                .get((t.vocab_size, t.hidden_size), "weight")?
                .contiguous()?;
            // One copy: the head holds the table as the backend wants it and embeddings are
            // looked up in it.
            (Embedding::TiedToHead, Linear::from_weight(k, table)?)
        } else {
            let table = lm
                .vb()
                .pp("embed_tokens")
                .get((t.vocab_size, t.hidden_size), "weight")?
                .contiguous()?;
            (
                Embedding::Table(table),
                Linear::load(k, &w.pp("lm_head"), t.hidden_size, t.vocab_size)?,
            )
        };
        Ok(TextModel {
            k: k.clone(),
            embed_tokens,
            layers,
            norm,
            lm_head,
            tied: cfg.tie_word_embeddings,
            rope: MRope::new(t),
            cfg: t.clone(),
            image_token_id: cfg.image_token_id,
            video_token_id: cfg.video_token_id,
            deepstack_levels,
            weight_dtype,
            kv_dtype: k.kv_dtype(weight_dtype),
            int8_linears: w.layer_int8(),
            int4_linears: w.layer_int4(),
            fp8_linears: w.layer_fp8(),
            device: vb.device().clone(),
        })
    }

    pub fn config(&self) -> &TextConfig {
        &self.cfg
    }
    pub fn device(&self) -> &Device {
        &self.device
    }
    /// Storage dtype of the linear and embedding weights.
    pub fn weight_dtype(&self) -> DType {
        self.weight_dtype
    }
    pub fn image_token_id(&self) -> u32 {
        self.image_token_id
    }
    /// Deepstack levels each image brings (added after text layers 0..levels).
    pub fn deepstack_levels(&self) -> usize {
        self.deepstack_levels
    }

    /// Bytes of the weights as stored (a tied lm_head counted once).
    pub fn weight_bytes(&self) -> usize {
        let t = &self.cfg;
        let s = self.weight_dtype.size_in_bytes();
        let (q, kv) = (
            t.num_attention_heads * t.head_dim,
            t.num_key_value_heads * t.head_dim,
        );
        let values = 2 * t.hidden_size * q
            + 2 * t.hidden_size * kv
            + 3 * t.hidden_size * t.intermediate_size;
        // Int8 linears: a byte a value and 8 a row (scale and row sum, as the CPU holds them).
        let (int8_values, int8_rows) = self.int8_linears;
        // 4-bit linears: half a byte a value and 4 a group scale (as the CPU holds them).
        let (int4_values, int4_scales) = self.int4_linears;
        // FP8 linears: a byte a value and 4 per row and input block (the CPU's scales).
        let (fp8_values, fp8_block) = self.fp8_linears;
        let linears = s
            * (t.num_hidden_layers * values).saturating_sub(int8_values + int4_values + fp8_values)
            + int8_values
            + 8 * int8_rows
            + int4_values / 2
            + 4 * int4_scales
            + fp8_values
            + 4 * (fp8_values / fp8_block.max(1));
        let per_layer = 4 * (2 * t.hidden_size + 2 * t.head_dim);
        let head = if self.tied {
            0
        } else {
            s * t.vocab_size * t.hidden_size
        };
        s * t.vocab_size * t.hidden_size
            + head
            + linears
            + t.num_hidden_layers * per_layer
            + 4 * t.hidden_size
    }

    /// A paged KV cache shaped for this model, on its device, of [`Self::kv_dtype`].
    pub fn new_kv_cache(&self, num_blocks: usize, block_len: usize) -> Result<PagedKvCache> {
        PagedKvCache::new(
            &self.cfg,
            num_blocks,
            block_len,
            self.kv_dtype(),
            &self.device,
        )
    }

    /// The KV cache dtype: the backend's for this model's weight dtype, or FP8 E4M3.
    pub fn kv_dtype(&self) -> DType {
        self.kv_dtype
    }

    /// Keeps the KV cache as FP8 E4M3 codes (the config's `kv_cache_dtype: fp8_e4m3`); only a
    /// backend whose attention reads such a cache calls it.
    pub fn with_fp8_kv_cache(mut self) -> Self {
        self.kv_dtype = DType::F8E4M3;
        self
    }

    /// The backend's kernels.
    pub fn kernels(&self) -> &K {
        &self.k
    }

    /// Token embeddings, ids: n -> (n, hidden) f32 (no image rows).
    pub fn embed_tokens(&self, ids: &[u32]) -> Result<Tensor> {
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
            return Err(ModelError::invalid(format!(
                "token id {bad} is out of the vocabulary (size {})",
                self.cfg.vocab_size
            )));
        }
        match &self.embed_tokens {
            Embedding::Table(w) => {
                let idx = Tensor::new(ids, w.device())?;
                Ok(w.index_select(&idx, 0)?.to_dtype(DType::F32)?)
            }
            Embedding::TiedToHead => self.k.rows_of(self.lm_head.weight(), ids),
        }
    }

    /// One step: writes the step's K/V into `kv` and returns the logits of the last position of
    /// each row, (rows, vocab) f32: one row for a prefill chunk, the bucket size for decode.
    pub fn forward(&self, input: &BatchInput, kv: &mut PagedKvCache) -> Result<Tensor> {
        self.check_cache(kv)?;
        self.k.step(|| match input {
            BatchInput::Prefill(chunk) => self.prefill_chunk(chunk, kv),
            BatchInput::Decode(batch) => self.decode_batch(batch, kv),
        })
    }

    /// One prefill chunk: its K/V written into `kv`, the logits (1, vocab) f32 of its last
    /// token.
    pub fn prefill(&self, c: &PrefillChunk, kv: &mut PagedKvCache) -> Result<Tensor> {
        self.check_cache(kv)?;
        self.k.step(|| self.prefill_chunk(c, kv))
    }

    /// Prefill chunks of several sequences and one decode row of each of `decode` (other
    /// sequences) in one forward: each product reads the weights once for all, so short chunks
    /// and decode rows cost little next to a long one. Returns (chunks.len() + decode.len(),
    /// vocab): each chunk's last-token logits, then the decode rows', what [`Self::prefill`]
    /// and [`Self::decode`] give apart, to the bit where [`Self::row_independent`].
    pub fn packed_step(
        &self,
        chunks: &[PrefillChunk],
        decode: &[DecodeRow],
        kv: &mut PagedKvCache,
    ) -> Result<Tensor> {
        self.check_cache(kv)?;
        self.k.step(|| self.chunk_step(chunks, decode, kv))
    }

    /// Whether the backend computes each row of every product independently of the others
    /// (then a mixed step changes no sequence's numbers; see [`Kernels::row_independent`]).
    pub fn row_independent(&self) -> bool {
        let layers_ok = self.layers.iter().all(|l| l.row_independent());
        layers_ok && self.k.row_independent(self.lm_head.weight())
    }

    /// One decode step of a padded batch: (rows.len(), vocab) f32.
    pub fn decode(&self, d: &DecodeBatch, kv: &mut PagedKvCache) -> Result<Tensor> {
        self.check_cache(kv)?;
        self.k.step(|| self.decode_batch(d, kv))
    }

    fn check_cache(&self, kv: &PagedKvCache) -> Result<()> {
        if kv.num_layers() != self.layers.len() {
            return Err(ModelError::kv_cache(format!(
                "the cache has {} layers, the model {}",
                kv.num_layers(),
                self.layers.len()
            )));
        }
        let (k, _) = kv.layer(0);
        let dims = k.dims();
        if dims[1] != self.cfg.num_key_value_heads || dims[3] != self.cfg.head_dim {
            return Err(ModelError::kv_cache(format!(
                "the cache is shaped {dims:?}, the model has {} kv heads of dim {}",
                self.cfg.num_key_value_heads, self.cfg.head_dim
            )));
        }
        Ok(())
    }

    fn prefill_chunk(&self, c: &PrefillChunk, kv: &PagedKvCache) -> Result<Tensor> {
        self.chunk_step(std::slice::from_ref(c), &[], kv)
    }

    /// Prefill chunks and, after their rows, one decode row for each of `decode` (other
    /// sequences) through the layers together: the logits of each chunk's last token, then of
    /// each decode row, (chunks.len() + decode.len(), vocab).
    fn chunk_step(
        &self,
        chunks: &[PrefillChunk],
        decode: &[DecodeRow],
        kv: &PagedKvCache,
    ) -> Result<Tensor> {
        if chunks.is_empty() && decode.is_empty() {
            return Err(ModelError::invalid(
                "a step needs a prefill chunk or a decode row",
            ));
        }
        for (i, c) in chunks.iter().enumerate() {
            let n = c.tokens.len();
            if n == 0 || c.positions.len() != n {
                return Err(ModelError::invalid(format!(
                    "a prefill chunk needs one position per token ({} tokens, {} positions)",
                    n,
                    c.positions.len()
                )));
            }
            let what = match chunks.len() {
                1 => "prefill chunk".to_string(),
                _ => format!("prefill chunk {i}"),
            };
            kv.check_table(&c.block_table, c.start + n, &what)?;
            self.check_image_rows(c)?;
        }
        for (i, r) in decode.iter().enumerate() {
            kv.check_table(
                &r.block_table,
                r.context_len + 1,
                &format!("decode row {i}"),
            )?;
        }
        let hidden = self.cfg.hidden_size;
        // Row offset of each chunk; the decode rows start at `prefill_rows`.
        let mut offsets = Vec::with_capacity(chunks.len());
        let mut prefill_rows = 0;
        for c in chunks {
            offsets.push(prefill_rows);
            prefill_rows += c.tokens.len();
        }
        let rows = prefill_rows + decode.len();

        // 1. (rows, hidden): token embeddings, image rows replaced by the vision embeddings.
        let tokens: Vec<u32> = chunks
            .iter()
            .flat_map(|c| c.tokens.iter().copied())
            .chain(decode.iter().map(|r| r.token))
            .collect();
        let x = self.embed_tokens(&tokens)?;
        let host_rows = |t: &vlm_compute::HostTensor, start: usize, len: usize| -> Result<Tensor> {
            let mut rows = vec![0f32; len * hidden];
            t.rows_to_f32(start, &mut rows)?;
            Ok(Tensor::from_vec(rows, (len, hidden), &self.device)?)
        };
        let images = || {
            chunks
                .iter()
                .zip(&offsets)
                .flat_map(|(c, &off)| c.images.iter().map(move |r| (off, r)))
        };
        for (off, r) in images() {
            x.slice_set(
                &host_rows(&r.image.embeds, r.src_start, r.len)?,
                0,
                off + r.dst_start,
            )?;
        }
        // 2. Per deepstack level, (rows, hidden) zero except at the image rows.
        let mut deepstack = Vec::new();
        if images().next().is_some() {
            for level in 0..self.deepstack_levels {
                let add = Tensor::zeros((rows, hidden), DType::F32, &self.device)?;
                for (off, r) in images() {
                    let rows = host_rows(&r.image.deepstack[level], r.src_start, r.len)?;
                    add.slice_set(&rows, 0, off + r.dst_start)?;
                }
                deepstack.push(add);
            }
        }
        // 3. layers.
        let positions: Vec<Position3> = chunks
            .iter()
            .flat_map(|c| c.positions.iter().copied())
            .chain(decode.iter().map(|r| [r.position; 3]))
            .collect();
        let (cos, sin) = self.rope.tables(&positions, &self.device)?;
        let masks = chunks
            .iter()
            .map(|c| {
                let n = c.tokens.len();
                (n > 1)
                    .then(|| causal_mask(c.start, n, &self.device))
                    .transpose()
            })
            .collect::<Result<Vec<_>>>()?;
        let decode_rows: Vec<Option<(usize, &[u32])>> = decode
            .iter()
            .map(|r| Some((r.context_len, r.block_table.as_slice())))
            .collect();
        let mut segments: Vec<Segment> = chunks
            .iter()
            .zip(&masks)
            .map(|(c, mask)| Segment {
                rows: c.tokens.len(),
                attn: AttnRows::Chunk {
                    start: c.start,
                    table: &c.block_table,
                    mask: mask.as_ref(),
                },
            })
            .collect();
        if !decode.is_empty() {
            segments.push(Segment {
                rows: decode.len(),
                attn: AttnRows::Decode(&decode_rows),
            });
        }
        let step = Step {
            cos,
            sin,
            segments,
            kv,
        };
        // The rows whose logits are read: each chunk's last, then the decode rows. The last
        // layer runs the o projection and the MLP on those alone.
        let keep: Vec<usize> = chunks
            .iter()
            .zip(&offsets)
            .map(|(c, &off)| off + c.tokens.len() - 1)
            .chain(prefill_rows..rows)
            .collect();
        let last = self.layers.len().saturating_sub(1);
        let mut x = x;
        for (i, layer) in self.layers.iter().enumerate() {
            x = if i == last {
                layer.forward_rows(&x, &step, i, &keep)?
            } else {
                layer.forward(&x, &step, i)?
            };
            if let Some(add) = deepstack.get(i) {
                x = if i == last {
                    self.k.add(&x, &take_rows(add, &keep)?)?
                } else {
                    self.k.add(&x, add)?
                };
            }
        }
        // 4. (keep.len(), vocab); with no layers, x still holds every row.
        if self.layers.is_empty() {
            x = take_rows(&x, &keep)?;
        }
        self.logits(&x)
    }

    /// The chunk's image rows must be in bounds, not overlap, and cover exactly the rows whose
    /// token is the image token.
    fn check_image_rows(&self, c: &PrefillChunk) -> Result<()> {
        let n = c.tokens.len();
        let hidden = self.cfg.hidden_size;
        let mut covered = vec![false; n];
        for (k, r) in c.images.iter().enumerate() {
            let img = &r.image;
            if img.embeds.shape() != [img.tokens(), hidden] {
                return Err(ModelError::invalid(format!(
                    "image rows {k}: embeddings shaped {:?}, expected (tokens, {hidden})",
                    img.embeds.shape()
                )));
            }
            if img.deepstack.len() != self.deepstack_levels
                || img
                    .deepstack
                    .iter()
                    .any(|d| d.shape() != img.embeds.shape())
            {
                return Err(ModelError::invalid(format!(
                    "image rows {k}: {} deepstack features, the model takes {} shaped like the embeddings",
                    img.deepstack.len(),
                    self.deepstack_levels
                )));
            }
            if r.len == 0 || r.src_start + r.len > img.tokens() || r.dst_start + r.len > n {
                return Err(ModelError::invalid(format!(
                    "image rows {k}: rows {}..{} of a {}-token image into chunk rows {}..{} of {n}",
                    r.src_start,
                    r.src_start + r.len,
                    img.tokens(),
                    r.dst_start,
                    r.dst_start + r.len
                )));
            }
            for row in &mut covered[r.dst_start..r.dst_start + r.len] {
                if *row {
                    return Err(ModelError::invalid(format!(
                        "image rows {k} overlap another image"
                    )));
                }
                *row = true;
            }
        }
        // Images fill `<|image_pad|>` rows, video temporal groups `<|video_pad|>` rows.
        let vision = |t: u32| t == self.image_token_id || t == self.video_token_id;
        if let Some(i) = (0..n).find(|&i| covered[i] != vision(c.tokens[i])) {
            return Err(ModelError::invalid(format!(
                "chunk row {i} (token {} at cache index {}) is {} but {} by image embeddings; the \
                 image rows must cover exactly the image and video tokens (ids {}, {})",
                c.tokens[i],
                c.start + i,
                if vision(c.tokens[i]) {
                    "an image token"
                } else {
                    "a text token"
                },
                if covered[i] { "covered" } else { "not covered" },
                self.image_token_id,
                self.video_token_id
            )));
        }
        Ok(())
    }

    fn decode_batch(&self, d: &DecodeBatch, kv: &PagedKvCache) -> Result<Tensor> {
        let b = d.rows.len();
        if b == 0 {
            return Err(ModelError::invalid("a decode step needs at least one row"));
        }
        let mut tokens = Vec::with_capacity(b);
        let mut positions: Vec<Position3> = Vec::with_capacity(b);
        let mut rows = Vec::with_capacity(b);
        for (i, row) in d.rows.iter().enumerate() {
            match row {
                Some(r) => {
                    kv.check_table(
                        &r.block_table,
                        r.context_len + 1,
                        &format!("decode row {i}"),
                    )?;
                    tokens.push(r.token);
                    positions.push([r.position; 3]);
                    rows.push(Some((r.context_len, r.block_table.as_slice())));
                }
                None => {
                    tokens.push(0);
                    positions.push([0; 3]);
                    rows.push(None);
                }
            }
        }
        let x = self.embed_tokens(&tokens)?; // (b, hidden)
        let (cos, sin) = self.rope.tables(&positions, &self.device)?;
        let step = Step {
            cos,
            sin,
            segments: vec![Segment {
                rows: b,
                attn: AttnRows::Decode(&rows),
            }],
            kv,
        };
        let mut x = x;
        for (i, layer) in self.layers.iter().enumerate() {
            x = layer.forward(&x, &step, i)?;
        }
        self.logits(&x)
    }

    /// x: (rows, hidden) -> (rows, vocab) f32.
    fn logits(&self, x: &Tensor) -> Result<Tensor> {
        self.lm_head.forward(&self.norm.forward(&self.k, x)?)
    }
}
