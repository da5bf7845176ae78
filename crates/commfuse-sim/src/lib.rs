//! commfuse-sim: the `sim` backend. P ranks run as threads of one process; symmetric buffers are
//! shared memory every rank may load from and store to; signal pads are arrays of atomic 64-bit
//! counters with release/acquire semantics, exactly the contract the CUDA backend gives on
//! NVLink. Plans run here as they run on GPUs.
//!
//! * [`protocol`]: notify, wait and the barrier protocols, generic over the atomic word so that
//!   the tests can model-check them under loom and shuttle;
//! * [`signal`]: the signal pad, with waits that spin, then yield, then sleep, and end in a
//!   diagnosed timeout instead of a hang (or at once, in a group of processes, when the process
//!   of the rank waited for has ended);
//! * [`buffer`]: zero-initialised symmetric buffers;
//! * [`world`]: ranks as scoped threads and the abort flag that stops all of them when one fails,
//!   carrying which rank failed first and how;
//! * [`barrier`]: all-to-all and ring barriers with epochs (no reset between calls);
//! * [`gemm`]: the CPU model of the GEMM contract;
//! * [`gemm_rs`] and [`ag_gemm`]: the fused operators on it, one folder each (GEMM +
//!   reduce-scatter's three paths: fused, the ring in [`gemm_rs::ring`], the unfused pair in
//!   [`gemm_rs::unfused`]; all-gather + GEMM);
//! * [`fused`]: what the fused operators share: the configuration they are built for, the checks
//!   of their constructors and calls, their flag words on the signal pads;
//! * [`executor`]: the plan interpreter and its reduction kernels;
//! * [`ll`] and [`ll_chunks`]: the low-latency protocol (data and call number in one line): the
//!   all-reduce as an operator, and the reduce-scatter and all-gather the GPU kernel runs;
//! * [`memory`]: what a run allocates, counted and compared with the memory available before
//!   anything is allocated;
//! * [`backend`]: the [`commfuse_core::backend::Backend`] implementation.

pub mod ag_gemm;
pub mod backend;
pub mod barrier;
pub mod buffer;
pub mod collective;
pub mod executor;
pub mod fused;
pub mod gemm;
pub mod gemm_rs;
pub mod ll;
pub mod ll_chunks;
pub mod memory;
pub mod protocol;
pub mod shared;
pub mod signal;
pub mod world;

pub use backend::SimBackend;
pub use barrier::{Barrier, BarrierKind};
pub use buffer::SymmetricBuffer;
pub use signal::SignalPad;
pub use world::{RankContext, World, WorldConfig};
