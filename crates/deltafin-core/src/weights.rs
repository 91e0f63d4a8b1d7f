//! Weight bytes borrowed from whoever owns them (a memory map, an expert buffer, a `Vec`).
//!
//! The core never opens a file. The store hands it [`TensorBytes`] whose [`Bytes`] point into a
//! memory map or a read buffer; the kernels read BF16 and MXFP4 straight from those bytes, so no
//! weight is ever widened or copied as a whole.

use std::sync::{Arc, Weak};

use crate::error::{Error, Result};

/// Anything that owns a byte buffer and can lend it out for as long as it lives.
pub trait ByteOwner: Send + Sync {
    /// The owned bytes.
    fn bytes(&self) -> &[u8];
}

impl ByteOwner for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }
}

/// A cheap-to-clone view of a range of an owner's bytes.
#[derive(Clone)]
pub struct Bytes {
    owner: Arc<dyn ByteOwner>,
    start: usize,
    len: usize,
}

impl std::fmt::Debug for Bytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Bytes({}..{})", self.start, self.start + self.len)
    }
}

impl Bytes {
    /// A view of `owner[start..start + len]`; panics if out of range (a caller bug, not bad data).
    pub fn new(owner: Arc<dyn ByteOwner>, start: usize, len: usize) -> Bytes {
        assert!(start + len <= owner.bytes().len(), "Bytes range out of bounds");
        Bytes { owner, start, len }
    }
    /// Takes ownership of a vector.
    pub fn from_vec(v: Vec<u8>) -> Bytes {
        let len = v.len();
        Bytes { owner: Arc::new(v), start: 0, len }
    }
    /// The viewed bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.owner.bytes()[self.start..self.start + self.len]
    }
    /// A sub-range of this view.
    pub fn slice(&self, start: usize, len: usize) -> Bytes {
        assert!(start + len <= self.len, "Bytes::slice out of bounds");
        Bytes { owner: self.owner.clone(), start: self.start + start, len }
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the view is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Who these bytes are, for a backend that keeps its own copy of them (a GPU): equal ids
    /// name the same bytes for as long as the id is held, because it keeps the owner's address
    /// from being reused (see [`BytesId`]).
    pub fn id(&self) -> BytesId {
        BytesId { owner: Arc::downgrade(&self.owner), start: self.start, len: self.len }
    }
}

/// The identity of a [`Bytes`] view: its owner and range. It holds the owner weakly: the bytes
/// may go, but while any id is held no other owner can take the same address, so
/// [`BytesId::key`] never names two different buffers. Owners never change the bytes they lend.
#[derive(Clone)]
pub struct BytesId {
    owner: Weak<dyn ByteOwner>,
    start: usize,
    len: usize,
}

impl BytesId {
    /// `(owner address, start, len)`: equal keys are the same bytes while this id is held.
    pub fn key(&self) -> (usize, usize, usize) {
        (self.owner.as_ptr() as *const u8 as usize, self.start, self.len)
    }
    /// Whether the owner still holds the bytes (else a copy kept under this id can go).
    pub fn alive(&self) -> bool {
        self.owner.strong_count() > 0
    }
}

impl std::fmt::Debug for BytesId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BytesId({:?})", self.key())
    }
}

/// Element types found in K3 checkpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    Bf16,
    F32,
    U8,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::Bf16 => 2,
            DType::F32 => 4,
            DType::U8 => 1,
        }
    }
}

/// One named tensor as stored, with the file it came from (for error messages).
#[derive(Clone, Debug)]
pub struct TensorBytes {
    pub name: String,
    pub file: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub bytes: Bytes,
}

/// Where the core gets spine tensors from. Implemented by the store.
pub trait TensorSource {
    /// The tensor called `name`, or [`Error::MissingTensor`].
    fn tensor(&self, name: &str) -> Result<TensorBytes>;
}

impl TensorBytes {
    /// Checks dtype and shape, naming the tensor and its file on mismatch.
    pub fn expect(self, dtype: DType, shape: &[usize]) -> Result<TensorBytes> {
        if self.dtype != dtype || self.shape != shape {
            return Err(Error::BadTensor {
                name: self.name,
                file: self.file,
                expected: format!("{dtype:?} {shape:?}"),
                found: format!("{:?} {:?}", self.dtype, self.shape),
            });
        }
        Ok(self)
    }

    /// Reads an F32 tensor of any shape with `numel` elements into a vector (used only for the
    /// small F32 tensors: gates, biases, conv weights).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        match self.dtype {
            DType::F32 => self.bytes.as_slice().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            DType::Bf16 => self.bytes.as_slice().chunks_exact(2).map(|c| bf16_to_f32(u16::from_le_bytes([c[0], c[1]]))).collect(),
            DType::U8 => self.bytes.as_slice().iter().map(|&b| b as f32).collect(),
        }
    }
}

/// BF16 to F32 is exact: the BF16 bits are the top half of the F32.
#[inline(always)]
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// A row-major BF16 matrix `[rows, cols]` over borrowed bytes.
#[derive(Clone, Debug)]
pub struct Bf16Matrix {
    pub rows: usize,
    pub cols: usize,
    bytes: Bytes,
}

impl Bf16Matrix {
    /// Wraps a BF16 tensor, checking its shape is `[rows, cols]`.
    pub fn from_tensor(t: TensorBytes, rows: usize, cols: usize) -> Result<Bf16Matrix> {
        let t = t.expect(DType::Bf16, &[rows, cols])?;
        Ok(Bf16Matrix { rows, cols, bytes: t.bytes })
    }
    /// Builds from raw little-endian BF16 bytes (tests, generated weights).
    pub fn from_bytes(bytes: Bytes, rows: usize, cols: usize) -> Bf16Matrix {
        assert_eq!(bytes.len(), rows * cols * 2);
        Bf16Matrix { rows, cols, bytes }
    }
    /// Row `r` as BF16 bytes.
    #[inline]
    pub fn row(&self, r: usize) -> &[u8] {
        let w = self.cols * 2;
        &self.bytes.as_slice()[r * w..(r + 1) * w]
    }
    /// Row `r` widened to F32 (embedding lookup).
    pub fn row_f32(&self, r: usize) -> Vec<f32> {
        self.row(r).chunks_exact(2).map(|c| bf16_to_f32(u16::from_le_bytes([c[0], c[1]]))).collect()
    }
    /// Element `(r, c)`.
    #[inline]
    pub fn at(&self, r: usize, c: usize) -> f32 {
        let i = (r * self.cols + c) * 2;
        let b = self.bytes.as_slice();
        bf16_to_f32(u16::from_le_bytes([b[i], b[i + 1]]))
    }
    /// Bytes held (for memory accounting).
    pub fn byte_len(&self) -> usize {
        self.bytes.len()
    }
    /// The stored BF16 bytes, row-major.
    pub fn bytes(&self) -> &Bytes {
        &self.bytes
    }
}
