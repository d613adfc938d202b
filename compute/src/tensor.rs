//! Host-side data crossing the seam: little-endian bytes, a dtype and a shape. Backends turn it
//! into whatever their device holds; the services only move it (wire chunks, caches).
use crate::error::{ComputeError, Result};
use half::{bf16, f16};
use std::sync::Arc;

/// Element type of a [`HostTensor`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HostDtype {
    F32,
    F16,
    Bf16,
}

impl HostDtype {
    pub fn size_in_bytes(self) -> usize {
        match self {
            HostDtype::F32 => 4,
            HostDtype::F16 | HostDtype::Bf16 => 2,
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            HostDtype::F32 => "f32",
            HostDtype::F16 => "f16",
            HostDtype::Bf16 => "bf16",
        }
    }
}

impl From<vlm_config::Dtype> for HostDtype {
    fn from(d: vlm_config::Dtype) -> Self {
        match d {
            vlm_config::Dtype::F32 => HostDtype::F32,
            vlm_config::Dtype::F16 => HostDtype::F16,
            vlm_config::Dtype::Bf16 => HostDtype::Bf16,
        }
    }
}

/// A dense row-major array in host memory. Cloning shares the bytes.
#[derive(Clone, PartialEq)]
pub struct HostTensor {
    dtype: HostDtype,
    shape: Vec<usize>,
    data: Arc<[u8]>,
}

impl std::fmt::Debug for HostTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostTensor({:?}, {:?})", self.dtype, self.shape)
    }
}

impl HostTensor {
    /// `bytes` holding `shape` values of `dtype`, little-endian; an error when the length does
    /// not match.
    pub fn from_le_bytes(dtype: HostDtype, shape: Vec<usize>, bytes: Vec<u8>) -> Result<Self> {
        let want = shape.iter().product::<usize>() * dtype.size_in_bytes();
        if bytes.len() != want {
            return Err(ComputeError::invalid(format!(
                "{} bytes for a {shape:?} {} tensor, which needs {want}",
                bytes.len(),
                dtype.as_str()
            )));
        }
        Ok(HostTensor {
            dtype,
            shape,
            data: bytes.into(),
        })
    }

    /// f32 values of `shape`.
    pub fn from_f32(values: &[f32], shape: Vec<usize>) -> Result<Self> {
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Self::from_le_bytes(HostDtype::F32, shape, bytes)
    }

    pub fn dtype(&self) -> HostDtype {
        self.dtype
    }
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    /// The first dimension (0 for a scalar).
    pub fn rows(&self) -> usize {
        self.shape.first().copied().unwrap_or(0)
    }
    /// Values per row (the product of the other dimensions).
    pub fn row_len(&self) -> usize {
        self.shape.iter().skip(1).product()
    }
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The raw little-endian bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.data
    }
    pub fn byte_len(&self) -> usize {
        self.data.len()
    }

    /// Rows `start..start + out.len() / row_len()` widened to f32 into `out`.
    pub fn rows_to_f32(&self, start: usize, out: &mut [f32]) -> Result<()> {
        let per_row = self.row_len().max(1);
        let rows = out.len() / per_row;
        if !out.len().is_multiple_of(per_row) || start + rows > self.rows() {
            return Err(ComputeError::invalid(format!(
                "rows {start}..{} of a {:?} tensor",
                start + rows,
                self.shape
            )));
        }
        let size = self.dtype.size_in_bytes();
        let bytes = &self.data[start * per_row * size..(start + rows) * per_row * size];
        match self.dtype {
            HostDtype::F32 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            HostDtype::F16 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
            HostDtype::Bf16 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = bf16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
        }
        Ok(())
    }

    /// Every value widened to f32.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.len()];
        if !out.is_empty() {
            self.rows_to_f32(0, &mut out)
                .expect("the whole tensor is in bounds");
        }
        out
    }

    /// The values in `dtype`, little-endian (f32 narrowed with round-to-nearest-even, as a
    /// tensor library's cast does).
    pub fn to_le_bytes(&self, dtype: HostDtype) -> Vec<u8> {
        if dtype == self.dtype {
            return self.data.to_vec();
        }
        let values = self.to_f32();
        match dtype {
            HostDtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            HostDtype::F16 => values
                .iter()
                .flat_map(|v| f16::from_f32(*v).to_le_bytes())
                .collect(),
            HostDtype::Bf16 => values
                .iter()
                .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_round_trip_and_rows_widen() {
        let t = HostTensor::from_f32(&[1.0, 2.5, -3.0, 4.0, 5.0, 6.0], vec![3, 2]).unwrap();
        assert_eq!((t.rows(), t.row_len(), t.byte_len()), (3, 2, 24));
        let mut two = [0f32; 4];
        t.rows_to_f32(1, &mut two).unwrap();
        assert_eq!(two, [-3.0, 4.0, 5.0, 6.0]);
        let half =
            HostTensor::from_le_bytes(HostDtype::Bf16, vec![3, 2], t.to_le_bytes(HostDtype::Bf16))
                .unwrap();
        assert_eq!(half.to_f32(), t.to_f32());
        assert!(t.rows_to_f32(2, &mut two).is_err());
        assert!(HostTensor::from_le_bytes(HostDtype::F32, vec![2], vec![0; 7]).is_err());
    }
}
