//! Bucket advice: from observed traffic, the K buckets that minimise the expected cost of a run
//! padded to its bucket.
//!
//! # Cost model
//! A run of bucket `b` costs `cost(b) = a*b + c*b^2` FLOPs, whatever the real size it carries.
//! * ViT ([`CostModel::vit`]), per raw patch: `a = 2 x depth x (4 h^2 + 2 h i)` (qkv, proj,
//!   MLP) `+ 2 x patch_dim x h` (patch embedding) `+ (1 + deepstack) x 2 x (m^2 + m x out) / 4`
//!   (merger and deepstack mergers, m = 4h, per merged token of 4 patches); attention
//!   `c = 4 x depth x h` (QK^T and PV, `2 x b^2 x h` each). Qwen3-VL-2B: a = 657,457,152,
//!   c = 98,304 (attention costs as much as the linear layers at b ~ 6,700).
//! * Decoder ([`CostModel::decode`]), per row of a decode graph: `a = 2 x (LM parameters)`
//!   (the matrices and the LM head), `c = 0`. Streaming the weights once per step is paid
//!   whatever graph runs, so it does not change which graphs are best; the per-row compute is
//!   what padding wastes.
//!
//! # Choice
//! Candidates are the distinct observed sizes (ViT: patch counts rounded up to multiples of
//! 4); the largest is always chosen (every observation must be served). With candidates sorted
//! `c_1 < ... < c_m`, weights `w_j` and prefix sums `P`, the exact optimum of `k` buckets ending
//! at `c_j` is `D[k][j] = min_{i<j} D[k-1][i] + (P(j) - P(i)) cost(c_j)`, `D[1][j] = P(j)
//! cost(c_j)`: an O(K m^2) dynamic programme. A memory predicate (the layout re-planned with the
//! chosen buckets) is checked on the result; when it fails, every set of at most K buckets is
//! enumerated (exact) if there are at most 200,000 of them, else the best set of each size from
//! K down is tried and the first that fits returned (not necessarily the constrained optimum).
use super::dims::ModelDims;
use super::PlanError;
use crate::geometry::image_geometry;
use crate::rules::VIT_BUCKET_MULTIPLE;
use serde::Serialize;

/// `cost(b) = a*b + c*b^2`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct CostModel {
    pub a: f64,
    pub c: f64,
}

impl CostModel {
    /// FLOPs of one ViT run of `b` raw patches (see the module docs).
    pub fn vit(d: &ModelDims) -> CostModel {
        let (h, i) = (d.vision_hidden as f64, d.vision_intermediate as f64);
        let m = h * (d.spatial_merge * d.spatial_merge) as f64;
        let out = d.vision_out_hidden as f64;
        let unit = (d.spatial_merge * d.spatial_merge) as f64;
        let a = 2.0 * d.vision_depth as f64 * (4.0 * h * h + 2.0 * h * i)
            + 2.0 * d.patch_dim as f64 * h
            + (1 + d.deepstack_levels) as f64 * 2.0 * (m * m + m * out) / unit;
        let c = 4.0 * d.vision_depth as f64 * h;
        CostModel { a, c }
    }

    /// FLOPs per row of a decode graph (see the module docs).
    pub fn decode(d: &ModelDims) -> CostModel {
        let p = d.params();
        let head = if d.tied { d.vocab * d.text_hidden } else { 0 };
        // Embedding lookups cost nothing; the LM head is a matmul (tied: counted via `head`).
        let matmul_params = p.text - d.vocab * d.text_hidden + if d.tied { head } else { 0 };
        CostModel {
            a: 2.0 * matmul_params as f64,
            c: 0.0,
        }
    }

    pub fn cost(&self, b: u64) -> f64 {
        let b = b as f64;
        self.a * b + self.c * b * b
    }
}

/// A set of buckets evaluated on observations.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BucketSet {
    pub buckets: Vec<u64>,
    /// Mean cost per served observation.
    pub expected_cost: f64,
    /// Share of the computed rows that were padding: sum w (bucket - size) / sum w bucket.
    pub padding_waste: f64,
    /// Share of observations over the largest bucket (not served, not in the cost).
    pub unserved: f64,
}

