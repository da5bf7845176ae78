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

impl CudaError {
    /// A bounded host wait that ran out: `who` (an operator's rank, a tuning pass) waited
    /// `limit` for `what`, which had not finished then.
    pub fn stalled(who: &str, what: &str, limit: std::time::Duration) -> CudaError {
        CudaError::Stalled(format!(
            "{who} waited {limit:?} for {what}, which had not finished"
        ))
    }
}

impl From<CudaError> for BackendError {
    fn from(e: CudaError) -> Self {
        BackendError::Unavailable(e.to_string())
    }
}

/// A shape or plan that core refuses (a size out of range, a layout the types do not allow):
/// the operator cannot be built for it.
impl From<commfuse_core::Error> for CudaError {
    fn from(e: commfuse_core::Error) -> Self {
        CudaError::Unavailable(e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_stalled_wait_names_who_waited_on_what_and_the_limit() {
        let e = CudaError::stalled(
            "all-gather + GEMM rank 3",
            "its warm-up GEMMs of M = 256 on the tuning stream",
            Duration::from_secs(20),
        );
        assert!(matches!(e, CudaError::Stalled(_)));
        assert_eq!(
            e.to_string(),
            "all-gather + GEMM rank 3 waited 20s for its warm-up GEMMs of M = 256 on the tuning stream, which had not finished"
        );
    }
}
