//! The CPU model of commfuse's GEMM contract ([`commfuse_core::gemm`]): one rank computes the
//! tiles of its plan in the plan's order with a reference tile GEMM (f32 accumulation), applies
//! the epilogue, stores each tile to its destination — its own output or a peer's symmetric
//! buffer — and then raises the tile's flag on the destination's rank with release semantics.
//! The fused operators' plans are tested on it in CI before the GPU kernel runs them.

use crate::buffer::SymmetricBuffer;
use crate::world::RankContext;
use commfuse_core::backend::BackendError;
use commfuse_core::gemm::{BLayout, GemmPlan};
use commfuse_core::Element;

/// A rank's operands: A [M, K], B ([K, N] or [N, K]), optional C [M, N] and bias [N].
pub struct Operands<'a, TI: Element, TO: Element> {
    pub a: &'a [TI],
    pub b: &'a [TI],
    pub c: Option<&'a [TO]>,
    pub bias: Option<&'a [TO]>,
}

fn check_len(what: &str, got: usize, want: usize) -> Result<(), BackendError> {
    if got < want {
        return Err(BackendError::Unavailable(format!(
            "{what} holds {got} elements, the GEMM needs {want}"
        )));
    }
    Ok(())
}

/// Runs `plan` on rank `ctx.rank()`, writing tiles into `out` (every rank's output buffer).
///
/// Stores into a peer's buffer use [`SymmetricBuffer::store`]; the plan's destinations of tiles
/// that may be computed at once must not overlap (the contract's rule), and a consumer on the
/// destination rank reads a tile only after waiting for its flag.
pub fn run_gemm<TI: Element, TO: Element>(
    ctx: &RankContext<'_>,
    plan: &GemmPlan,
    ops: &Operands<'_, TI, TO>,
    out: &SymmetricBuffer<TO>,
) -> Result<(), BackendError> {
    run_gemm_tiles(ctx, plan, &plan.order, ops, out)
}

/// [`run_gemm`] of the tiles `tiles` only (a stretch of the plan's order: what a GEMM computes
/// between two waits of a caller that models them, as the fused all-gather + GEMM's producer).
pub fn run_gemm_tiles<TI: Element, TO: Element>(
    ctx: &RankContext<'_>,
    plan: &GemmPlan,
    tiles: &[usize],
    ops: &Operands<'_, TI, TO>,
    out: &SymmetricBuffer<TO>,
) -> Result<(), BackendError> {
    let p = &plan.problem;
    plan.validate(ctx.world_size())
        .map_err(|e| BackendError::Unavailable(e.to_string()))?;
    check_len("A", ops.a.len(), p.m * p.k)?;
    check_len("B", ops.b.len(), p.k * p.n)?;
    if plan.epilogue.beta != 0.0 {
        check_len("C", ops.c.map_or(0, |c| c.len()), p.m * p.n)?;
    }
    if plan.epilogue.bias {
        check_len("bias", ops.bias.map_or(0, |b| b.len()), p.n)?;
    }
    let b_at = |kk: usize, j: usize| match p.b_layout {
        BLayout::KN => ops.b[kk * p.n + j],
        BLayout::NK => ops.b[j * p.k + kk],
    };
    let e = &plan.epilogue;
    for &t in tiles {
        let (rows, cols) = plan.tile_bounds(t);
        let dest = plan.destination(t, ctx.rank());
        let width = cols.len();
        for (r, i) in rows.clone().enumerate() {
            let mut row = vec![TO::from_f32(0.0); width];
            for (c, j) in cols.clone().enumerate() {
                let mut acc = 0f32;
                for kk in 0..p.k {
                    acc += ops.a[i * p.k + kk].to_f32() * b_at(kk, j).to_f32();
                }
                let mut v = e.alpha * acc;
                if e.beta != 0.0 {
                    v += e.beta * ops.c.expect("checked above")[i * p.n + j].to_f32();
                }
                if e.bias {
                    v += ops.bias.expect("checked above")[j].to_f32();
                }
                row[c] = TO::from_f32(v);
            }
            let at = dest.offset + r * dest.ld;
            if at + width > out.len() {
                return Err(BackendError::Unavailable(format!(
                    "tile {t} row {r} lands at {at}..{} of a {}-element buffer on rank {}",
                    at + width,
                    out.len(),
                    dest.rank
                )));
            }
            if e.accumulate {
                let mut old = vec![TO::from_f32(0.0); width];
                // SAFETY: the contract keeps concurrently computed tiles' destinations apart,
                // and consumers read only after the tile's flag
                unsafe { out.load(dest.rank, at, &mut old) };
                for (x, o) in row.iter_mut().zip(&old) {
                    *x = TO::from_f32(x.to_f32() + o.to_f32());
                }
            }
            // SAFETY: as above
            unsafe { out.store(dest.rank, at, &row) };
        }
        if let Some(flags) = &plan.flags {
            let f = flags[t];
            ctx.notify(dest.rank, f.slot, f.value, f.op)?;
        }
    }
    Ok(())
}
