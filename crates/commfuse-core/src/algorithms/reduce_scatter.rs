//! Reduce-scatter algorithms: rank r ends with chunk r of the reduction, at output[0..].

use super::all_reduce::{input, output};
use super::direct::handshake;
use super::ring::{self, Ring};
use crate::op::chunk_range;
use crate::plan::PlanBuilder;

/// Direct: after an entry handshake rank r reads chunk r of every input and reduces it; an exit
/// handshake keeps inputs alive until all peers have read them.
///
/// Cost card: 1 data step per rank receiving (P−1)/P·n elements; 2(P−1) signals; no scratch.
pub(super) fn direct(b: &mut PlanBuilder) {
    let (p, n) = (b.world(), b.spec().count);
    let rows = b.rows(2);
    handshake(b, rows);
    for r in 0..p {
        let c = chunk_range(n, p, r);
        let srcs = (0..p).map(|q| input(q, c.clone())).collect();
        b.reduce(r, srcs, output(r, 0..c.len()));
    }
    handshake(b, rows + 1);
}

/// Ring: the reduce-scatter phase of the ring all-reduce, finishing into output[0..].
///
/// Cost card: P−1 steps of n/P elements per rank to the right neighbour; scratch 2·⌈n/P⌉.
pub(super) fn ring(b: &mut PlanBuilder) {
    let (p, n) = (b.world(), b.spec().count);
    let rings = [Ring::simple(
        (0..p).collect(),
        (0..p).map(|j| chunk_range(n, p, j)),
    )];
    ring::reduce_scatter(b, &rings, &input, &|r, c| output(r, 0..c.len()));
}
