//! The right-hand operand of [`super::bf16_gemm`] in the layout its kernel reads ("VNNI"
//! layout): bf16 values in panels of [`NR`] output columns; inside a panel, for each pair of
//! inner-dimension indices (2p, 2p+1), the 32 columns' two values side by side:
//! `panel[(p * NR + col) * 2 + (i & 1)]` holds B(i = 2p + (i & 1), col). One `vdpbf16ps` then
//! multiplies a broadcast pair of the left operand with 16 columns' pairs.
//!
//! Columns past `n` and the odd tail of the inner dimension are zero, so the kernel never
//! branches on them. Weights are packed once at load; attention packs K and V per layer.
use super::aligned::AlignedU16;
use half::bf16;

/// Output columns per panel: two 16-lane vectors.
pub const NR: usize = 32;

/// f32 -> bf16 bits, round to nearest even (what torch's `.to(torch.bfloat16)` does).
#[inline(always)]
pub fn bf16_bits(x: f32) -> u16 {
    bf16::from_f32(x).to_bits()
}

/// A value that can be written into a packed panel.
pub trait PackElem: Copy + Send + Sync {
    fn bits(self) -> u16;
}
impl PackElem for f32 {
    #[inline(always)]
    fn bits(self) -> u16 {
        bf16_bits(self)
    }
}
impl PackElem for bf16 {
    #[inline(always)]
    fn bits(self) -> u16 {
        self.to_bits()
    }
}
/// An FP8 KV cache's codes: every E4M3 value is a bf16 value.
impl PackElem for float8::F8E4M3 {
    #[inline(always)]
    fn bits(self) -> u16 {
        super::e4m3::BF16_BITS[self.to_bits() as usize]
    }
}
/// bf16 bits already rounded (by the vector conversion, say).
impl PackElem for u16 {
    #[inline(always)]
    fn bits(self) -> u16 {
        self
    }
}

/// Panel-major storage of B (n columns, k inner) — see the module comment.
#[derive(Debug, Clone, Default)]
pub struct PackedB {
    n: usize,
    k: usize,
    /// 64-byte aligned: the AMX tiles load each panel's rows whole (see `aligned`).
    data: AlignedU16,
    /// Products with this B run on AMX tiles (the backend's option), see [`BView::with_amx`].
    ///
    /// [`BView::with_amx`]: super::bf16_gemm::BView::with_amx
    amx: bool,
    /// A gate and an up weight interleaved ([`PackedB::interleave_gate_up`]): each panel's
    /// first 16 columns are gate columns, its last 16 the up columns of the same outputs.
    gate_up: bool,
}

