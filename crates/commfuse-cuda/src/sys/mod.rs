//! The raw layer: the CUDA driver, NVRTC, cuBLASLt and NCCL as small owning types, and the
//! host-side pieces their calls need. Nothing here knows a plan, a protocol or an operator;
//! the backend and the operators above are safe code over these types.
//!
//! * [`driver`]: the only module with raw driver calls — contexts, device and host-mapped
//!   memory, streams, events, graphs, modules and launches, IPC handles;
//! * [`nvrtc`]: the embedded kernels compiled for sm_90a at first use, cached in memory and on
//!   disk. Each `.cu` file lies beside the module that launches it; `common.cuh`, the header
//!   every kernel includes by name (its signals, bounded waits and error record), lies here;
//! * [`cublaslt`]: cuBLASLt's GEMM at its fastest candidate per shape;
//! * [`nccl`]: NCCL's communicators and calls in this process;
//! * [`ipc`]: what a rank exports of its buffers for other processes, and opens of theirs;
//! * [`host_sync`]: host-side waits that end, an abortable start barrier and a bounded poll.
//!   Plain threads, no GPU; it lies here because the driver's and NCCL's bounded waits are
//!   built on it, as are the backend's and the operators';
//! * [`spans`]: raw device pointers checked against their allocations, once per address. It
//!   lies here because it is one driver query (`cuPointerGetAttributes`) over bare addresses,
//!   for any operator that takes them (the Python classes).
//!
//! One type from above is named here: the error record's `#[repr(C)]` mirror
//! ([`crate::backend::plan_table::ErrorRecord`]), whose abort word the host raises through the
//! driver's host-mapped memory.

pub mod cublaslt;
pub mod driver;
pub mod host_sync;
pub mod ipc;
pub mod nccl;
pub mod nvrtc;
pub mod spans;
