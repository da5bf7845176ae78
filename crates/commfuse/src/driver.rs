//! One collective call, end to end: build and check the plan, allocate, fill fresh random
//! inputs, poison the outputs, run, and compare every output element with the float64
//! reference.

use anyhow::{Context, Result};
use commfuse_core::backend::{Backend, CallTiming, HostBuffer, PreparedCall};
use commfuse_core::cost::CostCard;
use commfuse_core::reference::{self, Comparison};
use commfuse_core::{
    build_plan, check, Algo, CheckedPlan, DType, Error, Implementation, OpKind, OpSpec, ReduceOp,
    Topology,
};
use commfuse_sim::memory::{Footprint, REFERENCE_BLOCK_BYTES};
use std::path::Path;

/// What to run, independent of where.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub op: OpKind,
    pub algo: Algo,
    pub count: usize,
    pub dtype: DType,
    pub reduce: ReduceOp,
    pub root: usize,
    pub numa_groups: usize,
    pub seed: u64,
}

impl Request {
    pub fn new(op: OpKind, algo: Algo, count: usize, dtype: DType) -> Self {
        Request {
            op,
            algo,
            count,
            dtype,
            reduce: ReduceOp::Sum,
            root: 0,
            numa_groups: 1,
            seed: 1,
        }
    }
}

/// Builds and checks the plan of `req` on `world` ranks.
pub fn plan(req: &Request, world: usize) -> Result<(CheckedPlan, Topology), Error> {
    let spec = OpSpec::new(req.op, world, req.count, req.root)?;
    req.count
        .checked_mul(req.dtype.size())
        .and_then(|b| b.checked_mul(world))
        .ok_or_else(|| {
            Error::SizeOverflow(format!(
                "{} elements of {} on {world} ranks do not fit in memory addresses",
                req.count, req.dtype
            ))
        })?;
    let topology = Topology::new(world, req.numa_groups)?;
    let plan = build_plan(spec, req.algo, &topology)?;
    Ok((check(plan)?, topology))
}

/// What a checked run of `calls` calls of `plan` (for `req`) on `backend` holds in host
/// memory at its peak: the backend's buffers ([`Backend::host_bytes`]), every queued call's
/// inputs and outputs (calls 1.. run back to back), and the float64 reference's blocks.
pub fn footprint(
    backend: &dyn Backend,
    plan: &CheckedPlan,
    req: &Request,
    calls: usize,
) -> Footprint {
    let p = plan.plan();
    let (world, size) = (p.world(), req.dtype.size());
    let queued = calls.saturating_sub(1);
    let what = format!(
        "{} {} of {} {} elements on {world} ranks, {} calls checked",
        req.op,
        req.algo,
        req.count,
        req.dtype,
        calls.max(1)
    );
    Footprint::new(what)
        .add_bytes(backend.host_bytes(plan, req.dtype))
        .item(&[queued, world, p.buffers.input, size])
        .item(&[queued, world, p.buffers.output, size])
        .item(&[REFERENCE_BLOCK_BYTES])
}

/// Fills fresh inputs from `seed` and poisons every output.
pub fn load(call: &mut dyn PreparedCall, spec: &OpSpec, reduce: ReduceOp, seed: u64) -> Result<()> {
    for r in 0..spec.world {
        reference::fill_input(seed, r, reduce, call.input_mut(r));
        reference::poison(call.output_mut(r));
    }
    call.upload()?;
    Ok(())
}

/// Downloads the outputs and compares them with the reference.
pub fn compare(
    call: &mut dyn PreparedCall,
    spec: &OpSpec,
    reduce: ReduceOp,
    seed: u64,
) -> Result<Comparison> {
    call.download()?;
    let outputs: Vec<_> = (0..spec.world).map(|r| call.output(r)).collect();
    Ok(reference::compare(spec, reduce, seed, &outputs))
}

#[derive(Debug, Clone)]
pub struct Outcome {
    /// The first failing comparison, or the last call's.
    pub comparison: Comparison,
    /// The plan's cost card (None for a protocol or baseline, which have no plan).
    pub card: Option<CostCard>,
    /// The first call's time (it runs alone).
    pub timing: CallTiming,
    /// Calls checked in all: the first alone, the rest queued back to back.
    pub calls: usize,
    /// The call the comparison belongs to.
    pub call: usize,
}

/// Runs `calls` calls of `req`, each on fresh inputs (seed `req.seed + c`) with poisoned
/// outputs, and checks every output element of every call: call 0 alone and timed, then calls
/// 1.. queued back to back without host synchronisation (inputs replaced and outputs poisoned
/// by each rank's own stream between calls, as a training step does). Returns the first failing
/// comparison, or the last one. With `dump`, call 0's inputs and outputs are written there as
/// .npy files.
pub fn run(
    backend: &dyn Backend,
    req: &Request,
    calls: usize,
    dump: Option<&Path>,
) -> Result<Outcome> {
    let world = backend.world_size();
    let (checked, topology) = plan(req, world)?;
    let card = CostCard::of(&checked, &topology, req.dtype.size());
    let spec = checked.plan().spec;
    footprint(backend, &checked, req, calls).check()?;
    let mut call = backend.prepare(&checked, req.dtype, req.reduce)?;
    load(call.as_mut(), &spec, req.reduce, req.seed)?;
    let timing = call
        .run()
        .with_context(|| format!("{} {} call 0", req.op, req.algo))?;
    let comparison = compare(call.as_mut(), &spec, req.reduce, req.seed)?;
    if let Some(dir) = dump {
        crate::dump::dump(dir, call.as_ref(), &spec)?;
    }
    let (comparison, call) = check_queued(call.as_mut(), &spec, req, calls, comparison)?;
    Ok(Outcome {
        comparison,
        card: Some(card),
        timing,
        calls: calls.max(1),
        call,
    })
}

