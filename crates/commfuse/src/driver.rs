//! One collective call, end to end: build and check the plan, allocate, fill fresh random
//! inputs, poison the outputs, run, and compare every output element with the float64
//! reference.

use anyhow::{Context, Result};
use commfuse_core::backend::{Backend, CallTiming, HostBuffer, PreparedCall};
use commfuse_core::cost::CostCard;
use commfuse_core::reference::{self, Comparison};
use commfuse_core::{
    build_plan, check, Algo, CheckedPlan, DType, Error, OpKind, OpSpec, ReduceOp, Topology,
};
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
    pub card: CostCard,
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
        card,
        timing,
        calls: calls.max(1),
        call,
    })
}

/// Checks `calls` calls of the backend's candidate `name` (a baseline such as NCCL, or the LL
/// all-reduce) as [`run`] checks a plan's: call 0 alone, the rest queued back to back on fresh
/// inputs. Returns the first failing comparison (or the last) and its call.
pub fn run_named(
    backend: &dyn Backend,
    name: &str,
    req: &Request,
    calls: usize,
) -> Result<(Comparison, usize)> {
    let spec = OpSpec::new(req.op, backend.world_size(), req.count, req.root)?;
    let mut call = backend.prepare_baseline(name, &spec, req.dtype, req.reduce)?;
    load(call.as_mut(), &spec, req.reduce, req.seed)?;
    call.run()
        .with_context(|| format!("{} {name} call 0", req.op))?;
    let first = compare(call.as_mut(), &spec, req.reduce, req.seed)?;
    check_queued(call.as_mut(), &spec, req, calls, first)
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
