//! How a register tile's sums meet C: written, added, rescaled, or through a fused epilogue.
use super::NR;

/// How the sums of a register tile go to C.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Store {
    /// C = A·B.
    Write,
    /// C += A·B.
    Add,
    /// The panels are interleaved gate/up: C = silu(gate)·up, half the columns
    /// (see [`gemm_gate_up_silu`]).
    SiluMul,
    /// C = C * scale[row] + A·B (see [`gemm_bf16_a_rescale`]).
    ScaleAdd(RowScale),
    /// C (bf16, two per f32 slot) = gelu_tanh(A·B + bias[col]) (see [`gemm_bias_gelu_bf16`]).
    BiasGeluBf16(ColBias),
}

/// The bias of [`Store::BiasGeluBf16`], from the column its panel starts at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct ColBias(pub(super) *const f32);
// SAFETY: only read, under `gemm_bias_gelu_bf16`'s contract.
unsafe impl Send for ColBias {}
unsafe impl Sync for ColBias {}

/// Per-row factors of [`Store::ScaleAdd`], from the row its C pointer starts at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct RowScale(pub(super) *const f32);
// SAFETY: only read, under `gemm_bf16_a_rescale`'s contract.
unsafe impl Send for RowScale {}
unsafe impl Sync for RowScale {}

impl Store {
    pub(super) fn new(accumulate: bool) -> Store {
        if accumulate {
            Store::Add
        } else {
            Store::Write
        }
    }

    /// This store for a C pointer `rows` rows further on.
    pub(super) fn at_row(self, rows: usize) -> Store {
        match self {
            Store::ScaleAdd(RowScale(f)) => Store::ScaleAdd(RowScale(f.wrapping_add(rows))),
            other => other,
        }
    }

    /// This store for the panel whose first column is `col`.
    pub(super) fn at_col(self, col: usize) -> Store {
        match self {
            Store::BiasGeluBf16(ColBias(b)) => Store::BiasGeluBf16(ColBias(b.wrapping_add(col))),
            other => other,
        }
    }

    /// f32 slots of C a panel's outputs take: half a panel where two values share one.
    pub(super) fn panel_width(self) -> usize {
        match self {
            Store::SiluMul | Store::BiasGeluBf16(_) => NR / 2,
            _ => NR,
        }
    }

    /// How row `r` of a tile whose C pointer this store starts at meets C's old value.
    pub(super) fn prior(self, r: usize) -> Prior {
        match self {
            Store::Write | Store::SiluMul | Store::BiasGeluBf16(_) => Prior::Drop,
            Store::Add => Prior::Add,
            // SAFETY: the factors cover the rows (`gemm_bf16_a_rescale`'s contract).
            Store::ScaleAdd(RowScale(f)) => Prior::Scale(unsafe { *f.add(r) }),
        }
    }
}

/// What becomes of a C value the tile's sum goes to.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Prior {
    /// Overwritten.
    Drop,
    /// Added to.
    Add,
    /// Multiplied by this, then added to (one fused multiply-add).
    Scale(f32),
}