/// Checks `calls` calls of the backend's implementation `which` (a baseline such as NCCL, or
/// the LL all-reduce; `req.algo` is not used) as [`run`] checks a plan's: call 0 alone and
/// timed, the rest queued back to back on fresh inputs, call 0's inputs and outputs written to
/// `dump` as .npy files where given. The outcome has no cost card.
pub fn run_named(
    backend: &dyn Backend,
    which: Implementation,
    req: &Request,
    calls: usize,
    dump: Option<&Path>,
) -> Result<Outcome> {
    let name = which.name();
    let spec = OpSpec::new(req.op, backend.world_size(), req.count, req.root)?;
    let world = spec.world;
    let what = format!(
        "{} {name} of {} {} elements on {world} ranks",
        req.op, req.count, req.dtype
    );
    let queued = calls.saturating_sub(1);
    Footprint::new(what)
        .add_bytes(backend.baseline_host_bytes(which, &spec, req.dtype))
        .item(&[queued, world, spec.input_capacity(), req.dtype.size()])
        .item(&[queued, world, spec.output_capacity(), req.dtype.size()])
        .item(&[REFERENCE_BLOCK_BYTES])
        .check()?;
    let mut call = backend.prepare_baseline(which, &spec, req.dtype, req.reduce)?;
    load(call.as_mut(), &spec, req.reduce, req.seed)?;
    let timing = call
        .run()
        .with_context(|| format!("{} {name} call 0", req.op))?;
    let first = compare(call.as_mut(), &spec, req.reduce, req.seed)?;
    if let Some(dir) = dump {
        crate::dump::dump(dir, call.as_ref(), &spec)?;
    }
    let (comparison, call) = check_queued(call.as_mut(), &spec, req, calls, first)?;
    Ok(Outcome {
        comparison,
        card: None,
        timing,
        calls: calls.max(1),
        call,
    })
}

/// After call 0's comparison `first`: calls 1..`calls` queued back to back on fresh inputs,
/// each compared; the first failing comparison (or the last) and its call.
fn check_queued(
    call: &mut dyn PreparedCall,
    spec: &OpSpec,
    req: &Request,
    calls: usize,
    first: Comparison,
) -> Result<(Comparison, usize)> {
    if !first.ok() || calls <= 1 {
        return Ok((first, 0));
    }
    let seeds: Vec<u64> = (1..calls)
        .map(|c| req.seed.wrapping_add(c as u64))
        .collect();
    // the call's own input length (a plan's buffers may hold more than the op's input)
    let input_len = call.input(0).len();
    let inputs: Vec<Vec<HostBuffer>> = seeds
        .iter()
        .map(|&seed| {
            (0..spec.world)
                .map(|r| {
                    let mut buf = HostBuffer::zeroed(req.dtype, input_len);
                    reference::fill_input(seed, r, req.reduce, buf.as_mut_slice());
                    buf
                })
                .collect()
        })
        .collect();
    let outputs = call
        .run_queued(&inputs)
        .with_context(|| format!("{} calls 1..{calls} queued", req.op))?;
    let mut last = (first, 0);
    for (c, (outs, &seed)) in outputs.iter().zip(&seeds).enumerate() {
        let views: Vec<_> = outs.iter().map(HostBuffer::as_slice).collect();
        last = (reference::compare(spec, req.reduce, seed, &views), c + 1);
        if !last.0.ok() {
            break;
        }
    }
    Ok(last)
}

/// A seed that differs from run to run.
pub fn fresh_seed() -> u64 {
    use std::time::{SystemTime, UNIX_EPOCH};
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    t ^ (std::process::id() as u64).rotate_left(32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use commfuse_sim::{SimBackend, WorldConfig};

    #[test]
    fn a_run_counts_its_queued_calls_beside_the_backends_buffers() {
        // 64 ranks × 10^7 f32: the backend's buffers are 5.1 GB, the three queued calls'
        // inputs and outputs another 15.4 GB (the run measured a 20.0 GB peak)
        let backend = SimBackend::new(64, WorldConfig::default()).unwrap();
        let mut req = Request::new(OpKind::AllReduce, Algo::Ring, 10_000_000, DType::F32);
        req.numa_groups = 1;
        let (plan, _) = plan(&req, 64).unwrap();
        let b = plan.plan().buffers;
        let buffers = 64 * 4 * (b.input + b.output + b.scratch) as u64;
        assert_eq!(backend.host_bytes(&plan, DType::F32), Some(buffers));
        let queued = 3 * 64 * 4 * (b.input + b.output) as u64;
        let total = footprint(&backend, &plan, &req, 4).bytes().unwrap();
        assert_eq!(
            total,
            buffers + queued + commfuse_sim::memory::REFERENCE_BLOCK_BYTES as u64
        );
        assert!(total > 20_000_000_000, "{total}");
        let err = footprint(&backend, &plan, &req, 4)
            .check_within(Some(16 << 30))
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("all-reduce ring of 10000000 f32 elements on 64 ranks, 4 calls checked needs 19.1 GiB (20560131072 bytes)"),
            "{err}"
        );
    }
}
