//! commfuse: communication–computation fused operators for tensor parallelism on NVLink GPUs.
//!
//! This crate ties the layers together: [`backends`] opens a backend by name, [`driver`] runs
//! one checked call against the float64 reference, [`bench`] measures size sweeps in the
//! nccl-tests format, [`gemm_rs`] runs and checks fused GEMM + reduce-scatter on the simulator,
//! [`verify`] runs the correctness matrix, and [`sizes`] parses size lists.
//! The `commfuse` binary (src/main.rs and [`cli`]) is a thin shell over them.

pub mod ag_gemm;
pub mod args;
pub mod backends;
pub mod bench;
pub mod calibrate;
pub mod cli;
pub mod driver;
pub mod dump;
pub mod gemm_rs;
pub mod plot;
pub mod progress;
pub mod sizes;
pub mod verify;

pub use commfuse_core as core;
pub use commfuse_sim as sim;
