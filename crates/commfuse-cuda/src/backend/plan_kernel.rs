//! The plan kernel (plan.cu) as the backend and the one-process-per-GPU collectives
//! launch it: its instances per element type and reduce op (and the `<prefix>_<type>_<op>`
//! names every kernel's typed instances follow), the signal slots and lanes it is sized for,
//! and a rank's table of a plan uploaded to its GPU with the kernel's arguments.

use crate::backend::plan_table::{self, BufferAddrs, Lanes, PlanArgs, MAX_RANKS};
use crate::error::CudaError;
use crate::sys::driver::{DeviceMemory, Function, Gpu, Module};
use commfuse_core::{CheckedPlan, DType, ReduceOp};
use std::time::Duration;

/// Signal slots per lane on every GPU; plans need rows × cols of them.
pub(crate) const PAD_SLOTS: usize = 1024;
/// Bytes of the longest region a lane aims to handle. Measured on 2 × H200 (CHANGELOG.md, "The cuda backend"):
/// 64 KiB per lane serves messages from 4 MiB up; 4 KiB per lane for every message made 4–16 MiB
/// calls 10 µs slower; one block per small message was latency-bound (64 KiB took 20 µs).
pub(crate) const LANE_TARGET_BYTES: usize = 64 << 10;
/// Small messages still get this many lanes, down to LANE_MIN_BYTES each.
pub(crate) const LANE_MIN_COUNT: usize = 16;
pub(crate) const LANE_MIN_BYTES: usize = 4 << 10;

/// The plan kernel of `reduce` among a dtype's four (`plan_{dtype}_{sum,max,min,prod}`).
pub(crate) fn reduce_index(reduce: ReduceOp) -> usize {
    match reduce {
        ReduceOp::Sum => 0,
        ReduceOp::Max => 1,
        ReduceOp::Min => 2,
        ReduceOp::Prod => 3,
    }
}

pub(crate) fn dtype_index(d: DType) -> usize {
    match d {
        DType::F32 => 0,
        DType::BF16 => 1,
        DType::F16 => 2,
    }
}

/// The plan kernel of `dtype` and `reduce` in a module of `plan.cu`.
pub(crate) fn plan_kernel(
    module: &Module,
    dtype: DType,
    reduce: ReduceOp,
) -> Result<Function, CudaError> {
    typed_kernel(module, "plan", dtype, reduce)
}

/// The entry point `<prefix>_<type>_<op>` of `dtype` and `reduce` in `module`: the names
/// `COMMFUSE_EACH_TYPE_AND_OP` (common.cuh) gives a kernel's instances.
pub(crate) fn typed_kernel(
    module: &Module,
    prefix: &str,
    dtype: DType,
    reduce: ReduceOp,
) -> Result<Function, CudaError> {
    let d = ["f32", "bf16", "f16"][dtype_index(dtype)];
    let op = ["sum", "max", "min", "prod"][reduce_index(reduce)];
    module.function(&format!("{prefix}_{d}_{op}"))
}

/// What a rank's plan kernel reads besides its table: every rank's signal pads as this rank
/// addresses them, its epoch bases, its error record, the lanes and the bound of its waits.
pub(crate) struct KernelContext {
    pub pads: [u64; MAX_RANKS],
    pub bases: u64,
    pub error: u64,
    pub lanes: Lanes,
    pub timeout: Duration,
}

/// A rank's table of a plan on its GPU: kept as long as its kernel may read it.
pub(crate) struct DeviceTable {
    _steps: DeviceMemory,
    _regions: DeviceMemory,
    _increments: DeviceMemory,
}

/// Rank `r`'s table of `plan` (steps and regions over every rank's buffers `addrs`, as rank r
/// addresses them; its slot increments) uploaded to `gpu`, and its plan kernel's arguments.
pub(crate) fn upload_table(
    gpu: &Gpu,
    plan: &CheckedPlan,
    r: usize,
    addrs: &[BufferAddrs],
    elem_bytes: usize,
    context: &KernelContext,
) -> Result<(DeviceTable, PlanArgs), CudaError> {
    let table = plan_table::encode(plan, r, addrs, elem_bytes);
    let steps = DeviceMemory::zeroed(gpu, std::mem::size_of_val(&table.steps[..]))?;
    steps.upload(gpu, &table.steps)?;
    let regions = DeviceMemory::zeroed(gpu, std::mem::size_of_val(&table.regions[..]))?;
    regions.upload(gpu, &table.regions)?;
    let inc = plan.slot_increments(r);
    let increments = DeviceMemory::zeroed(gpu, std::mem::size_of_val(inc))?;
    increments.upload(gpu, inc)?;
    let p = plan.plan();
    let args = PlanArgs {
        steps: steps.addr(),
        regions: regions.addr(),
        pads: context.pads,
        bases: context.bases,
        increments: increments.addr(),
        error: context.error,
        lane_len: context.lanes.len,
        timeout_ns: context.timeout.as_nanos() as u64,
        nsteps: table.steps.len() as u32,
        rank: r as u32,
        slots: p.pad_rows * p.pad_cols,
        pad: 0,
    };
    let table = DeviceTable {
        _steps: steps,
        _regions: regions,
        _increments: increments,
    };
    Ok((table, args))
}
