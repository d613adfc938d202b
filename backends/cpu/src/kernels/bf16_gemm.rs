//! `C [+]= A · B` with bf16 operands and f32 accumulation on CPUs with AVX512-BF16
//! (`vdpbf16ps`: 16 lanes x a pair of bf16 products per instruction, twice the f32 FMA rate).
//!
//! This is the math of the reference in bfloat16 (torch's CPU bf16 matmul through oneDNN): the
//! f32 activations are rounded to bf16 (round to nearest even) as they enter, the weights are
//! bf16, products and sums are f32. B is pre-packed ([`super::packed`]); A is converted a block
//! of rows at a time into a per-thread scratch.
//!
//! Blocking: a task owns a block of A rows (up to [`A_BLOCK_BYTES`]) and a run of B panels; for
//! each panel it runs the register-tile kernel (12 rows x 32 columns = 24 accumulators) down the
//! rows of the block, so a panel is read from memory once per task and then from L2, the task's
//! next panel prefetched into L2 meanwhile.
//! On AMX tiles a block holds many more rows (up to [`AMX_A_BLOCK_BYTES`]) and the loops turn:
//! each 32-row group of the block passes over the task's panels (up to [`AMX_B_RUN_BYTES`],
//! kept in L2), so the weights stream from memory once per block instead of once per 96 rows.
//! The panels are taken [`AMX_B_SUBRUN_BYTES`] at a time: the first group's pass over a sub-run
//! prefetches it ahead of the tiles, and the passes of the groups after it bring the next
//! sub-run into L2, so only a task's first sub-run waits on memory.
//! Each C element is a sum over the inner pairs in one fixed order whatever `m`, the task split or
//! the thread count is: one sequence decoded alone or in a batch gets bit-identical results.
use super::aligned::AlignedU16;
use super::amx::{BPrefetch, TILE_PAIRS, TILE_ROWS};
use super::packed::{bf16_bits, PackedB, NR};
use super::ptr::SendPtr;
use std::cell::RefCell;
use store::{ColBias, Prior, RowScale, Store};
use tile::{tile, L2Prefetch};

/// Rows of the register tile.
const MR: usize = 12;
/// Panels per parallel task.
const PANELS_PER_TASK: usize = 8;
/// Bytes of converted A a task keeps: every row of a 273-token prefill chunk at hidden 2048, or
/// ~500 ViT rows at hidden 1024. B's panels are read from memory once per block, so the fewer
/// blocks the less weight traffic; A itself is then read from L3 (Zen 5, alternated binaries:
/// 2B prefill of 273 tokens 0.95 / 0.95 / 1.02 s against 1.00 / 1.00 / 1.06 s with 512 KiB
/// blocks; ViT at 1024 / 4096 patches 0-5% faster).
const A_BLOCK_BYTES: usize = 2 << 20;
/// Register tile: from this many rows on, a task prefetches B ahead of its tiles (below, one
/// tile streams the panel faster than prefetches help: the hardware prefetcher keeps up).
const PREFETCH_MIN_ROWS: usize = 5;
/// Register tile, up to this many rows (decode batches): the first row tile prefetches its own
/// panel [`STREAM_AHEAD_LINES`] ahead of its reads instead of the task's next panel, so a
/// task's first panel is not read cold and lines are asked for a fixed distance ahead. Cold B,
/// 2 threads, Zen 4, alternated call by call (`VLM_BENCH_AB_PREFETCH=next` in the `bf16_gemm`
/// bench): 8 rows 0-28% faster on the 2B's shapes (12 of 13 pairs ahead, one equal; median
/// 16%), 5-16 rows 10-15%, 24-32 rows 3-12%, 64 rows within 4%. 32 lines ahead was 4-17% slower
/// than the next-panel scheme; 64-640 faster on most shapes, 96 on every one.
const STREAM_MAX_ROWS: usize = 32;
/// Lines (of 64 B) the in-stream prefetch runs ahead of the tile: 48 inner pairs of a panel.
const STREAM_AHEAD_LINES: usize = 96;
/// Below this many multiply-adds a product runs on the calling thread.
const PARALLEL_MIN_MACS: usize = 1 << 18;
/// Rows of A one AMX step covers (two 16-row tiles).
const AMX_ROWS: usize = 2 * TILE_ROWS;
/// AMX: bytes of converted A a block may hold (every row of a 512- or 1024-token prefill chunk
/// at hidden 2048; a ViT bucket's rows in a few blocks). Each task's B panels are read from
/// memory once per block, so the fewer blocks the less weight traffic; A itself is read one
/// 32-row group at a time, from L2 or L3.
const AMX_A_BLOCK_BYTES: usize = 8 << 20;
/// AMX: bytes of B panels one task keeps in L2 while every 32-row group of its block passes
/// over them (half a Sapphire Rapids core's 2 MiB).
const AMX_B_RUN_BYTES: usize = 1 << 20;
/// AMX: a task's panels are taken this many bytes at a time (two panels at k 2048): every group
/// passes over one sub-run while the next one is prefetched into L2 (see `BPrefetch`), so only
/// the first sub-run of a task waits on memory. In-process A/B against one sub-run per task
/// (`VLM_BENCH_AB_SUBRUN=1048576` in the `bf16_gemm` bench, cold B, 2026-12-03): ahead in 18 of
/// 24 pairs over the prefill and ViT shapes; 128 and 512 KiB were no better.
const AMX_B_SUBRUN_BYTES: usize = 256 << 10;

