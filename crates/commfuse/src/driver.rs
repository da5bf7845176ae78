//! One collective call, end to end: build and check the plan, allocate, fill fresh random
//! inputs, poison the outputs, run, and compare every output element with the float64
//! reference.

use anyhow::{Context, Result};
use commfuse_core::backend::{Backend, CallTiming, PreparedCall};
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
    pub comparison: Comparison,
    pub card: CostCard,
    pub timing: CallTiming,
}

/// Runs `calls` consecutive calls of `req` (fresh inputs each, so stale data shows) and returns
/// the first failing comparison, or the last one. With `dump`, the last call's inputs and
/// outputs are written there as .npy files.
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
    let mut outcome = None;
    for c in 0..calls.max(1) {
        let seed = req.seed.wrapping_add(c as u64);
        load(call.as_mut(), &spec, req.reduce, seed)?;
        let timing = call
            .run()
            .with_context(|| format!("{} {} call {c}", req.op, req.algo))?;
        let comparison = compare(call.as_mut(), &spec, req.reduce, seed)?;
        let failed = !comparison.ok();
        outcome = Some(Outcome {
            comparison,
            card: card.clone(),
            timing,
        });
        if failed {
            break;
        }
    }
    if let Some(dir) = dump {
        crate::dump::dump(dir, call.as_ref(), &spec)?;
    }
    Ok(outcome.expect("at least one call"))
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
