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
    plan.validate(ctx.world_size())
        .map_err(|e| BackendError::Unavailable(e.to_string()))?;
    run_validated_tiles(ctx, plan, tiles, ops, out)
}

/// [`run_gemm_tiles`] of a plan the caller has validated (`GemmPlan::validate`) for this
/// world: what a caller that computes a plan's tiles one at a time, each after a wait of its
/// own, runs per tile, so that it checks the plan once rather than once per tile.
pub(crate) fn run_validated_tiles<TI: Element, TO: Element>(
    ctx: &RankContext<'_>,
    plan: &GemmPlan,
    tiles: &[usize],
    ops: &Operands<'_, TI, TO>,
    out: &SymmetricBuffer<TO>,
) -> Result<(), BackendError> {
    let p = &plan.problem;
    check_len("A", ops.a.len(), p.m * p.k)?;
    check_len("B", ops.b.len(), p.k * p.n)?;
    if plan.epilogue.beta != 0.0 {
        check_len("C", ops.c.map_or(0, |c| c.len()), p.m * p.n)?;
    }
    if plan.epilogue.bias {
        check_len("bias", ops.bias.map_or(0, |b| b.len()), p.n)?;
    }
    let e = &plan.epilogue;
    for &t in tiles {
        let (rows, cols) = plan.tile_bounds(t);
        let dest = plan.destination(t, ctx.rank());
        let width = cols.len();
        let products = tile_products(p, ops, rows.clone(), cols.clone());
        for (r, i) in rows.clone().enumerate() {
            let mut row = vec![TO::from_f32(0.0); width];
            for (c, j) in cols.clone().enumerate() {
                let mut v = e.alpha * products[r * width + c];
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

/// The tile `rows` × `cols` of A·B in f32 (row-major, `cols.len()` wide): the operands widened
/// to f32 (exact for bf16 and f16) and multiplied by `matrixmultiply`'s blocked SIMD kernel,
/// whose f32 accumulation is what the GPU's tensor cores do too, in another order.
fn tile_products<TI: Element, TO: Element>(
    p: &commfuse_core::gemm::GemmProblem,
    ops: &Operands<'_, TI, TO>,
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
) -> Vec<f32> {
    let (height, width, k) = (rows.len(), cols.len(), p.k);
    let a: Vec<f32> = ops.a[rows.start * k..rows.end * k]
        .iter()
        .map(|x| x.to_f32())
        .collect();
    // B's columns of the tile as `width` rows of K, whatever its layout
    let b: Vec<f32> = match p.b_layout {
        BLayout::NK => ops.b[cols.start * k..cols.end * k]
            .iter()
            .map(|x| x.to_f32())
            .collect(),
        BLayout::KN => cols
            .clone()
            .flat_map(|j| (0..k).map(move |kk| ops.b[kk * p.n + j].to_f32()))
            .collect(),
    };
    let mut products = vec![0f32; height * width];
    if height == 0 || width == 0 {
        return products;
    }
    // SAFETY: a is height × k (row stride k), b is read as k × width with row stride 1 and
    // column stride k (it holds width rows of k), products is height × width (row stride
    // width): every index the kernel forms lies inside its slice
    unsafe {
        matrixmultiply::sgemm(
            height,
            k,
            width,
            1.0,
            a.as_ptr(),
            k as isize,
            1,
            b.as_ptr(),
            1,
            k as isize,
            0.0,
            products.as_mut_ptr(),
            width as isize,
            1,
        );
    }
    products
}
