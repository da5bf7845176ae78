//! commfuse-core: everything about communication that can be decided without touching memory.
//!
//! * [`op`]: what each collective computes (buffer lengths, which inputs each output element is
//!   made of), independent of any algorithm;
//! * [`plan`] and [`algorithms`]: per-rank step lists (wait, notify, copy, reduce) built by pure
//!   functions of world size, topology and sizes;
//! * [`signal`]: signal slots, how a wait compares one and how a notify changes one;
//! * [`checker`]: runs a plan abstractly and rejects deadlocks, reused signal slots, data races and
//!   wrong results before any backend executes it;
//! * [`cost`]: cost cards and a latency–bandwidth model of a [`topology::Topology`];
//! * [`reference`]: deterministic random inputs and the float64 reference;
//! * [`rounds`]: the interleaved rounds every bench times its rows in, and their statistics;
//! * [`backend`]: the trait every backend (simulator, CUDA) implements.

pub mod algorithms;
pub mod backend;
pub mod checker;
pub mod cost;
pub mod dtype;
pub mod error;
pub mod fused;
pub mod gemm;
pub mod implementation;
pub mod op;
pub mod plan;
pub mod reduce;
pub mod reference;
pub mod rounds;
pub mod signal;
pub mod topology;

pub use algorithms::{build_plan, Algo};
pub use checker::{check, CheckedPlan};
pub use dtype::{DType, Element};
pub use error::{Error, PlanError};
pub use implementation::{Baseline, Implementation, Protocol};
pub use op::{OpKind, OpSpec};
pub use plan::{BufferKind, Plan, Region, Step};
pub use reduce::ReduceOp;
pub use signal::{Cmp, NotifyOp, Slot};
pub use topology::Topology;

/// The largest world size the library accepts: contribution sets are 64-bit masks.
pub const MAX_WORLD_SIZE: usize = 64;