/// Whether this CPU runs the kernel (AVX512-F, -DQ, -BW, -VL and -BF16: every CPU with the
/// last has the others). Whether it is used is the
/// backend's option (`kernels.bf16_dot`, see `crate::options`).
pub fn available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512dq")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512vl")
                && std::arch::is_x86_feature_detected!("avx512bf16")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// A packed B, or a window of one: `n` columns from panel-aligned `data`, `pairs` inner pairs.
#[derive(Clone, Copy, Debug)]
pub struct BView<'a> {
    data: &'a [u16],
    panel_stride: usize,
    pairs: usize,
    n: usize,
    /// Products with this operand run on AMX tiles ([`super::amx`]) rather than the AVX512
    /// register tile.
    amx: bool,
    /// AMX: how the product is blocked (the defaults unless a bench says otherwise).
    amx_blocking: AmxBlocking,
    /// The register tile's L2 prefetch (other than the default only for the benches' A/B; the
    /// same bits either way).
    prefetch: TilePrefetch,
}

/// What the register tile prefetches into L2 (see `gemm_any`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TilePrefetch {
    /// Decode rows (`PREFETCH_MIN_ROWS..=STREAM_MAX_ROWS`): the panel itself, ahead of the
    /// first row tile; more rows: each task's next panel while the row tiles pass over the
    /// current one.
    #[default]
    Auto,
    /// Each task's next panel, whatever the row count (from `PREFETCH_MIN_ROWS` rows).
    NextPanel,
    /// None.
    Off,
}

/// How an AMX product is blocked. The results are the same bits whatever the values; they move
/// only the loads. The defaults are the constants above; other values are for the benches'
/// in-process A/Bs (`BView::with_amx_blocking`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AmxBlocking {
    /// Bytes of converted A rows per block (each task's panels are read once per block).
    pub a_block_bytes: usize,
    /// Bytes of panels per sub-run (1 MiB or more: one run per task, no L2 prefetch).
    pub subrun_bytes: usize,
}

impl Default for AmxBlocking {
    fn default() -> Self {
        AmxBlocking {
            a_block_bytes: AMX_A_BLOCK_BYTES,
            subrun_bytes: AMX_B_SUBRUN_BYTES,
        }
    }
}

