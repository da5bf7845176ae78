//! The crate's error type.

use commfuse_core::backend::BackendError;

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// No driver, no GPU, too few GPUs, no NVRTC: the backend cannot run here.
    #[error("{0}")]
    Unavailable(String),
    #[error("CUDA driver call {call} failed: {message}")]
    Driver { call: &'static str, message: String },
    #[error("NVRTC: {0}")]
    Nvrtc(String),
    #[error("kernel {name} does not compile:\n{log}")]
    Compile { name: String, log: String },
    /// A request that does not fit what it names (a copy larger than its allocation).
    #[error("{0}")]
    OutOfBounds(String),
    /// A host-side wait that ran past its bound (a GPU still busy, a rank that never arrived).
    #[error("{0}")]
    Stalled(String),
    #[error("NCCL call {call} failed: {message}")]
    Nccl { call: &'static str, message: String },
}

impl From<CudaError> for BackendError {
    fn from(e: CudaError) -> Self {
        BackendError::Unavailable(e.to_string())
    }
}
