//! Intel AMX tiles for [`super::bf16_gemm`]: `tdpbf16ps` multiplies a 16x32 bf16 tile of A by a
//! 16-pair x 16-column tile of B into a 16x16 f32 tile, 16384 flops per instruction — eight
//! times what the AVX512-BF16 path gets from a core. The packed B layout needs no change: a
//! panel's inner pair `p` is one 128-byte line holding columns 0..16 then 16..32 as pairs, so
//! the two column tiles of a panel are 16 lines read with a 128-byte stride, at offsets 0 and 64.
//!
//! The instructions go through `asm!` (Rust's AMX intrinsics are not stable). Linux hands out the
//! tile state only on request (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`); that is
//! asked once per process by [`available`]. Each row of C depends on its own row of A only, so a
//! row computed alone or in a batch is the same bits, as on the AVX512 path.

/// Rows of A (and of C) in a tile.
pub const TILE_ROWS: usize = 16;
/// Inner pairs per tile step (64 bytes of bf16 per A row).
pub const TILE_PAIRS: usize = 16;

/// Whether this CPU has AMX-TILE and AMX-BF16 and the OS granted the tile state (asked once
/// per process). Whether the tiles are used is the backend's option (`kernels.amx`).
pub fn available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        {
            // SAFETY: cpuid and one arch_prctl syscall.
            unsafe { x86::request_tiles() }
        }
        #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
        {
            false
        }
    })
}

/// Whether the tiles are granted ([`available`]) and this CPU also has AMX-INT8 (`tdpbusd`,
/// for the W8A8 products in [`super::int8_gemm`]).
pub fn int8_available() -> bool {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    {
        // Leaf 7 exists where `available` said so.
        available() && std::arch::x86_64::__cpuid_count(7, 0).edx >> 25 & 1 == 1
    }
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    {
        false
    }
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
pub(crate) use x86::{configure, int8_tiles, qk_32_hd64, tiles_16, tiles_32};

/// What [`tiles_32`] prefetches while it runs. Prefetches never fault, so the addresses may
/// run past an operand.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BPrefetch {
    /// B is coming from memory (the first row group's pass over a run of panels, whose later
    /// groups then find it in L2): fetch it into L1 a few steps ahead of the tiles, on into the
    /// next panel, which follows in memory. Without it that pass waits on DRAM.
    pub ahead: bool,
    /// Into L2: `l2_lines` cache lines per tile step, from `l2` on (step `c` fetches lines
    /// `c * l2_lines..(c + 1) * l2_lines`): the next run of panels, spread over the passes that
    /// find their own panels in L2 already, so that run starts warm.
    pub l2: *const u8,
    pub l2_lines: usize,
}

impl BPrefetch {
    /// Nothing: operands that are warm already (attention, the probe).
    pub const NONE: BPrefetch = BPrefetch {
        ahead: false,
        l2: std::ptr::null(),
        l2_lines: 0,
    };
}

/// What this core's tiles deliver right now, in GFLOP/s on one thread (see [`probe`]).
#[derive(Clone, Copy, Debug)]
pub struct Probe {
    /// `tdpbf16ps` alone, back to back on four accumulators: the compute peak.
    pub products: f64,
    /// [`tiles_32`] (the GEMM's step) on operands that stay in L1: peak with the tile loads.
    pub with_loads: f64,
    /// `tdpbusd` alone, as `products` (GOP/s); 0 without AMX-INT8.
    pub int8_products: f64,
}