impl PackedB {
    /// Inner dimension rounded up to a pair.
    fn kp(k: usize) -> usize {
        k.next_multiple_of(2)
    }
    /// u16 elements of one panel.
    pub fn panel_len(&self) -> usize {
        Self::kp(self.k) * NR
    }
    pub fn n(&self) -> usize {
        self.n
    }
    pub fn k(&self) -> usize {
        self.k
    }
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        2 * self.data.len()
    }
    pub(crate) fn data(&self) -> &[u16] {
        &self.data
    }
    /// This packing with its products on AMX tiles when `on` (and the CPU has them).
    pub fn with_amx(mut self, on: bool) -> PackedB {
        self.amx = on && super::amx::available();
        self
    }
    /// Whether products with this B run on AMX tiles.
    pub fn amx(&self) -> bool {
        self.amx
    }

    /// u16 elements a packing of (n, k) holds.
    pub fn len_for(n: usize, k: usize) -> usize {
        n.div_ceil(NR) * Self::kp(k) * NR
    }

    /// Packs B given as its transpose's rows: `rows[j * ld + i]` = B(i, j) for j < n, i < k —
    /// a linear layer's (out, in) weight, or attention's K (keys, head_dim).
    pub fn from_rows<T: PackElem>(rows: &[T], n: usize, k: usize, ld: usize) -> PackedB {
        let mut data = AlignedU16::zeroed(Self::len_for(n, k));
        pack_rows_into(&mut data, rows, n, k, ld);
        PackedB {
            n,
            k,
            data,
            amx: false,
            gate_up: false,
        }
    }

    /// Packs a contiguous (n, k) bf16 CPU tensor (a linear layer's weight); `None` for other
    /// dtypes or devices.
    pub fn from_bf16_tensor(w: &candle_core::Tensor) -> candle_core::Result<Option<PackedB>> {
        use candle_core::{CpuStorage, Storage};
        let (n, k) = w.dims2()?;
        let (guard, layout) = w.storage_and_layout();
        Ok(match (&*guard, layout.contiguous_offsets()) {
            (Storage::Cpu(CpuStorage::BF16(v)), Some((a, b))) => {
                Some(PackedB::from_rows(&v[a..b], n, k, k))
            }
            _ => None,
        })
    }

    /// Several packings of the same k side by side (columns of the first, then of the second,
    /// ...): one product then computes them all. `None` unless every part but the last has a
    /// whole number of panels, so that the panels concatenate as they are.
    pub fn concat_n(parts: &[&PackedB]) -> Option<PackedB> {
        let k = parts.first()?.k;
        let (last, init) = parts.split_last()?;
        if parts.iter().any(|p| p.k != k) || init.iter().any(|p| p.n % NR != 0) {
            return None;
        }
        let mut data = AlignedU16::zeroed(parts.iter().map(|p| p.data.len()).sum());
        let mut at = 0;
        for p in parts {
            data[at..at + p.data.len()].copy_from_slice(&p.data);
            at += p.data.len();
        }
        Some(PackedB {
            n: init.iter().map(|p| p.n).sum::<usize>() + last.n,
            k,
            data,
            amx: parts[0].amx,
            gate_up: false,
        })
    }

    /// The gate and up weights of an MLP (both (inter, k)) in one packing whose panel p holds
    /// gate columns 16p..16p+16 then up columns 16p..16p+16: one register tile then sums a
    /// gate value and its up value side by side, and the product can write silu(gate)·up
    /// directly (`bf16_gemm::gemm_gate_up_silu`). `None` unless both have the same shape
    /// with a whole number of 16-column halves.
    pub fn interleave_gate_up(gate: &PackedB, up: &PackedB) -> Option<PackedB> {
        let (n, k) = (gate.n, gate.k);
        if up.n != n || up.k != k || n == 0 || !n.is_multiple_of(NR / 2) {
            return None;
        }
        let half = NR / 2;
        let panels = n / half;
        let mut data = AlignedU16::zeroed(panels * gate.panel_len());
        // Per pair row of a panel, NR columns x 2 values: 16 columns of a source are 32
        // consecutive u16 of its panel (16p..16p+16 never straddles two source panels).
        let row = 2 * NR;
        for p in 0..panels {
            let (src_panel, src_col) = ((p * half) / NR, (p * half) % NR);
            let dst = &mut data[p * gate.panel_len()..(p + 1) * gate.panel_len()];
            for q in 0..Self::kp(k) / 2 {
                let from = src_panel * gate.panel_len() + q * row + 2 * src_col;
                dst[q * row..q * row + NR].copy_from_slice(&gate.data[from..from + NR]);
                dst[q * row + NR..(q + 1) * row].copy_from_slice(&up.data[from..from + NR]);
            }
        }
        Some(PackedB {
            n: 2 * n,
            k,
            data,
            amx: gate.amx,
            gate_up: true,
        })
    }

    /// Whether this is an [`Self::interleave_gate_up`] packing (whose plain product gives
    /// its columns interleaved in halves of panels).
    pub fn gate_up(&self) -> bool {
        self.gate_up
    }

    /// Column j of B (row j of the original (n, k) weight) widened to f32: the embedding
    /// lookup of a tied `lm_head`.
    pub fn column_f32(&self, j: usize, out: &mut [f32]) {
        assert!(
            j < self.n && out.len() >= self.k,
            "column_f32: {j} of {}",
            self.n
        );
        let panel = &self.data[(j / NR) * self.panel_len()..];
        let c = j % NR;
        for (i, o) in out[..self.k].iter_mut().enumerate() {
            let bits = panel[((i / 2) * NR + c) * 2 + (i & 1)];
            *o = f32::from_bits((bits as u32) << 16);
        }
    }

    /// The original (n, k) row-major matrix, widened to f32 (for the candle fallback paths).
    pub fn to_rows_f32(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.n * self.k];
        for (j, row) in out.chunks_exact_mut(self.k.max(1)).enumerate().take(self.n) {
            self.column_f32(j, row);
        }
        out
    }
}

