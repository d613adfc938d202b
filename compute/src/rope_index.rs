//! The 3-D rotary positions of a prompt (`Qwen3VLModel.get_rope_index`).
use crate::error::{ComputeError, Result};

/// One token's (t, h, w) rotary position.
pub type Position3 = [i64; 3];

/// The 3-D rotary positions of a prompt and its `rope_delta`, as `Qwen3VLModel.get_rope_index`,
/// for a prompt with images only: [`get_rope_index_runs`] with every run an image.
pub fn get_rope_index(
    input_ids: &[u32],
    image_token_id: u32,
    vision_start_token_id: u32,
    grids: &[[usize; 3]],
    spatial_merge_size: usize,
) -> Result<(Vec<Position3>, i64)> {
    let pads = vec![image_token_id; grids.len()];
    get_rope_index_runs(
        input_ids,
        &pads,
        &[image_token_id],
        vision_start_token_id,
        grids,
        spatial_merge_size,
    )
}

/// The 3-D rotary positions of a prompt and its `rope_delta`, as `Qwen3VLModel.get_rope_index`.
///
/// Text tokens get `cur` on all three axes (`cur += 1`). The k-th vision run (a run of
/// `pads[k]`: an image's `<|image_pad|>` or one video temporal group's `<|video_pad|>`) takes
/// `grids[k]` (t, h, w in raw patches; a video group is `[1, h, w]`, as the reference splits
/// `video_grid_thw` per group): its t*(h/m)*(w/m) tokens get `(cur+ti, cur+hi, cur+wi)` in
/// row-major order, then `cur += max(h, w)/m`. A token generated later at cache index n has
/// position `n + rope_delta` on all three axes, where `rope_delta = max(position) + 1 - len`.
///
/// Every run must be announced by `vision_start_token_id` right before its first token (as the
/// chat template and the processor's timestamps layout give); the tokens of `pad_ids` in the
/// prompt must be exactly the runs'.
pub fn get_rope_index_runs(
    input_ids: &[u32],
    pads: &[u32],
    pad_ids: &[u32],
    vision_start_token_id: u32,
    grids: &[[usize; 3]],
    spatial_merge_size: usize,
) -> Result<(Vec<Position3>, i64)> {
    let m = spatial_merge_size.max(1);
    if pads.len() != grids.len() {
        return Err(ComputeError::invalid(format!(
            "{} vision runs named but {} grids given",
            pads.len(),
            grids.len()
        )));
    }
    let mut grid_tokens = Vec::with_capacity(grids.len());
    for (k, g) in grids.iter().enumerate() {
        if g[1] % m != 0 || g[2] % m != 0 || g.contains(&0) {
            return Err(ComputeError::invalid(format!(
                "image {k} grid {g:?} is not a non-empty multiple of the merge size {m}"
            )));
        }
        grid_tokens.push(g[0] * (g[1] / m) * (g[2] / m));
    }
    for &pad in pad_ids {
        let expected: usize = grid_tokens
            .iter()
            .zip(pads)
            .filter(|(_, p)| **p == pad)
            .map(|(n, _)| n)
            .sum();
        let found = input_ids.iter().filter(|&&t| t == pad).count();
        if found != expected {
            let runs = pads.iter().filter(|p| **p == pad).count();
            return Err(ComputeError::invalid(format!(
                "the prompt has {found} image tokens (id {pad}), but the {runs} image grid(s) \
                 {grids:?} need {expected}"
            )));
        }
    }

    let mut positions = Vec::with_capacity(input_ids.len());
    let mut cur: i64 = 0;
    let mut i = 0;
    let mut k = 0;
    while i < input_ids.len() {
        if !pad_ids.contains(&input_ids[i]) {
            positions.push([cur; 3]);
            cur += 1;
            i += 1;
            continue;
        }
        // Counts match, so a vision token here means grids[k] exists.
        let (g, n, pad) = (grids[k], grid_tokens[k], pads[k]);
        if input_ids[i] != pad {
            return Err(ComputeError::invalid(format!(
                "vision run {k} at token {i} is of id {} but should be of id {pad}",
                input_ids[i]
            )));
        }
        if i == 0 || input_ids[i - 1] != vision_start_token_id {
            return Err(ComputeError::invalid(format!(
                "image {k} starts at token {i} without a vision-start token (id \
                 {vision_start_token_id}) before it"
            )));
        }
        let run = input_ids[i..].iter().take_while(|&&t| t == pad).count();
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
    fn video_groups_are_runs_of_their_own_pad_after_text() {
        const VID: u32 = 11;
        // image (1, 2, 2) then two video groups (1, 2, 2) with a timestamp token between.
        let ids = [1, VS, IMG, 2, 3, VS, VID, 4, 5, VS, VID, 6];
        let g = [[1, 2, 2]; 3];
        let (p, d) = get_rope_index_runs(&ids, &[IMG, VID, VID], &[IMG, VID], VS, &g, 2).unwrap();
        assert_eq!(p[2], [2; 3]);
        // each run advances by max(h, w)/m = 1
        assert_eq!(p[6], [6; 3]);
        assert_eq!(p[10], [10; 3]);
        assert_eq!(d, 0);
        // A video pad where an image run is expected is refused.
        let err = get_rope_index_runs(&ids, &[VID, VID, VID], &[IMG, VID], VS, &g, 2)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("id 9") || err.contains("image tokens"),
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