impl<'a> BView<'a> {
    /// A packing of (n, k) held in `data` (see [`PackedB::len_for`]).
    pub fn new(data: &'a [u16], n: usize, k: usize) -> BView<'a> {
        assert!(
            data.len() >= PackedB::len_for(n, k),
            "BView: data too short"
        );
        let kp = k.next_multiple_of(2);
        BView {
            data,
            panel_stride: kp * NR,
            pairs: kp / 2,
            n,
            amx: false,
            amx_blocking: AmxBlocking::default(),
            prefetch: TilePrefetch::Auto,
        }
    }
    /// Products with this operand on AMX tiles when `on` and the CPU granted them (the
    /// backend's `kernels.amx` option); the AVX512 register tile otherwise.
    pub fn with_amx(self, on: bool) -> BView<'a> {
        BView {
            amx: on && super::amx::available(),
            ..self
        }
    }
    /// AMX products with this operand blocked so instead of the defaults (for the benches).
    pub fn with_amx_blocking(self, amx_blocking: AmxBlocking) -> BView<'a> {
        BView {
            amx_blocking,
            ..self
        }
    }
    /// Register-tile products with this operand with that L2 prefetch (for the benches).
    pub fn with_prefetch(self, prefetch: TilePrefetch) -> BView<'a> {
        BView { prefetch, ..self }
    }
    /// Whether products with this operand run on AMX tiles.
    pub fn amx(&self) -> bool {
        self.amx
    }
    pub fn n(&self) -> usize {
        self.n
    }
    /// Inner length (rounded up to a pair).
    pub fn k(&self) -> usize {
        2 * self.pairs
    }
    /// Columns `start..start + len`; `start` must be a multiple of the panel width.
    pub fn cols(self, start: usize, len: usize) -> BView<'a> {
        assert!(
            start.is_multiple_of(NR) && start + len <= self.n,
            "BView::cols"
        );
        BView {
            data: &self.data[(start / NR) * self.panel_stride..],
            n: len,
            ..self
        }
    }
    /// The start of panel `p` (columns `p * NR..`), for kernels that walk the panels
    /// themselves ([`super::attention_amx`]).
    pub(crate) fn panel(&self, p: usize) -> *const u16 {
        assert!(p * NR < self.n, "BView::panel {p} of {} columns", self.n);
        self.data[p * self.panel_stride..].as_ptr()
    }
    /// u16 values from one panel to the next.
    pub(crate) fn panel_stride(&self) -> usize {
        self.panel_stride
    }
    /// Inner indices `start..start + len` (the last pair may reach one past the end: its
    /// A value must then be zero); `start` must be even.
    pub fn inner(self, start: usize, len: usize) -> BView<'a> {
        assert!(start.is_multiple_of(2), "BView::inner: odd start");
        let pairs = len.div_ceil(2);
        assert!(
            start / 2 + pairs <= self.pairs,
            "BView::inner: past the end"
        );
        BView {
            data: &self.data[start * NR..],
            pairs,
            ..self
        }
    }
}

impl PackedB {
    pub fn view(&self) -> BView<'_> {
        BView::new(self.data(), self.n(), self.k()).with_amx(self.amx())
    }
}

/// The bf16 rows of A a thread converted last: which call and row block they are, so that the
/// next task of the same call on the same block (another run of panels) does not convert again.
struct AScratch {
    call: u64,
    block: usize,
    /// 64-byte aligned, rows a whole number of lines apart: the tiles load A's rows whole.
    data: AlignedU16,
}

thread_local! {
    static A_SCRATCH: RefCell<AScratch> = const {
        RefCell::new(AScratch { call: u64::MAX, block: 0, data: AlignedU16::new() })
    };
}

