//! The 3-D rotary positions of a prompt (`Qwen3VLModel.get_rope_index`).
use crate::error::{ComputeError, Result};

/// One token's (t, h, w) rotary position.
pub type Position3 = [i64; 3];

/// The 3-D rotary positions of a prompt and its `rope_delta`, as `Qwen3VLModel.get_rope_index`.
///
/// Text tokens get `cur` on all three axes (`cur += 1`). The k-th run of `image_token_id` tokens
/// takes `grids[k]` (t, h, w in raw patches): its t*(h/m)*(w/m) tokens get
/// `(cur+ti, cur+hi, cur+wi)` in row-major order, then `cur += max(h, w)/m`. A token generated
/// later at cache index n has position `n + rope_delta` on all three axes, where
/// `rope_delta = max(position) + 1 - len`.
///
/// Every image must be announced by `vision_start_token_id` right before its first token (as the
/// chat template and 4.57's `get_rope_index` require); the number of image tokens must equal the
/// grids' total.
pub fn get_rope_index(
    input_ids: &[u32],
    image_token_id: u32,
    vision_start_token_id: u32,
    grids: &[[usize; 3]],
    spatial_merge_size: usize,
) -> Result<(Vec<Position3>, i64)> {
    let m = spatial_merge_size.max(1);
    let mut grid_tokens = Vec::with_capacity(grids.len());
    for (k, g) in grids.iter().enumerate() {
        if g[1] % m != 0 || g[2] % m != 0 || g.contains(&0) {
            return Err(ComputeError::invalid(format!(
                "image {k} grid {g:?} is not a non-empty multiple of the merge size {m}"
            )));
        }
        grid_tokens.push(g[0] * (g[1] / m) * (g[2] / m));
    }
    let expected: usize = grid_tokens.iter().sum();
    let found = input_ids.iter().filter(|&&t| t == image_token_id).count();
    if found != expected {
        return Err(ComputeError::invalid(format!(
            "the prompt has {found} image tokens (id {image_token_id}), but the {} image grid(s) \
             {grids:?} need {expected}",
            grids.len()
        )));
    }

    let mut positions = Vec::with_capacity(input_ids.len());
    let mut cur: i64 = 0;
    let mut i = 0;
    let mut k = 0;
    while i < input_ids.len() {
        if input_ids[i] != image_token_id {
            positions.push([cur; 3]);
            cur += 1;
            i += 1;
            continue;
        }
        // Counts match, so an image token here means grids[k] exists.
        let g = grids[k];
        let n = grid_tokens[k];
        if i == 0 || input_ids[i - 1] != vision_start_token_id {
            return Err(ComputeError::invalid(format!(
                "image {k} starts at token {i} without a vision-start token (id \
                 {vision_start_token_id}) before it"
            )));
        }
        let run = input_ids[i..]
            .iter()
            .take_while(|&&t| t == image_token_id)
            .count();
        if run != n {
            return Err(ComputeError::invalid(format!(
                "image {k} (grid {g:?}) needs {n} consecutive image tokens, but the run at token \
                 {i} has {run}"
            )));
        }
        let (gh, gw) = (g[1] / m, g[2] / m);
        for ti in 0..g[0] {
            for hi in 0..gh {
                for wi in 0..gw {
                    positions.push([cur + ti as i64, cur + hi as i64, cur + wi as i64]);
                }
            }
        }
        cur += (g[1].max(g[2]) / m) as i64;
        i += n;
        k += 1;
    }
    let max = positions
        .iter()
        .flat_map(|p| p.iter().copied())
        .max()
        .unwrap_or(-1);
    let delta = max + 1 - input_ids.len() as i64;
    Ok((positions, delta))
}

/// The position of the token at cache index `index` after a prompt with `rope_delta`.
pub fn decode_position(index: usize, rope_delta: i64) -> Position3 {
    [index as i64 + rope_delta; 3]
}

#[cfg(test)]
mod tests {
    use super::*;

    const IMG: u32 = 9;
    const VS: u32 = 7;

    #[test]
    fn text_only_is_arange_with_zero_delta() {
        let (p, d) = get_rope_index(&[1, 2, 3], IMG, VS, &[], 2).unwrap();
        assert_eq!(p, vec![[0; 3], [1; 3], [2; 3]]);
        assert_eq!(d, 0);
    }

    #[test]
    fn image_run_uses_the_llm_grid_and_advances_by_max_side() {
        // grid (1, 4, 6) -> llm grid 1 x 2 x 3 = 6 tokens.
        let ids = [1, VS, IMG, IMG, IMG, IMG, IMG, IMG, 8, 5];
        let (p, d) = get_rope_index(&ids, IMG, VS, &[[1, 4, 6]], 2).unwrap();
        assert_eq!(&p[..2], &[[0; 3], [1; 3]]);
        assert_eq!(
            &p[2..8],
            &[
                [2, 2, 2],
                [2, 2, 3],
                [2, 2, 4],
                [2, 3, 2],
                [2, 3, 3],
                [2, 3, 4]
            ]
        );
        // cur = 2 + max(4, 6)/2 = 5
        assert_eq!(&p[8..], &[[5; 3], [6; 3]]);
        assert_eq!(d, 7 - 10);
    }

    #[test]
    fn count_mismatch_names_both_counts() {
        let ids = [VS, IMG, IMG, IMG];
        let err = get_rope_index(&ids, IMG, VS, &[[1, 4, 4]], 2)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("3 image tokens") && err.contains("need 4"),
            "{err}"
        );
    }

    #[test]
    fn image_without_vision_start_is_rejected() {
        let err = get_rope_index(&[1, IMG], IMG, VS, &[[1, 2, 2]], 2)
            .unwrap_err()
            .to_string();
        assert!(err.contains("vision-start"), "{err}");
    }
}
