//! One image's outputs cut into wire chunks: row ranges of the merged embeddings and of every
//! deepstack level together, each chunk at most `max_bytes` of raw little-endian values.
use super::request::{Chunk, WireDtype};
use std::sync::Arc;
use vlm_compute::{ComputeError, ImageEmbeds};

/// Most raw value bytes in one chunk (all levels together): 1 MiB.
pub const MAX_CHUNK_BYTES: usize = 1 << 20;

/// Rows per chunk so that `rows * bytes_per_row <= max_bytes` (at least one row).
pub fn rows_per_chunk(bytes_per_row: usize, max_bytes: usize) -> usize {
    (max_bytes / bytes_per_row.max(1)).max(1)
}

/// Where the chunks of one image go: its index, hash, grid and bucket.
#[derive(Debug, Clone)]
pub struct ChunkHeader {
    pub image_index: u32,
    pub content_hash: Arc<Vec<u8>>,
    pub grid: [u32; 3],
    pub bucket: u32,
}

/// Cuts `out` into chunks of at most `max_bytes` raw bytes (all levels of a row range in the
/// same chunk).
pub fn to_chunks(
    header: &ChunkHeader,
    out: &ImageEmbeds,
    dtype: WireDtype,
    max_bytes: usize,
) -> Result<Vec<Chunk>, ComputeError> {
    let &[rows, hidden] = out.embeds.shape() else {
        return Err(ComputeError::invalid(format!(
            "embeddings shaped {:?}, expected (tokens, hidden)",
            out.embeds.shape()
        )));
    };
    let levels: Vec<Vec<u8>> = std::iter::once(&out.embeds)
        .chain(out.deepstack.iter())
        .map(|t| t.to_le_bytes(dtype.host()))
        .collect();
    let row_bytes = hidden * dtype.size_in_bytes();
    let step = rows_per_chunk(row_bytes * levels.len(), max_bytes);
    let mut chunks = Vec::with_capacity(rows.div_ceil(step));
    let mut start = 0;
    while start < rows {
        let end = (start + step).min(rows);
        let range = start * row_bytes..end * row_bytes;
        let mut parts = levels.iter().map(|l| l[range.clone()].to_vec());
        chunks.push(Chunk {
            image_index: header.image_index,
            content_hash: Arc::clone(&header.content_hash),
            grid: header.grid,
            row_start: start as u32,
            row_end: end as u32,
            total_rows: rows as u32,
            hidden_size: hidden as u32,
            dtype,
            embeds: parts.next().unwrap_or_default(),
            deepstack: parts.collect(),
            bucket: header.bucket,
        });
        start = end;
    }
    Ok(chunks)
}

#[cfg(test)]
mod tests {
    use super::*;
    use vlm_compute::HostTensor;

    fn embeds(rows: usize, hidden: usize, levels: usize) -> ImageEmbeds {
        let t = |k: usize| {
            let v: Vec<f32> = (0..rows * hidden).map(|i| (i + 1000 * k) as f32).collect();
            HostTensor::from_f32(&v, vec![rows, hidden]).unwrap()
        };
        ImageEmbeds {
            embeds: t(0),
            deepstack: (1..=levels).map(t).collect(),
            grid_thw: [1, 2, 2 * rows],
        }
    }

    fn header() -> ChunkHeader {
        ChunkHeader {
            image_index: 3,
            content_hash: Arc::new(vec![7]),
            grid: [1, 2, 2],
            bucket: 64,
        }
    }

    #[test]
    fn chunks_cover_every_row_once_under_the_byte_limit() {
        let out = embeds(10, 4, 2);
        // 3 levels * 4 values * 4 bytes = 48 bytes per row; 100 bytes -> 2 rows per chunk.
        let chunks = to_chunks(&header(), &out, WireDtype::F32, 100).unwrap();
        assert_eq!(chunks.len(), 5);
        let mut next = 0;
        for c in &chunks {
            assert_eq!(c.row_start, next);
            assert!(c.payload_bytes() <= 100);
            assert_eq!(c.deepstack.len(), 2);
            assert_eq!(
                (c.total_rows, c.hidden_size, c.image_index, c.bucket),
                (10, 4, 3, 64)
            );
            next = c.row_end;
        }
        assert_eq!(next, 10);
        let all: Vec<u8> = chunks.iter().flat_map(|c| c.deepstack[1].clone()).collect();
        let want: Vec<u8> = out.deepstack[1]
            .to_f32()
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(all, want);
    }

    #[test]
    fn half_precision_on_the_wire() {
        let out = embeds(3, 2, 1);
        let chunks = to_chunks(&header(), &out, WireDtype::Bf16, MAX_CHUNK_BYTES).unwrap();
        assert_eq!(chunks.len(), 1);
        assert_eq!(chunks[0].embeds.len(), 3 * 2 * 2);
        assert_eq!(
            half::bf16::from_le_bytes([chunks[0].embeds[2], chunks[0].embeds[3]]).to_f32(),
            1.0
        );
    }

    #[test]
    fn a_row_wider_than_the_limit_still_goes_one_per_chunk() {
        assert_eq!(rows_per_chunk(4096, 1000), 1);
        assert_eq!(rows_per_chunk(2048 * 4 * 4, MAX_CHUNK_BYTES), 32);
    }
}