/// Numbers the GEMM calls (for [`AScratch`]).
static NEXT_CALL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// `C[r][j] (+)= sum_i A[r][i] * B(i, j)` for r < m, j < b.n(), i < b.k(): A is f32 with row
/// stride `lda` and `b.k()` columns (an odd k is padded with a zero), C has row stride `ldc`.
/// `parallel` splits the work over rayon's threads when it is large enough.
///
/// # Safety
/// `a` must be valid for reads of `m` rows of `b.k()` (or k, when odd: `k = b.k() - 1`) values,
/// `c` for reads and writes of `m` rows of `b.n()` values, and C must not overlap A. Panics if
/// [`available`] is false.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm(
    m: usize,
    k: usize,
    a: *const f32,
    lda: usize,
    b: BView<'_>,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
    parallel: bool,
) {
    let store = Store::new(accumulate);
    unsafe { gemm_any(m, k, ASource::F32(a, lda), b, c, ldc, store, parallel) }
}

/// [`gemm`] with A already rounded to bf16 (bits, row stride `lda`, `b.k()` values per row
/// rounded up to a pair, the pad zero): no conversion pass. Give A a row stride that is not a
/// multiple of 512 bytes (e.g. the row plus one cache line) so that the rows a tile reads do not
/// share an L1 set.
///
/// # Safety
/// As [`gemm`], with `a` valid for `m` rows of `lda` u16 values.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_bf16_a(
    m: usize,
    a: *const u16,
    lda: usize,
    b: BView<'_>,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
    parallel: bool,
) {
    let (k, store) = (2 * b.pairs, Store::new(accumulate));
    unsafe { gemm_any(m, k, ASource::Bf16(a, lda), b, c, ldc, store, parallel) }
}

/// [`gemm_bf16_a`] that rescales C's rows as it adds: `C[r][j] = C[r][j] * scale[r] + sum_i
/// A[r][i] * B(i, j)` (one fused multiply-add per value as the tile stores its sums: the online
/// softmax's correction of earlier key tiles' p·v, with no pass of its own over C).
///
/// # Safety
/// As [`gemm_bf16_a`], with `scale` valid for `m` reads.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_bf16_a_rescale(
    m: usize,
    a: *const u16,
    lda: usize,
    b: BView<'_>,
    c: *mut f32,
    ldc: usize,
    scale: *const f32,
    parallel: bool,
) {
    let (k, store) = (2 * b.pairs, Store::ScaleAdd(RowScale(scale)));
    unsafe { gemm_any(m, k, ASource::Bf16(a, lda), b, c, ldc, store, parallel) }
}

/// C16 (m, n) = bf16(gelu_tanh(A·B + bias)), rounded to nearest even: the ViT MLP's fc1 and
/// its activation in one pass, its output already the bf16 left operand of fc2
/// ([`gemm_bf16_a`]). The same operations as `vit_ops::bias_gelu_tanh` on the plain
/// product's output and then fc2's A conversion, so the same bits, without writing and reading
/// the (m, n) f32 values twice. Not on AMX tiles (their sums go through C).
///
/// # Safety
/// As [`gemm`], with `bias` valid for `b.n()` reads and `c` for writes of `m` rows of `ldc`
/// >= n u16 values; `ldc` even.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_bias_gelu_bf16(
    m: usize,
    k: usize,
    a: *const f32,
    lda: usize,
    b: BView<'_>,
    bias: *const f32,
    c: *mut u16,
    ldc: usize,
    parallel: bool,
) {
    assert!(
        !b.amx && ldc.is_multiple_of(2) && ldc >= b.n,
        "bias + GELU bf16 product: AMX {} n {} ldc {ldc}",
        b.amx,
        b.n
    );
    // C is addressed in f32 slots (two bf16 each), as the other stores' C.
    let store = Store::BiasGeluBf16(ColBias(bias));
    unsafe {
        gemm_any(
            m,
            k,
            ASource::F32(a, lda),
            b,
            c as *mut f32,
            ldc / 2,
            store,
            parallel,
        )
    }
}