/// Expected cost and padding of `buckets` on `(size, weight)` observations.
pub fn evaluate(samples: &[(u64, f64)], buckets: &[u64], cost: &CostModel) -> BucketSet {
    let mut b: Vec<u64> = buckets.to_vec();
    b.sort_unstable();
    b.dedup();
    let (mut w_served, mut w_all, mut total_cost, mut rows, mut pad) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for &(size, w) in samples {
        w_all += w;
        if let Some(&bucket) = b.iter().find(|&&x| x >= size) {
            w_served += w;
            total_cost += w * cost.cost(bucket);
            rows += w * bucket as f64;
            pad += w * (bucket - size) as f64;
        }
    }
    BucketSet {
        buckets: b,
        expected_cost: if w_served > 0.0 {
            total_cost / w_served
        } else {
            0.0
        },
        padding_waste: if rows > 0.0 { pad / rows } else { 0.0 },
        unserved: if w_all > 0.0 {
            (w_all - w_served) / w_all
        } else {
            0.0
        },
    }
}

/// Observations merged by size, sorted: (size, total weight).
fn histogram(samples: &[(u64, f64)], extra: Option<u64>) -> Vec<(u64, f64)> {
    let mut h: Vec<(u64, f64)> = samples.to_vec();
    if let Some(e) = extra {
        h.push((e, 0.0));
    }
    h.sort_by_key(|s| s.0);
    let mut out: Vec<(u64, f64)> = Vec::new();
    for (s, w) in h {
        match out.last_mut() {
            Some(last) if last.0 == s => last.1 += w,
            _ => out.push((s, w)),
        }
    }
    out
}

/// The best set of at most `k` buckets from the observed sizes (and `largest`, when given, as
/// the required largest bucket: e.g. `batch_size` for decode graphs). `fits` says whether a
/// set fits memory; the best set of each size from `k` down is tried.
pub fn choose(
    samples: &[(u64, f64)],
    k: usize,
    largest: Option<u64>,
    cost: &CostModel,
    fits: &dyn Fn(&[u64]) -> bool,
) -> Result<BucketSet, PlanError> {
    if k == 0 {
        return Err(PlanError::Traffic(
            "--max-buckets must be at least 1".into(),
        ));
    }
    let cands = histogram(samples, largest);
    if cands.is_empty() {
        return Err(PlanError::Traffic(
            "no observations to choose buckets from".into(),
        ));
    }
    let m = cands.len();
    if let Some(l) = largest {
        if cands[m - 1].0 > l {
            return Err(PlanError::Traffic(format!(
                "an observation of {} is over the required largest bucket {l}",
                cands[m - 1].0
            )));
        }
    }
    let mut prefix = vec![0.0; m + 1];
    for j in 0..m {
        prefix[j + 1] = prefix[j] + cands[j].1;
    }
    let kmax = k.min(m);
    // d[k][j]: best cost covering candidates 0..=j with k buckets, the last at j.
    let inf = f64::INFINITY;
    let mut d = vec![vec![inf; m]; kmax + 1];
    let mut parent = vec![vec![usize::MAX; m]; kmax + 1];
    for j in 0..m {
        d[1][j] = prefix[j + 1] * cost.cost(cands[j].0);
    }
    for kk in 2..=kmax {
        for j in (kk - 1)..m {
            let cj = cost.cost(cands[j].0);
            let (mut best, mut arg) = (inf, usize::MAX);
            for i in (kk - 2)..j {
                let v = d[kk - 1][i] + (prefix[j + 1] - prefix[i + 1]) * cj;
                if v < best {
                    best = v;
                    arg = i;
                }
            }
            d[kk][j] = best;
            parent[kk][j] = arg;
        }
    }
    let best_of = |kk: usize| {
        let mut set = Vec::with_capacity(kk);
        let mut j = m - 1;
        let mut level = kk;
        loop {
            set.push(cands[j].0);
            if level == 1 {
                break;
            }
            j = parent[level][j];
            level -= 1;
        }
        set.reverse();
        set
    };
    let unconstrained = best_of(kmax);
    if fits(&unconstrained) {
        return Ok(evaluate(samples, &unconstrained, cost));
    }
    // Memory binds. Exact by enumeration when the sets are few enough ...
    if combinations_at_most(m - 1, kmax - 1) <= BRUTE_FORCE_LIMIT {
        return brute_force(samples, kmax, cost, fits).ok_or_else(|| no_fit(&[unconstrained]));
    }
    // ... else the best set of each size from K down, the first that fits.
    let mut tried = vec![unconstrained];
    for kk in (1..kmax).rev() {
        let set = best_of(kk);
        if fits(&set) {
            return Ok(evaluate(samples, &set, cost));
        }
        tried.push(set);
    }
    Err(no_fit(&tried))
}

