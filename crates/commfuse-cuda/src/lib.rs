//! commfuse-cuda: the `cuda` backend.
//!
//! * [`sys`]: the raw layer — the driver (the only module with raw driver calls), NVRTC and the
//!   embedded kernels, cuBLASLt, NCCL, CUDA IPC, host waits that end, pointer checks;
//! * [`plan_table`]: plans encoded as the `#[repr(C)]` tables the plan kernel reads;
//! * [`backend`]: the [`commfuse_core::backend::Backend`] implementation, over the backend's
//!   GPUs and their state (`gpus`), prepared calls and their timed batches (`call`) and the plan
//!   kernel's instances and tables (`plan_kernel`); the NCCL and copy-engine baselines on the
//!   same GPUs are prepared by `baselines`;
//! * [`error`]: one error enum;
//! * [`testing`]: GPU-test skips that `COMMFUSE_REQUIRE_GPU=1` turns into failures.
//!
//! Without a driver or GPUs every entry point returns a clear error; nothing panics.

pub mod ag_gemm;
pub mod backend;
mod baselines;
mod call;
pub mod collective;
pub mod error;
pub mod gemm;
pub mod gemm_rs;
mod gpus;
mod plan_kernel;
pub mod plan_table;
pub mod rank_bench;
pub mod sys;
pub mod testing;

pub use backend::CudaBackend;
pub use error::CudaError;

/// A measurement knob from the environment: `name`'s value if it parses as a `T` that `ok`
/// accepts, else `default` (other values are ignored). Callers read each knob once.
pub(crate) fn env_knob<T: std::str::FromStr + Copy>(
    name: &str,
    ok: impl Fn(T) -> bool,
    default: T,
) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse::<T>().ok())
        .filter(|v| ok(*v))
        .unwrap_or(default)
}