/// C (m, n/2) = silu(A · gate) * (A · up) for B an interleaved gate/up packing of n columns
/// (`PackedB::interleave_gate_up`): the SiLU and the product with up are applied to the
/// register tile's sums before they are stored (the same operations as
/// `softmax::silu_mul_row` on the plain product's output, so the same bits), and the product
/// never writes the (m, n) gate/up values. Not on AMX tiles (their sums go through C).
///
/// # Safety
/// As [`gemm`], with `c` valid for `m` rows of `ldc` >= n/2 values.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_gate_up_silu(
    m: usize,
    k: usize,
    a: *const f32,
    lda: usize,
    b: BView<'_>,
    c: *mut f32,
    ldc: usize,
    parallel: bool,
) {
    assert!(
        !b.amx && b.n.is_multiple_of(NR) && ldc >= b.n / 2,
        "gate/up SiLU product: AMX {} n {} ldc {ldc}",
        b.amx,
        b.n
    );
    let store = Store::SiluMul;
    unsafe { gemm_any(m, k, ASource::F32(a, lda), b, c, ldc, store, parallel) }
}

/// The left operand: f32 rows rounded per row block into a scratch, or bf16 rows as given.
#[derive(Clone, Copy)]
enum ASource {
    F32(*const f32, usize),
    Bf16(*const u16, usize),
}
// SAFETY: only read, under the callers' contracts.
unsafe impl Send for ASource {}
unsafe impl Sync for ASource {}