/// Bucket sets enumerated exactly when memory binds.
const BRUTE_FORCE_LIMIT: u64 = 200_000;

fn no_fit(tried: &[Vec<u64>]) -> PlanError {
    PlanError::Traffic(format!(
        "no bucket set fits the memory left on the devices (tried {tried:?} and smaller); the largest bucket alone does not fit"
    ))
}

/// sum_{i <= r} C(n, i), saturating.
fn combinations_at_most(n: usize, r: usize) -> u64 {
    let (mut total, mut c) = (1u64, 1u64);
    for i in 1..=r.min(n) {
        c = c.saturating_mul((n + 1 - i) as u64) / i as u64;
        total = total.saturating_add(c);
    }
    total
}

/// Brute force over every set of at most `k` buckets drawn from the observed sizes (the largest
/// always in): for tests and for [`choose`] when memory binds. Panics past a million sets.
pub fn choose_brute_force(samples: &[(u64, f64)], k: usize, cost: &CostModel) -> BucketSet {
    brute_force(samples, k, cost, &|_: &[u64]| true).expect("at least one candidate")
}

/// The cheapest set of at most `k` buckets that `fits`, by enumeration (None when none fits).
fn brute_force(
    samples: &[(u64, f64)],
    k: usize,
    cost: &CostModel,
    fits: &dyn Fn(&[u64]) -> bool,
) -> Option<BucketSet> {
    let cands: Vec<u64> = histogram(samples, None).into_iter().map(|c| c.0).collect();
    let (top, rest) = cands.split_last().expect("at least one observation");
    let mut best: Option<BucketSet> = None;
    let mut visited = 0u64;
    // Every subset of `rest` of size < k, by recursion over the next index to include.
    fn walk(
        rest: &[u64],
        from: usize,
        left: usize,
        chosen: &mut Vec<u64>,
        visit: &mut dyn FnMut(&[u64]),
    ) {
        visit(chosen);
        if left == 0 {
            return;
        }
        for i in from..rest.len() {
            chosen.push(rest[i]);
            walk(rest, i + 1, left - 1, chosen, visit);
            chosen.pop();
        }
    }
    let mut visit = |chosen: &[u64]| {
        visited += 1;
        assert!(
            visited <= 1_000_000,
            "brute force past a million bucket sets"
        );
        let mut set = chosen.to_vec();
        set.push(*top);
        if !fits(&set) {
            return;
        }
        let e = evaluate(samples, &set, cost);
        if best
            .as_ref()
            .is_none_or(|b| e.expected_cost < b.expected_cost)
        {
            best = Some(e);
        }
    };
    walk(rest, 0, k.saturating_sub(1), &mut Vec::new(), &mut visit);
    best
}

/// Image sizes from a traffic file: one `WxH` per line, or JSON lines with
/// `{"images":[{"width":W,"height":H}, ...]}` (other keys ignored). Blank lines and `#`
/// comments are skipped.
pub fn parse_traffic(text: &str) -> Result<Vec<(u32, u32)>, PlanError> {
    let mut out = Vec::new();
    for (n, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let bad =
            |why: String| PlanError::Traffic(format!("line {}: {why}: `{}`", n + 1, short(line)));
        if line.starts_with('{') {
            let v: serde_json::Value =
                serde_json::from_str(line).map_err(|e| bad(format!("not JSON ({e})")))?;
            let Some(images) = v.get("images") else {
                continue;
            };
            let images = images
                .as_array()
                .ok_or_else(|| bad("`images` is not a list".into()))?;
            for im in images {
                let dim = |k: &str| {
                    im.get(k)
                        .and_then(|x| x.as_u64())
                        .and_then(|x| u32::try_from(x).ok())
                };
                match (dim("width"), dim("height")) {
                    (Some(w), Some(h)) => out.push((w, h)),
                    _ => return Err(bad("an image without integer `width` and `height`".into())),
                }
            }
        } else {
            let (w, h) = line
                .split_once(['x', 'X', '*'])
                .ok_or_else(|| bad("expected WxH".into()))?;
            let w: u32 = w.trim().parse().map_err(|_| bad("expected WxH".into()))?;
            let h: u32 = h.trim().parse().map_err(|_| bad("expected WxH".into()))?;
            out.push((w, h));
        }
    }
    Ok(out)
}

