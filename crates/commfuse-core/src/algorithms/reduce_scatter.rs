//! Reduce-scatter algorithms: rank r ends with chunk r of the reduction, at output[0..].

use super::all_reduce::{input, output};
use super::direct::{handshake, push_slot, staggered_peers};
use super::ring::{self, Ring};
use crate::op::chunk_range;
use crate::plan::{BufferKind, PlanBuilder, Region, Slot};

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

/// Push: after an entry handshake ("my scratch is free"), every rank stores chunk q of its
/// input into a slot of rank q's scratch and signals it; rank r then reduces its own chunk with
/// the P−1 it received, in rank order. No rank reads another's memory, so no exit handshake.
///
/// Cost card: P−1 stores of n/P elements per rank, 1 local reduction; 2(P−1) signals; scratch
/// (P−1)·⌈n/P⌉ (≤ the message).
pub(super) fn push(b: &mut PlanBuilder) {
    let (p, n) = (b.world(), b.spec().count);
    let rows = b.rows(2);
    let data = rows + 1;
    let cap = chunk_range(n, p, 0).len();
    let base = b.scratch((p - 1) * cap);
    let slot = |receiver: usize, sender: usize| {
        let at = base + push_slot(receiver, sender, p) * cap;
        let len = chunk_range(n, p, receiver).len();
        Region::new(receiver, BufferKind::Scratch, at..at + len)
    };
    handshake(b, rows);
    for r in 0..p {
        for q in staggered_peers(r, p) {
            b.copy(r, input(r, chunk_range(n, p, q)), slot(q, r));
            b.signal(r, q, Slot::new(data, r as u32));
        }
        for q in staggered_peers(r, p) {
            b.wait(r, Slot::new(data, q as u32), 1);
        }
        let own = chunk_range(n, p, r);
        let srcs = (0..p)
            .map(|q| {
                if q == r {
                    input(r, own.clone())
                } else {
                    slot(r, q)
                }
            })
            .collect();
        b.reduce(r, srcs, output(r, 0..own.len()));
    }
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