#[allow(clippy::too_many_arguments)]
unsafe fn gemm_any(
    m: usize,
    k: usize,
    a_src: ASource,
    b: BView<'_>,
    c: *mut f32,
    ldc: usize,
    store: Store,
    parallel: bool,
) {
    assert!(available(), "bf16 gemm on a CPU without AVX512-BF16");
    assert!(
        k.div_ceil(2) == b.pairs,
        "bf16 gemm: k {k} vs {} pairs",
        b.pairs
    );
    if m == 0 || b.n == 0 {
        return;
    }
    let kp = 2 * b.pairs;
    // Scratch row stride: one cache line more than the row (so the rows a tile reads do not
    // all fall in the same L1 set when k is a power of two), in whole lines (so each row
    // starts on one: see `aligned`).
    let lda_s = (kp + 32).next_multiple_of(32);
    let amx = b.amx;
    // Rows per block: as many as fit the budget, then evened out over the blocks needed (a
    // multiple of the tile height), so that no block is a thin remainder.
    let height = if amx { AMX_ROWS } else { MR };
    let a_budget = if amx {
        b.amx_blocking.a_block_bytes
    } else {
        A_BLOCK_BYTES
    };
    let max_rows = (a_budget / (2 * lda_s)).max(height) / height * height;
    let blocks = m.div_ceil(max_rows);
    let block_rows = m.div_ceil(blocks).next_multiple_of(height);
    let blocks = m.div_ceil(block_rows);
    let panels = b.n.div_ceil(NR);
    let per_task = if amx {
        (AMX_B_RUN_BYTES / (2 * b.panel_stride)).clamp(1, PANELS_PER_TASK)
    } else {
        PANELS_PER_TASK
    };
    let runs = panels.div_ceil(per_task);
    let c_ptr = SendPtr(c);
    let call = NEXT_CALL.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let task = move |t: usize| {
        let (blk, run) = (t / runs, t % runs);
        let (r0, r1) = (blk * block_rows, ((blk + 1) * block_rows).min(m));
        let (p0, p1) = (run * per_task, ((run + 1) * per_task).min(panels));
        let c_ptr = c_ptr;
        A_SCRATCH.with(|s| {
            let mut s = s.borrow_mut();
            let rows = r1 - r0;
            // The AMX tiles read whole groups of 16 or 32 rows: the scratch holds that many.
            let scratch_rows = if amx {
                rows.next_multiple_of(AMX_ROWS)
            } else {
                rows
            };
            // SAFETY: the caller's contract on `a`, `c`; this task's tile of C is its own.
            unsafe {
                let (a16, lda16) = match a_src {
                    // bf16 rows are read where they are, unless the tiles would read past A's
                    // last row (a partial last group): then they are copied like f32 rows.
                    // On AMX they must also start on cache lines (see `aligned`).
                    ASource::Bf16(a, lda)
                        if !amx
                            || (rows.is_multiple_of(AMX_ROWS)
                                && (a as usize).is_multiple_of(64)
                                && lda.is_multiple_of(32)) =>
                    {
                        (a.add(r0 * lda), lda)
                    }
                    _ => {
                        if s.call != call || s.block != blk {
                            (s.call, s.block) = (call, blk);
                            if s.data.len() < scratch_rows * lda_s {
                                s.data.resize(scratch_rows * lda_s);
                            }
                            for r in 0..rows {
                                let dst = &mut s.data[r * lda_s..r * lda_s + kp];
                                match a_src {
                                    ASource::F32(a, lda) => convert_row(
                                        std::slice::from_raw_parts(a.add((r0 + r) * lda), k),
                                        dst,
                                    ),
                                    ASource::Bf16(a, lda) => dst.copy_from_slice(
                                        std::slice::from_raw_parts(a.add((r0 + r) * lda), kp),
                                    ),
                                }
                            }
                        }
                        (s.data.as_ptr(), lda_s)
                    }
                };
                let block = Block {
                    rows,
                    pairs: b.pairs,
                    a: a16,
                    lda: lda16,
                    ldc,
                    store: store.at_row(r0),
                };
                if amx {
                    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
                    super::amx::configure();
                    // Each 32-row group of the block over the task's panels, which stay in L2:
                    // B comes from memory once per task and block. (Panels outer, the block's
                    // rows inner, read B once per block of 96 rows: 6 times the weights per
                    // 512-token chunk. In-process A/B, same bits: 0.97-1.6x on the prefill and
                    // ViT shapes (ViT fc2 unchanged), `cargo bench -p vlm-backend-cpu --bench bf16_gemm`.)
                    let chunks = b.pairs / TILE_PAIRS;
                    let groups = rows.div_ceil(AMX_ROWS);
                    let sub = (b.amx_blocking.subrun_bytes / (2 * b.panel_stride))
                        .clamp(1, PANELS_PER_TASK);
                    let mut q0 = p0;
                    while q0 < p1 {
                        let q1 = (q0 + sub).min(p1);
                        // The next sub-run's panels go to L2 while the groups after the first
                        // pass over this one's (the first is busy bringing these in).
                        let next = b.data[(q1.min(panels - 1)) * b.panel_stride..].as_ptr();
                        let next_lines = ((q1 + sub).min(p1) - q1) * b.panel_stride * 2 / 64;
                        let steps = (groups - 1) * (q1 - q0) * chunks;
                        let per_step = if steps > 0 {
                            next_lines.div_ceil(steps)
                        } else {
                            0
                        };
                        for gi in 0..groups {
                            let g = gi * AMX_ROWS;
                            // The group's rows start g rows into the block: so do its
                            // store's per-row operands (a rescale's factors).
                            let group = Block {
                                rows: AMX_ROWS.min(rows - g),
                                a: a16.add(g * lda16),
                                store: block.store.at_row(g),
                                ..block
                            };
                            for p in q0..q1 {
                                let cols = NR.min(b.n - p * NR);
                                let bp = b.data[p * b.panel_stride..].as_ptr();
                                let cp = c_ptr.get().add((r0 + g) * ldc + p * NR);
                                let prefetch = if gi == 0 {
                                    BPrefetch {
                                        ahead: true,
                                        ..BPrefetch::NONE
                                    }
                                } else {
                                    let step0 = ((gi - 1) * (q1 - q0) + (p - q0)) * chunks;
                                    BPrefetch {
                                        ahead: false,
                                        l2: (next as *const u8).wrapping_add(64 * step0 * per_step),
                                        l2_lines: per_step,
                                    }
                                };
                                group.panel_amx(bp, cp, cols, prefetch);
                            }
                        }
                        q0 = q1;
                    }
                    return;
                }
                for p in p0..p1 {
                    let cols = NR.min(b.n - p * NR);
                    let bp = b.data[p * b.panel_stride..].as_ptr();
                    // A gate/up panel writes its 16 outputs, a bf16 one 32 in 16 slots.
                    let cp = c_ptr.get().add(r0 * ldc + p * store.panel_width());
                    // The task's next panel goes to L2 while the row tiles pass over this one;
                    // for decode rows, this panel a fixed distance ahead of the first tile (not
                    // for a few rows: one tile then streams the panel once, and the hardware
                    // prefetcher keeps up; in-process A/B, cold B: 1 row 15% slower with it).
                    let decode_rows = rows <= STREAM_MAX_ROWS;
                    let prefetch = match b.prefetch {
                        _ if rows < PREFETCH_MIN_ROWS => PanelPrefetch::None,
                        TilePrefetch::Off => PanelPrefetch::None,
                        TilePrefetch::Auto if decode_rows => PanelPrefetch::Ahead,
                        _ if p + 1 < p1 => PanelPrefetch::Next(bp.add(b.panel_stride)),
                        _ => PanelPrefetch::None,
                    };
                    let store = block.store.at_col(p * NR);
                    block.panel_avx512(0, b.pairs, bp, cp, cols, store, prefetch);
                }
            }
        });
    };
    let tasks = blocks * runs;
    if parallel
        && tasks > 1
        && m * b.n * kp >= PARALLEL_MIN_MACS
        && rayon::current_num_threads() > 1
    {
        use rayon::prelude::*;
        (0..tasks).into_par_iter().for_each(task);
    } else {
        (0..tasks).for_each(task);
    }
}

