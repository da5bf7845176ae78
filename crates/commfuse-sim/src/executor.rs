//! The plan interpreter: each rank thread walks its step list over the symmetric buffers.
//!
//! Soundness: memory is shared between rank threads without locks. That is defined behaviour
//! only because the plan passed the checker, which proves that every pair of conflicting
//! accesses is ordered by a notify (release) and the wait (acquire) that observes it — the
//! executor accepts only a [`CheckedPlan`].

use crate::buffer::SymmetricBuffer;
use crate::world::RankContext;
use commfuse_core::backend::BackendError;
use commfuse_core::{BufferKind, CheckedPlan, Element, NotifyOp, ReduceOp, Region, Step};

/// The three symmetric buffers of a prepared call.
pub(crate) struct CallBuffers<T: Element> {
    pub input: SymmetricBuffer<T>,
    pub output: SymmetricBuffer<T>,
    pub scratch: SymmetricBuffer<T>,
}

impl<T: Element> CallBuffers<T> {
    fn get(&self, kind: BufferKind) -> &SymmetricBuffer<T> {
        match kind {
            BufferKind::Input => &self.input,
            BufferKind::Output => &self.output,
            BufferKind::Scratch => &self.scratch,
        }
    }

    fn ptr(&self, region: &Region) -> *mut T {
        self.get(region.buffer).ptr(region.rank, region.range())
    }
}

/// Runs rank `ctx.rank()`'s steps of one call.
pub(crate) fn run_rank<T: Element>(
    ctx: &RankContext<'_>,
    plan: &CheckedPlan,
    bufs: &CallBuffers<T>,
    reduce: ReduceOp,
) -> Result<(), BackendError> {
    let rank = ctx.rank();
    let world_cols = ctx.world().pad(rank).cols() as usize;
    let index = |row: u32, col: u32| row as usize * world_cols + col as usize;
    // only this rank's thread touches its bases
    let mut base = ctx.world().bases[rank].lock().expect("bases lock");
    for step in &plan.plan().steps[rank] {
        match step {
            Step::Wait {
                slot,
                expected,
                cmp,
            } => {
                // a slot nobody notifies has a wait for 0, which holds at once
                let from = plan.notifier(rank, *slot).unwrap_or(rank);
                ctx.wait(
                    *slot,
                    base[index(slot.row, slot.col)] + expected,
                    *cmp,
                    from,
                )?;
            }
            // A slot is set at most once per call (the checker enforces it), so setting it to
            // base + value is the same as adding value: epochs then need no reset.
            Step::Notify {
                peer, slot, value, ..
            } => ctx.notify(*peer, *slot, *value, NotifyOp::Add)?,
            Step::Copy { src, dsts } => {
                for dst in dsts {
                    // SAFETY: regions are in bounds (checked plan) and their accesses are
                    // ordered by the plan's signals; source and destinations do not overlap.
                    unsafe { std::ptr::copy_nonoverlapping(bufs.ptr(src), bufs.ptr(dst), src.len) }
                }
            }
            Step::Reduce { srcs, dsts } => {
                let srcs: Vec<*const T> = srcs.iter().map(|s| bufs.ptr(s) as *const T).collect();
                let outs: Vec<*mut T> = dsts.iter().map(|d| bufs.ptr(d)).collect();
                // SAFETY: as for Copy; a dst is either disjoint from every source or equal to
                // one, and each block is read completely before it is written.
                unsafe { reduce_into(&srcs, &outs, dsts[0].len, reduce) }
            }
        }
    }
    let plan_cols = plan.plan().pad_cols as usize;
    for (i, inc) in plan.slot_increments(rank).iter().enumerate() {
        base[index((i / plan_cols) as u32, (i % plan_cols) as u32)] += inc;
    }
    Ok(())
}

const BLOCK: usize = 1024;

#[inline(always)]
fn fold<T: Element>(acc: &mut [f32], src: &[T], f: impl Fn(f32, f32) -> f32) {
    for (a, s) in acc.iter_mut().zip(src) {
        *a = f(*a, s.to_f32());
    }
}

/// dst[i] = srcs[0][i] ⊕ srcs[1][i] ⊕ … accumulated in f32, rounded once, for every dst.
///
/// # Safety
/// Every pointer must be valid for `len` elements; a dst may equal a source but not partly
/// overlap one; no other thread may write the sources or access a dst meanwhile.
pub(crate) unsafe fn reduce_into<T: Element>(
    srcs: &[*const T],
    dsts: &[*mut T],
    len: usize,
    op: ReduceOp,
) {
    let mut acc = [0f32; BLOCK];
    let mut start = 0;
    while start < len {
        let n = BLOCK.min(len - start);
        let acc = &mut acc[..n];
        let first = std::slice::from_raw_parts(srcs[0].add(start), n);
        for (a, s) in acc.iter_mut().zip(first) {
            *a = s.to_f32();
        }
        for src in &srcs[1..] {
            let src = std::slice::from_raw_parts(src.add(start), n);
            match op {
                ReduceOp::Sum => fold(acc, src, |a, b| a + b),
                ReduceOp::Max => fold(acc, src, f32::max),
                ReduceOp::Min => fold(acc, src, f32::min),
                ReduceOp::Prod => fold(acc, src, |a, b| a * b),
            }
        }
        for dst in dsts {
            let out = std::slice::from_raw_parts_mut(dst.add(start), n);
            for (o, a) in out.iter_mut().zip(acc.iter()) {
                *o = T::from_f32(*a);
            }
        }
        start += n;
    }
}