/// Writes the packing of (n, k) given as rows (see [`PackedB::from_rows`]) into `dst`
/// (at least [`PackedB::len_for`] elements; untouched padding must already be zero).
pub fn pack_rows_into<T: PackElem>(dst: &mut [u16], rows: &[T], n: usize, k: usize, ld: usize) {
    let panel_len = PackedB::kp(k) * NR;
    assert!(
        dst.len() >= n.div_ceil(NR) * panel_len,
        "pack_rows_into: dst"
    );
    for j in 0..n {
        let src = &rows[j * ld..j * ld + k];
        let panel = &mut dst[(j / NR) * panel_len..(j / NR + 1) * panel_len];
        let c = j % NR;
        for (i, &v) in src.iter().enumerate() {
            panel[((i / 2) * NR + c) * 2 + (i & 1)] = v.bits();
        }
    }
}

/// Writes column `j` of B (row j of the (n, k) original: a key row of K) into a packing of
/// (n, k).
#[inline]
pub fn pack_column<T: PackElem>(dst: &mut [u16], k: usize, j: usize, values: &[T]) {
    let panel = &mut dst[(j / NR) * PackedB::kp(k) * NR..];
    let c = j % NR;
    for (i, &v) in values[..k].iter().enumerate() {
        panel[((i / 2) * NR + c) * 2 + (i & 1)] = v.bits();
    }
}

/// Writes one row `i` of B (the values of the inner index `i` for columns 0..n) into a packing
/// of (n, k), as attention does for V (keys, head_dim): B(i, j) = V[i][j].
#[inline]
pub fn pack_inner_row<T: PackElem>(dst: &mut [u16], k: usize, i: usize, values: &[T]) {
    let panel_len = PackedB::kp(k) * NR;
    for (j, &v) in values.iter().enumerate() {
        dst[(j / NR) * panel_len + ((i / 2) * NR + j % NR) * 2 + (i & 1)] = v.bits();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gate_up_interleaves_halves_of_panels() {
        let (n, k) = (48, 7);
        let val = |i: usize| ((i % 61) as f32 * 0.5) - 15.0;
        let g: Vec<f32> = (0..n * k).map(val).collect();
        let u: Vec<f32> = (0..n * k).map(|i| val(i + 5) * 2.0).collect();
        let (gp, up) = (
            PackedB::from_rows(&g, n, k, k),
            PackedB::from_rows(&u, n, k, k),
        );
        let both = PackedB::interleave_gate_up(&gp, &up).unwrap();
        assert!(both.gate_up() && both.n() == 2 * n);
        let (mut got, mut want) = (vec![0f32; k], vec![0f32; k]);
        for j in 0..2 * n {
            let (p, c) = (j / NR, j % NR);
            let (src, col) = if c < NR / 2 {
                (&gp, p * NR / 2 + c)
            } else {
                (&up, p * NR / 2 + c - NR / 2)
            };
            both.column_f32(j, &mut got);
            src.column_f32(col, &mut want);
            assert_eq!(got, want, "column {j}");
        }
        assert!(PackedB::interleave_gate_up(&gp, &PackedB::from_rows(&g, 40, k, k)).is_none());
    }

    #[test]
    fn rows_round_trip_and_inner_rows_agree() {
        let (n, k) = (70, 13);
        let rows: Vec<f32> = (0..n * k).map(|i| ((i % 64) as f32 * 0.25) - 8.0).collect();
        let p = PackedB::from_rows(&rows, n, k, k);
        assert_eq!(p.to_rows_f32(), rows); // quarter steps below 8 are exact in bf16
        let mut q = vec![0u16; PackedB::len_for(n, k)];
        for i in 0..k {
            let col: Vec<f32> = (0..n).map(|j| rows[j * k + i]).collect();
            pack_inner_row(&mut q, k, i, &col);
        }
        assert_eq!(q[..], p.data[..]);
    }
}
