//! Element types: f32, bf16 and f16, and host data of any of them: the borrowed and owned
//! buffers of one rank that cross the backend interface tagged with their type. Reductions on
//! the half types accumulate in f32.

use half::{bf16, f16};
use std::fmt;
use std::str::FromStr;

/// The element type of a collective's buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    BF16,
    F16,
}

impl DType {
    pub const ALL: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
        }
    }

    /// Relative tolerance against the float64 reference, scaled by the magnitude of the inputs.
    pub fn tolerance(self) -> f64 {
        match self {
            DType::F32 => 1e-5,
            DType::BF16 | DType::F16 => 1e-2,
        }
    }

    /// Unit roundoff: the largest relative error of one rounding to this type.
    pub fn unit_roundoff(self) -> f64 {
        match self {
            DType::F32 => f64::powi(2.0, -24),
            DType::BF16 => f64::powi(2.0, -8),
            DType::F16 => f64::powi(2.0, -11),
        }
    }

    /// Rounds an f64 to the nearest value of this type (what storing it would give).
    pub fn round(self, x: f64) -> f64 {
        match self {
            DType::F32 => x as f32 as f64,
            DType::BF16 => bf16::from_f64(x).to_f64(),
            DType::F16 => f16::from_f64(x).to_f64(),
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float" | "float32" => Ok(DType::F32),
            "bf16" | "bfloat16" => Ok(DType::BF16),
            "f16" | "half" | "float16" => Ok(DType::F16),
            _ => Err(format!("unknown dtype '{s}' (choose f32, bf16 or f16)")),
        }
    }
}

/// A borrowed host view of one rank's buffer.
#[derive(Debug, Clone, Copy)]
pub enum HostSlice<'a> {
    F32(&'a [f32]),
    BF16(&'a [bf16]),
    F16(&'a [f16]),
}

/// A mutable host view of one rank's buffer.
#[derive(Debug)]
pub enum HostSliceMut<'a> {
    F32(&'a mut [f32]),
    BF16(&'a mut [bf16]),
    F16(&'a mut [f16]),
}

impl HostSlice<'_> {
    pub fn len(&self) -> usize {
        match self {
            HostSlice::F32(s) => s.len(),
            HostSlice::BF16(s) => s.len(),
            HostSlice::F16(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn dtype(&self) -> DType {
        match self {
            HostSlice::F32(_) => DType::F32,
            HostSlice::BF16(_) => DType::BF16,
            HostSlice::F16(_) => DType::F16,
        }
    }
}

/// An owned host buffer of one rank: the inputs and outputs of queued calls.
#[derive(Debug, Clone, PartialEq)]
pub enum HostBuffer {
    F32(Vec<f32>),
    BF16(Vec<bf16>),
    F16(Vec<f16>),
}

impl HostBuffer {
    /// `len` zeros of `dtype`.
    pub fn zeroed(dtype: DType, len: usize) -> HostBuffer {
        match dtype {
            DType::F32 => HostBuffer::F32(vec![0.0; len]),
            DType::BF16 => HostBuffer::BF16(vec![bf16::ZERO; len]),
            DType::F16 => HostBuffer::F16(vec![f16::ZERO; len]),
        }
    }

    pub fn as_slice(&self) -> HostSlice<'_> {
        match self {
            HostBuffer::F32(v) => HostSlice::F32(v),
            HostBuffer::BF16(v) => HostSlice::BF16(v),
            HostBuffer::F16(v) => HostSlice::F16(v),
        }
    }

    pub fn as_mut_slice(&mut self) -> HostSliceMut<'_> {
        match self {
            HostBuffer::F32(v) => HostSliceMut::F32(v),
            HostBuffer::BF16(v) => HostSliceMut::BF16(v),
            HostBuffer::F16(v) => HostSliceMut::F16(v),
        }
    }

    pub fn len(&self) -> usize {
        self.as_slice().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn dtype(&self) -> DType {
        self.as_slice().dtype()
    }
}

/// A plain-old-data element whose all-zero bit pattern is 0.0.
///
/// # Safety
/// Implementors must be `Copy` types without padding or invalid bit patterns, so that zeroed
/// memory is a valid value and bytes may be shared between threads as raw memory. The
/// `bytemuck::Pod` bound states the same in a form the compiler checks (device copies need it).
pub unsafe trait Element:
    bytemuck::Pod + Send + Sync + PartialEq + fmt::Debug + 'static
{
    const DTYPE: DType;
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
    fn to_f64(self) -> f64;
    fn from_f64(x: f64) -> Self;
    /// A value no correct collective produces, written into outputs before each run.
    fn poison() -> Self {
        Self::from_f32(f32::NAN)
    }
    fn host(s: &[Self]) -> HostSlice<'_>;
    fn host_mut(s: &mut [Self]) -> HostSliceMut<'_>;
    fn from_host(s: HostSlice<'_>) -> Option<&[Self]>;
    fn from_host_mut(s: HostSliceMut<'_>) -> Option<&mut [Self]>;
    fn into_host_buffer(v: Vec<Self>) -> HostBuffer;
}

macro_rules! host_views {
    ($variant:ident) => {
        fn host(s: &[Self]) -> HostSlice<'_> {
            HostSlice::$variant(s)
        }
        fn host_mut(s: &mut [Self]) -> HostSliceMut<'_> {
            HostSliceMut::$variant(s)
        }
        fn from_host(s: HostSlice<'_>) -> Option<&[Self]> {
            match s {
                HostSlice::$variant(s) => Some(s),
                _ => None,
            }
        }
        fn from_host_mut(s: HostSliceMut<'_>) -> Option<&mut [Self]> {
            match s {
                HostSliceMut::$variant(s) => Some(s),
                _ => None,
            }
        }
        fn into_host_buffer(v: Vec<Self>) -> HostBuffer {
            HostBuffer::$variant(v)
        }
    };
}

// SAFETY: f32 is plain old data; zero bits are 0.0.
unsafe impl Element for f32 {
    const DTYPE: DType = DType::F32;
    host_views!(F32);
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn from_f64(x: f64) -> Self {
        x as f32
    }
}

// SAFETY: bf16 is a transparent u16; zero bits are 0.0.
unsafe impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    host_views!(BF16);
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    fn to_f64(self) -> f64 {
        bf16::to_f64(self)
    }
    fn from_f64(x: f64) -> Self {
        bf16::from_f64(x)
    }
}

// SAFETY: f16 is a transparent u16; zero bits are 0.0.
unsafe impl Element for f16 {
    const DTYPE: DType = DType::F16;
    host_views!(F16);
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    fn to_f64(self) -> f64 {
        f16::to_f64(self)
    }
    fn from_f64(x: f64) -> Self {
        f16::from_f64(x)
    }
}
