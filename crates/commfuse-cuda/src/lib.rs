//! commfuse-cuda: the `cuda` backend.
//!
//! The folders are its layers, sys → backend → operators → benches, each operator's bench in
//! the operator's folder; every CUDA kernel (`.cu`) lies beside the module that launches it.
//!
//! * [`sys`], the raw layer: the driver (the only module with raw driver calls), NVRTC (every
//!   kernel embedded and compiled for sm_90a at first use, cached in memory and on disk;
//!   `common.cuh`, the header every kernel includes), cuBLASLt, NCCL, CUDA IPC, host waits that
//!   end, raw pointers checked against their allocations;
//! * [`backend`]: the [`commfuse_core::backend::Backend`] implementation ([`CudaBackend`]), over
//!   its GPUs and their state (`gpus`), prepared calls and their timed batches (`call`), the plan
//!   kernel (`plan_kernel`, `plan.cu`), plans encoded as the `#[repr(C)]` tables that kernel
//!   reads ([`backend::plan_table`]) and the NCCL and copy-engine baselines (`baselines`);
//! * the operators, one folder each: [`collective`] (collectives on the caller's buffers, in one
//!   process or one process per GPU, and the LL and copy-engine protocols, `ll.cu` and `ce.cu`),
//!   [`gemm`] (our Hopper GEMM, `gemm.cu`), [`gemm_rs`] (GEMM + reduce-scatter: fused,
//!   overlapped, unfused; `gemm_rs.cu` and the flag steps that order library work across GPUs)
//!   and [`ag_gemm`] (all-gather + GEMM);
//! * the benches: `bench` in the operator's folder (`commfuse bench gemm`, `gemm-rs`,
//!   `ag-gemm`), the float64 reference GEMM on the device in [`gemm::bench`]
//!   (`reference_gemm.cu`), and what the fused operators' benches share in [`rank_bench`];
//! * [`error`]: one error enum; [`testing`]: GPU-test skips that `COMMFUSE_REQUIRE_GPU=1` turns
//!   into failures.
//!
//! Without a driver or GPUs every entry point returns a clear error; nothing panics.

pub mod ag_gemm;
pub mod backend;
pub mod collective;
pub mod error;
pub mod gemm;
pub mod gemm_rs;
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
