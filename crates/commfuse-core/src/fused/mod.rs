//! Fused operators' schedules: which tiles each rank computes in which order, where each tile
//! goes and which flag says it is there. Pure functions of the shape and the world size, shared
//! by the simulator and the GPU backend (the same tables on both).

pub mod ag_gemm;
pub mod gemm_rs;
pub mod ring_rs;