/// Times the tiles for a few milliseconds on the calling thread. The benches print it next to
/// their figures: on this project's VMs the products' rate held steady while the same kernel on
/// L1-resident operands ran anywhere from about a quarter of it to all of it within minutes
/// (the load path is shared with whatever else runs on the core), so a bench figure is only
/// comparable with one taken while `with_loads` was similar. None without AMX.
pub fn probe() -> Option<Probe> {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    if available() {
        // SAFETY: the tiles are granted (available), configured here, and the buffers below
        // cover what the steps read and write.
        return Some(unsafe { x86::probe() });
    }
    None
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
mod x86 {
    use super::{BPrefetch, TILE_PAIRS};
    use crate::kernels::packed::NR;
    use std::arch::asm;

    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;
    const SYS_ARCH_PRCTL: i64 = 158;
    /// How far ahead (in 16-pair chunks of 2 KiB per panel) [`tiles_16`] prefetches B.
    const PREFETCH_CHUNKS: usize = 8;
    /// Bytes of one inner pair of a packed panel (the B tiles' row stride).
    const B_PAIR_BYTES: usize = 2 * 2 * NR;
    /// u16 values of a panel per tile step (16 pairs).
    const B_CHUNK: usize = TILE_PAIRS * 2 * NR;

    #[allow(unused_unsafe)]
    pub(super) unsafe fn request_tiles() -> bool {
        use std::arch::x86_64::{__cpuid, __cpuid_count};
        // SAFETY: cpuid exists on every x86-64 CPU.
        let max_leaf = unsafe { __cpuid(0) }.eax;
        if max_leaf < 7 {
            return false;
        }
        let edx = unsafe { __cpuid_count(7, 0) }.edx;
        let (amx_bf16, amx_tile) = (edx >> 22 & 1 == 1, edx >> 24 & 1 == 1);
        if !(amx_bf16 && amx_tile) {
            return false;
        }
        let ret: i64;
        // SAFETY: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) only changes this
        // process's permission; the kernel refuses (non-zero) when it lacks AMX support.
        unsafe {
            asm!(
                "syscall",
                inlateout("rax") SYS_ARCH_PRCTL => ret,
                in("rdi") ARCH_REQ_XCOMP_PERM,
                in("rsi") XFEATURE_XTILEDATA,
                lateout("rcx") _,
                lateout("r11") _,
                options(nostack),
            );
        }
        ret == 0
    }

    /// Palette 1 with all eight tiles 16 rows x 64 bytes (the layout `tiles_*` use).
    #[repr(C, align(64))]
    struct TileConfig {
        palette: u8,
        start_row: u8,
        reserved: [u8; 14],
        colsb: [u16; 16],
        rows: [u8; 16],
    }

    static CONFIG: TileConfig = TileConfig {
        palette: 1,
        start_row: 0,
        reserved: [0; 14],
        colsb: [64, 64, 64, 64, 64, 64, 64, 64, 0, 0, 0, 0, 0, 0, 0, 0],
        rows: [16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0],
    };

    /// Loads the tile configuration on this thread (cheap; done once per GEMM task, as the
    /// thread may have run anything since).
    ///
    /// # Safety
    /// [`super::available`] must be true.
    pub(crate) unsafe fn configure() {
        unsafe { asm!("ldtilecfg [{}]", in(reg) &CONFIG, options(nostack, readonly)) };
    }

    /// 32 rows x 32 columns: `out` (row stride `ldo` f32) = A[0..32] · B panel over `chunks` x 16
    /// inner pairs. A: bf16 rows `lda` u16 apart; B: a packed panel (see the module comment).
    /// `prefetch` says what to fetch alongside (see [`BPrefetch`]).
    ///
    /// # Safety
    /// [`configure`] ran on this thread; A valid for 32 rows of `chunks * 32` values, B for
    /// `chunks * 16` pairs of a panel, `out` for 32 rows of 32 f32 at stride `ldo`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn tiles_32(
        chunks: usize,
        a: *const u16,
        lda: usize,
        b: *const u16,
        out: *mut f32,
        ldo: usize,
        prefetch: BPrefetch,
    ) {
        let lda_b = 2 * lda;
        unsafe {
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                options(nostack, nomem)
            );
            for c in 0..chunks {
                let a0 = a.add(c * 2 * TILE_PAIRS);
                let b0 = b.add(c * B_CHUNK);
                if prefetch.ahead {
                    prefetch_chunk(b0.wrapping_add(PREFETCH_CHUNKS * B_CHUNK));
                }
                for line in 0..prefetch.l2_lines {
                    // SAFETY: prefetching reads nothing architecturally.
                    std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(
                        prefetch
                            .l2
                            .wrapping_add(64 * (c * prefetch.l2_lines + line))
                            as *const i8,
                    );
                }
                // Tiles are not renamed: a load waits for the products that read its tile.
                // Interleaved, the next step's A0 and B0 loads overlap the last two products.
                asm!(
                    "tileloadd tmm4, [{a0} + {lda}*1]",
                    "tileloadd tmm6, [{b0} + {bs}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tileloadd tmm7, [{b1} + {bs}*1]",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tileloadd tmm5, [{a1} + {lda}*1]",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    a0 = in(reg) a0,
                    a1 = in(reg) a0.add(16 * lda),
                    lda = in(reg) lda_b,
                    b0 = in(reg) b0,
                    b1 = in(reg) b0.add(NR),
                    bs = in(reg) B_PAIR_BYTES,
                    options(nostack, readonly)
                );
            }
            store_sums(out as *mut u8, ldo * 4, true);
        }
    }

    /// Scores of 32 query rows against `panels` panels of packed keys, for a head width of 64
    /// (two tile steps): `out` (row stride `ldo` f32) = Q · Kᵀ. Q's four tiles (2 row groups x 2
    /// steps) are loaded once and stay; each 16-key column then costs two B loads, four
    /// products and two stores (`tiles_32` reloads A for every 32 keys).
    ///
    /// # Safety
    /// [`configure`] ran on this thread; `q` valid for 32 rows of 64 bf16 at stride `ldq`, `k`
    /// for `panels` panels of 64 inner values at `panel_stride` u16 apart, `out` for 32 rows of
    /// `32 * panels` f32 at stride `ldo`.
    pub(crate) unsafe fn qk_32_hd64(
        q: *const u16,
        ldq: usize,
        k: *const u16,
        panel_stride: usize,
        panels: usize,
        out: *mut f32,
        ldo: usize,
    ) {
        let ldq_b = 2 * ldq;
        let lo_b = 4 * ldo;
        unsafe {
            asm!(
                "tileloadd tmm4, [{q0} + {lq}*1]",
                "tileloadd tmm5, [{q1} + {lq}*1]",
                "tileloadd tmm6, [{q2} + {lq}*1]",
                "tileloadd tmm7, [{q3} + {lq}*1]",
                q0 = in(reg) q,
                q1 = in(reg) q.add(2 * TILE_PAIRS),
                q2 = in(reg) q.add(16 * ldq),
                q3 = in(reg) q.add(16 * ldq + 2 * TILE_PAIRS),
                lq = in(reg) ldq_b,
                options(nostack, readonly)
            );
            for j in 0..2 * panels {
                let b = k.add((j / 2) * panel_stride + (j % 2) * NR);
                let o = out.add(j * 16);
                asm!(
                    "tileloadd tmm2, [{b0} + {bs}*1]",
                    "tilezero tmm0",
                    "tdpbf16ps tmm0, tmm4, tmm2",
                    "tileloadd tmm3, [{b1} + {bs}*1]",
                    "tilezero tmm1",
                    "tdpbf16ps tmm1, tmm6, tmm2",
                    "tdpbf16ps tmm0, tmm5, tmm3",
                    "tdpbf16ps tmm1, tmm7, tmm3",
                    "tilestored [{o0} + {lo}*1], tmm0",
                    "tilestored [{o1} + {lo}*1], tmm1",
                    b0 = in(reg) b,
                    b1 = in(reg) b.add(B_CHUNK),
                    bs = in(reg) B_PAIR_BYTES,
                    o0 = in(reg) o,
                    o1 = in(reg) o.add(16 * ldo),
                    lo = in(reg) lo_b,
                    options(nostack)
                );
            }
        }
    }

    /// Stores the sums of tiles 0 and 1 (a row group's two 16-column tiles) as 16 rows of 32
    /// 4-byte values at `out`, rows `stride` bytes apart; with `lower`, tiles 2 and 3 too, as
    /// rows 16..32 (`16 * stride` bytes on).
    ///
    /// # Safety
    /// The tiles hold sums of the configured shape; `out` is valid for those rows.
    #[inline(always)]
    unsafe fn store_sums(out: *mut u8, stride: usize, lower: bool) {
        unsafe {
            asm!(
                "tilestored [{o0} + {s}*1], tmm0",
                "tilestored [{o1} + {s}*1], tmm1",
                o0 = in(reg) out,
                o1 = in(reg) out.add(64),
                s = in(reg) stride,
                options(nostack)
            );
            if lower {
                asm!(
                    "tilestored [{o2} + {s}*1], tmm2",
                    "tilestored [{o3} + {s}*1], tmm3",
                    o2 = in(reg) out.add(16 * stride),
                    o3 = in(reg) out.add(16 * stride + 64),
                    s = in(reg) stride,
                    options(nostack)
                );
            }
        }
    }

    /// Bytes of a 16 x 64-byte int8 tile.
    const INT8_TILE_BYTES: usize = 16 * 64;

    /// Exact int8 sums of `groups` (1 or 2) groups of 16 rows of A by two 16-column panels of
    /// B, over `chunks` x 64 inner values, on `tdpbusd` (u8 x s8, four products per 32-bit
    /// lane): `out` (row stride `ldo` i32) gets rows 0..16 (and 16..32) x columns 0..32.
    /// A: u8 rows `lda` bytes apart; B: panels of 64-byte lines, each line 16 columns x 4
    /// inner values (the tile's own layout: a chunk of a panel is 16 lines read at stride 64),
    /// the second panel `b_stride` bytes after the first. With `ahead`, B is fetched into L1
    /// a few chunks ahead (its first pass comes from memory).
    ///
    /// # Safety
    /// [`configure`] ran on this thread and [`super::int8_available`] is true; A valid for
    /// `16 * groups` rows of `64 * chunks` bytes, both panels for `chunks` chunks, `out` for
    /// `16 * groups` rows of 32 i32 at stride `ldo`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn int8_tiles(
        groups: usize,
        chunks: usize,
        a: *const u8,
        lda: usize,
        b: *const i8,
        b_stride: usize,
        out: *mut i32,
        ldo: usize,
        ahead: bool,
    ) {
        const AHEAD: usize = 8;
        unsafe {
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                options(nostack, nomem)
            );
            for c in 0..chunks {
                let a0 = a.add(c * 64);
                let b0 = b.add(c * INT8_TILE_BYTES);
                if ahead {
                    for line in 0..16 {
                        let at = b0.wrapping_add(AHEAD * INT8_TILE_BYTES + 64 * line);
                        // SAFETY: prefetching reads nothing architecturally.
                        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(at);
                        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                            at.wrapping_add(b_stride),
                        );
                    }
                }
                if groups == 2 {
                    // As in `tiles_32`: the next step's loads overlap the last products.
                    asm!(
                        "tileloadd tmm4, [{a0} + {lda}*1]",
                        "tileloadd tmm6, [{b0} + {bs}*1]",
                        "tdpbusd tmm0, tmm4, tmm6",
                        "tileloadd tmm7, [{b1} + {bs}*1]",
                        "tdpbusd tmm1, tmm4, tmm7",
                        "tileloadd tmm5, [{a1} + {lda}*1]",
                        "tdpbusd tmm2, tmm5, tmm6",
                        "tdpbusd tmm3, tmm5, tmm7",
                        a0 = in(reg) a0,
                        a1 = in(reg) a0.add(16 * lda),
                        lda = in(reg) lda,
                        b0 = in(reg) b0,
                        b1 = in(reg) b0.add(b_stride),
                        bs = in(reg) 64usize,
                        options(nostack, readonly)
                    );
                } else {
                    asm!(
                        "tileloadd tmm6, [{b0} + {bs}*1]",
                        "tileloadd tmm7, [{b1} + {bs}*1]",
                        "tileloadd tmm4, [{a0} + {lda}*1]",
                        "tdpbusd tmm0, tmm4, tmm6",
                        "tdpbusd tmm1, tmm4, tmm7",
                        a0 = in(reg) a0,
                        lda = in(reg) lda,
                        b0 = in(reg) b0,
                        b1 = in(reg) b0.add(b_stride),
                        bs = in(reg) 64usize,
                        options(nostack, readonly)
                    );
                }
            }
            store_sums(out as *mut u8, ldo * 4, groups == 2);
        }
    }

    /// See [`super::probe`]. Best of 7 rounds each, alternating.
    ///
    /// # Safety
    /// [`super::available`] must be true.
    pub(super) unsafe fn probe() -> super::Probe {
        use crate::kernels::aligned::AlignedU16;
        const CHUNKS: usize = 8;
        const ROUNDS: usize = 4000;
        unsafe { configure() };
        // A: 32 rows of 8 chunks (16 KiB), B: one panel's 8 chunks (16 KiB), out: 32 x 32.
        let lda = CHUNKS * 2 * TILE_PAIRS;
        let mut a = AlignedU16::zeroed(32 * lda);
        let mut b = AlignedU16::zeroed(CHUNKS * B_CHUNK);
        for (i, v) in a.iter_mut().chain(b.iter_mut()).enumerate() {
            *v = 0x3f80 + (i % 7) as u16; // 1.0 .. 1.05
        }
        #[repr(align(64))]
        struct Out([f32; 32 * NR]);
        let mut out = Out([0.0; 32 * NR]);
        let flop = (ROUNDS * CHUNKS * 4 * 16 * 16 * 32 * 2) as f64;
        let (mut products, mut with_loads, mut int8_products) = (0f64, 0f64, 0f64);
        let int8 = super::int8_available();
        for _ in 0..7 {
            if int8 {
                let t = std::time::Instant::now();
                for _ in 0..ROUNDS * CHUNKS {
                    // SAFETY: tile registers only (AMX-INT8 checked above).
                    unsafe {
                        asm!(
                            "tdpbusd tmm0, tmm4, tmm6",
                            "tdpbusd tmm1, tmm4, tmm7",
                            "tdpbusd tmm2, tmm5, tmm6",
                            "tdpbusd tmm3, tmm5, tmm7",
                            options(nostack, nomem)
                        )
                    };
                }
                // Twice the bf16 step's multiply-adds: 64 inner values per tile row.
                int8_products = int8_products.max(2.0 * flop / t.elapsed().as_secs_f64() / 1e9);
            }
            let t = std::time::Instant::now();
            for _ in 0..ROUNDS * CHUNKS {
                // SAFETY: tile registers only.
                unsafe {
                    asm!(
                        "tdpbf16ps tmm0, tmm4, tmm6",
                        "tdpbf16ps tmm1, tmm4, tmm7",
                        "tdpbf16ps tmm2, tmm5, tmm6",
                        "tdpbf16ps tmm3, tmm5, tmm7",
                        options(nostack, nomem)
                    )
                };
            }
            products = products.max(flop / t.elapsed().as_secs_f64() / 1e9);
            let t = std::time::Instant::now();
            for _ in 0..ROUNDS {
                // SAFETY: a, b and out are sized as tiles_32 reads and writes them.
                unsafe {
                    tiles_32(
                        CHUNKS,
                        a.as_ptr(),
                        lda,
                        b.as_ptr(),
                        out.0.as_mut_ptr(),
                        NR,
                        BPrefetch::NONE,
                    )
                };
            }
            with_loads = with_loads.max(flop / t.elapsed().as_secs_f64() / 1e9);
        }
        std::hint::black_box(&out);
        super::Probe {
            products,
            with_loads,
            int8_products,
        }
    }

    /// Prefetches one 16-pair chunk of a panel (32 lines) into L1. A prefetch never faults, so
    /// `at` may point past the operand (the last chunks of the last panel).
    #[inline(always)]
    fn prefetch_chunk(at: *const u16) {
        let at = at as *const i8;
        for line in 0..B_CHUNK * 2 / 64 {
            // SAFETY: prefetching reads nothing architecturally.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                    at.wrapping_add(64 * line),
                )
            };
        }
    }

    /// [`tiles_32`] for the first 16 rows only (`out` rows 0..16).
    ///
    /// # Safety
    /// As [`tiles_32`], with A valid for 16 rows.
    pub(crate) unsafe fn tiles_16(
        chunks: usize,
        a: *const u16,
        lda: usize,
        b: *const u16,
        out: *mut f32,
        ldo: usize,
    ) {
        let lda_b = 2 * lda;
        unsafe {
            asm!("tilezero tmm0", "tilezero tmm1", options(nostack, nomem));
            for c in 0..chunks {
                let a0 = a.add(c * 2 * TILE_PAIRS);
                let b0 = b.add(c * B_CHUNK);
                // Few rows: the product streams B from memory. Tile loads are not renamed, so
                // each waits for the products that read the previous one; prefetching B
                // `PREFETCH_CHUNKS` ahead keeps enough lines in flight.
                prefetch_chunk(b0.wrapping_add(PREFETCH_CHUNKS * B_CHUNK));
                asm!(
                    "tileloadd tmm6, [{b0} + {bs}*1]",
                    "tileloadd tmm7, [{b1} + {bs}*1]",
                    "tileloadd tmm4, [{a0} + {lda}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    a0 = in(reg) a0,
                    lda = in(reg) lda_b,
                    b0 = in(reg) b0,
                    b1 = in(reg) b0.add(NR),
                    bs = in(reg) B_PAIR_BYTES,
                    options(nostack, readonly)
                );
            }
            store_sums(out as *mut u8, ldo * 4, false);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probe_reports_rates_where_the_tiles_are() {
        match probe() {
            Some(p) => {
                for rate in [p.products, p.with_loads] {
                    assert!(rate.is_finite() && rate > 0.0, "{p:?}");
                }
            }
            None => assert!(!available(), "tiles available but no probe"),
        }
    }
}