/// Active decode batch sizes from a log: integers separated by whitespace or commas, or JSON
/// lines with an `active` (or `batch`) key. Blank lines and `#` comments are skipped.
pub fn parse_batch_log(text: &str) -> Result<Vec<u64>, PlanError> {
    let mut out = Vec::new();
    for (n, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let bad = |why: &str| {
            PlanError::Traffic(format!(
                "batch log line {}: {why}: `{}`",
                n + 1,
                short(line)
            ))
        };
        if line.starts_with('{') {
            let v: serde_json::Value = serde_json::from_str(line).map_err(|_| bad("not JSON"))?;
            let a = v
                .get("active")
                .or_else(|| v.get("batch"))
                .and_then(|x| x.as_u64());
            out.push(a.ok_or_else(|| bad("no integer `active`"))?);
        } else {
            for tok in line.split([' ', '\t', ',']).filter(|t| !t.is_empty()) {
                out.push(tok.parse().map_err(|_| bad("expected integers"))?);
            }
        }
    }
    if let Some(pos) = out.iter().position(|&b| b == 0) {
        return Err(PlanError::Traffic(format!(
            "batch log entry {} is 0; active batches are at least 1",
            pos + 1
        )));
    }
    Ok(out)
}

/// Raw patches of each image under the processor's resize (`min_pixels`/`max_pixels`), rounded
/// up to a multiple of 4, as (patches, weight 1).
pub fn image_samples(
    sizes: &[(u32, u32)],
    min_pixels: u64,
    max_pixels: u64,
) -> Result<Vec<(u64, f64)>, PlanError> {
    let m = VIT_BUCKET_MULTIPLE as u64;
    sizes
        .iter()
        .map(|&(w, h)| {
            let g = image_geometry(w, h, min_pixels, max_pixels)
                .map_err(|e| PlanError::Traffic(format!("image {w}x{h}: {e}")))?;
            Ok((g.patches().div_ceil(m) * m, 1.0))
        })
        .collect()
}

/// One video of a traffic file: (width, height, frames, fps).
pub type VideoTraffic = (u32, u32, u32, Option<f64>);

/// Videos from a JSON-lines traffic file: `{"videos":[{"width":W,"height":H,"frames":N,
/// "fps":F}, ...]}` (fps optional; other keys and lines ignored), as (width, height, frames, fps).
pub fn parse_video_traffic(text: &str) -> Result<Vec<VideoTraffic>, PlanError> {
    let mut out = Vec::new();
    for (n, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if !line.starts_with('{') {
            continue;
        }
        let bad =
            |why: String| PlanError::Traffic(format!("line {}: {why}: `{}`", n + 1, short(line)));
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| bad(format!("not JSON ({e})")))?;
        let Some(videos) = v.get("videos") else {
            continue;
        };
        let videos = videos
            .as_array()
            .ok_or_else(|| bad("`videos` is not a list".into()))?;
        for vid in videos {
            let num = |k: &str| {
                vid.get(k)
                    .and_then(|x| x.as_u64())
                    .and_then(|x| u32::try_from(x).ok())
            };
            match (num("width"), num("height"), num("frames")) {
                (Some(w), Some(h), Some(f)) => {
                    out.push((w, h, f, vid.get("fps").and_then(|x| x.as_f64())))
                }
                _ => {
                    return Err(bad(
                        "a video without integer `width`, `height` and `frames`".into(),
                    ))
                }
            }
        }
    }
    Ok(out)
}

/// Raw patches of each video's temporal groups (each group is one ViT run) under the video
/// processor's sampling and resize, rounded up to a multiple of 4, weighted by the group count.
pub fn video_samples(
    videos: &[VideoTraffic],
    cfg: &crate::video::VideoProcessorConfig,
) -> Result<Vec<(u64, f64)>, PlanError> {
    let m = VIT_BUCKET_MULTIPLE as u64;
    videos
        .iter()
        .map(|&(w, h, frames, fps)| {
            let g = crate::video::VideoGeometry::plan(
                w,
                h,
                frames,
                fps,
                crate::video::Sampling::Default,
                cfg,
            )
            .map_err(|e| PlanError::Traffic(format!("video {w}x{h} x {frames}: {e}")))?;
            Ok((g.group_patches().div_ceil(m) * m, g.groups() as f64))
        })
        .collect()
}

fn short(s: &str) -> String {
    s.chars().take(60).collect()
}