/// One task's rows of A, already bf16, against the panels of B it owns.
struct Block {
    rows: usize,
    pairs: usize,
    a: *const u16,
    lda: usize,
    ldc: usize,
    store: Store,
}

impl Block {
    /// All rows against one panel with the AVX512 register tile, over the inner pairs
    /// `first..first + pairs`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn panel_avx512(
        &self,
        first: usize,
        pairs: usize,
        bp: *const u16,
        cp: *mut f32,
        cols: usize,
        store: Store,
        prefetch: PanelPrefetch,
    ) {
        // The panel's lines over these pairs (a tile reads 2 x NR bf16 per pair).
        let lines = pairs * 2 * NR * 2 / 64;
        let tiles = self.rows.div_ceil(MR);
        let mut r = 0;
        while r < self.rows {
            let mr = MR.min(self.rows - r);
            // Only addresses: `prefetcht1` of any address is harmless.
            let pf = match prefetch {
                PanelPrefetch::None => L2Prefetch::NONE,
                // The next panel's lines, spread evenly over the row tiles.
                PanelPrefetch::Next(next) => {
                    let per_tile = lines.div_ceil(tiles);
                    let done = (r / MR) * per_tile;
                    L2Prefetch {
                        start: (next.wrapping_add(first * 2 * NR) as *const u8)
                            .wrapping_add(64 * done),
                        lines: per_tile.min(lines.saturating_sub(done)),
                    }
                }
                // The first tile brings in what the tiles after it read from L2.
                PanelPrefetch::Ahead if r == 0 => L2Prefetch {
                    start: (bp.wrapping_add(first * 2 * NR) as *const u8)
                        .wrapping_add(64 * STREAM_AHEAD_LINES),
                    lines,
                },
                PanelPrefetch::Ahead => L2Prefetch::NONE,
            };
            // SAFETY: rows r..r + mr of A and C, pairs first..first + pairs of the panel.
            unsafe {
                tile(
                    mr,
                    pairs,
                    self.a.add(r * self.lda + 2 * first),
                    self.lda,
                    bp.add(first * 2 * NR),
                    cp.add(r * self.ldc),
                    self.ldc,
                    cols,
                    store.at_row(r),
                    pf,
                )
            };
            r += mr;
        }
    }

    /// All rows against one panel on AMX tiles, 32 rows at a time over the whole 16-pair
    /// chunks; the register tile adds the pairs left over. A must be readable for whole groups
    /// of 16 / 32 rows (the scratch is sized so).
    unsafe fn panel_amx(&self, bp: *const u16, cp: *mut f32, cols: usize, prefetch: BPrefetch) {
        let chunks = self.pairs / TILE_PAIRS;
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        if chunks > 0 {
            #[repr(align(64))]
            struct Out([f32; AMX_ROWS * NR]);
            // Left unset: the tiles store every row that `write_rows` then reads.
            let mut out = std::mem::MaybeUninit::<Out>::uninit();
            // SAFETY: a place inside `out`, not read: only its address is taken.
            let out_ptr = unsafe { std::ptr::addr_of_mut!((*out.as_mut_ptr()).0) } as *mut f32;
            let mut r = 0;
            while r < self.rows {
                let group = AMX_ROWS.min(self.rows - r);
                // SAFETY: the tile configuration was loaded by this task; A rows r..r + 32 (or
                // + 16) are readable, the panel holds `pairs` >= 16 * chunks pairs.
                unsafe {
                    let a = self.a.add(r * self.lda);
                    let c = cp.add(r * self.ldc);
                    // A whole 32x32 block that overwrites C is stored by the tiles straight
                    // into C; otherwise through `out` (the same sums, then [+]= into C).
                    let direct = group == AMX_ROWS && cols == NR && self.store == Store::Write;
                    let store = self.store.at_row(r);
                    let (o, ldo) = if direct { (c, self.ldc) } else { (out_ptr, NR) };
                    if group > TILE_ROWS {
                        super::amx::tiles_32(chunks, a, self.lda, bp, o, ldo, prefetch);
                    } else {
                        super::amx::tiles_16(chunks, a, self.lda, bp, o, ldo);
                    }
                    if !direct {
                        x86::write_rows(out_ptr, group, c, self.ldc, cols, store);
                    }
                }
                r += group;
            }
        }
        #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
        assert_eq!(chunks, 0, "AMX off this platform");
        let done = chunks * TILE_PAIRS;
        if done < self.pairs {
            // SAFETY: as above.
            unsafe {
                self.panel_avx512(
                    done,
                    self.pairs - done,
                    bp,
                    cp,
                    cols,
                    if chunks > 0 { Store::Add } else { self.store },
                    PanelPrefetch::None,
                )
            };
        }
    }
}

/// f32 row -> bf16 bits (round to nearest even, as the products round A), zero-padding `dst`
/// past the source. Panics if [`available`] is false.
pub(crate) fn to_bf16(src: &[f32], dst: &mut [u16]) {
    assert!(available() && dst.len() >= src.len(), "to_bf16");
    convert_row(src, dst)
}

/// f32 row -> bf16 bits, zero-padding `dst` past the source.
fn convert_row(src: &[f32], dst: &mut [u16]) {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: `gemm` checked `available()` (AVX512-F + BF16) before any call.
        unsafe { x86::convert_row(src, dst) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = bf16_bits(s);
        }
        dst[src.len()..].fill(0);
    }
}

/// What a register-tile pass over a panel prefetches into L2 (see `gemm_any`).
#[derive(Clone, Copy)]
enum PanelPrefetch {
    None,
    /// The task's next panel, spread over the row tiles.
    Next(*const u16),
    /// The panel itself, [`STREAM_AHEAD_LINES`] ahead of the first row tile's reads.
    Ahead,
}

mod store;
mod tile;
#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(test)]
mod tests;
