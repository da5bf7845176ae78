//! All-reduce algorithms.

use super::direct::{handshake, push_slot, staggered_peers};
use super::ring::{self, Ring};
use crate::error::Error;
use crate::op::chunk_range;
use crate::plan::{BufferKind, PlanBuilder, Region, Slot};
use crate::topology::Topology;
use std::ops::Range;

pub(super) fn input(rank: usize, range: Range<usize>) -> Region {
    Region::new(rank, BufferKind::Input, range)
}

pub(super) fn output(rank: usize, range: Range<usize>) -> Region {
    Region::new(rank, BufferKind::Output, range)
}

/// One-shot (mesh): after an entry handshake every rank reads all P inputs and reduces them in
/// rank order (so every rank gets bit-identical results); an exit handshake keeps inputs alive
/// until every peer has read them.
///
/// Cost card: 1 data step per rank receiving (P−1)·n elements; 2(P−1) signals; no scratch.
pub(super) fn one_shot(b: &mut PlanBuilder) {
    let (p, n) = (b.world(), b.spec().count);
    let rows = b.rows(2);
    handshake(b, rows);
    for r in 0..p {
        let srcs = (0..p).map(|q| input(q, 0..n)).collect();
        b.reduce(r, srcs, output(r, 0..n));
    }
    handshake(b, rows + 1);
}

/// One-shot by push: after an entry handshake ("my scratch is free"), every rank stores its
/// whole input into a slot of every peer's scratch in one pass and signals each; once all its
/// peers' inputs have arrived it reduces them with its own, in rank order. Nobody reads another
/// rank's memory, so no exit handshake: the next call's entry handshake protects the slots.
///
/// Cost card: 1 store step sending (P−1)·n elements, 1 local reduction of P·n; 2(P−1) signals;
/// scratch (P−1)·n (one-shot's exception to the 2× rule).
pub(super) fn one_shot_push(b: &mut PlanBuilder) {
    let (p, n) = (b.world(), b.spec().count);
    let rows = b.rows(2);
    let data = rows + 1;
    let base = b.scratch((p - 1) * n);
    let slot = |receiver: usize, sender: usize| {
        let at = base + push_slot(receiver, sender, p) * n;
        Region::new(receiver, BufferKind::Scratch, at..at + n)
    };
    handshake(b, rows);
    for r in 0..p {
        let dsts = staggered_peers(r, p).map(|q| slot(q, r)).collect();
        b.copy_to(r, input(r, 0..n), dsts);
        for q in staggered_peers(r, p) {
            b.signal(r, q, Slot::new(data, r as u32));
        }
        for q in staggered_peers(r, p) {
            b.wait(r, Slot::new(data, q as u32), 1);
        }
        let srcs = (0..p)
            .map(|q| if q == r { input(r, 0..n) } else { slot(r, q) })
            .collect();
        b.reduce(r, srcs, output(r, 0..n));
    }
}

/// Two-phase: rank r reduces chunk r of all inputs (a direct reduce-scatter) and, in the same
/// pass, stores the result into every rank's output (a direct all-gather by push), then signals
/// each peer. Loads of the peers' inputs and stores into their outputs run at once, so both
/// directions of every link carry data during the single pass.
///
/// Cost card: 1 data step per rank receiving (P−1)/P·n elements by loads and sending (P−1)/P·n
/// by stores; 3(P−1) signals; no scratch.
pub(super) fn two_phase(b: &mut PlanBuilder) {
    let (p, n) = (b.world(), b.spec().count);
    let rows = b.rows(3);
    // entry: "my input is ready and my output may be written"
    handshake(b, rows);
    for r in 0..p {
        let c = chunk_range(n, p, r);
        let srcs = (0..p).map(|q| input(q, c.clone())).collect();
        let dsts = std::iter::once(r)
            .chain(staggered_peers(r, p))
            .map(|q| output(q, c.clone()))
            .collect();
        b.reduce_to(r, srcs, dsts);
    }
    // "my chunk is in your output"
    handshake(b, rows + 1);
    // exit: "I no longer read your input"
    handshake(b, rows + 2);
}

/// Ring: ring reduce-scatter into the output, then ring all-gather in place.
///
/// Cost card: 2(P−1) steps of n/P elements per rank, neighbour-only; bytes sent per rank
/// 2(P−1)/P·n; scratch 2·⌈n/P⌉.
pub(super) fn ring(b: &mut PlanBuilder) {
    let (p, n) = (b.world(), b.spec().count);
    let rings = [Ring::simple(
        (0..p).collect(),
        (0..p).map(|j| chunk_range(n, p, j)),
    )];
    ring::reduce_scatter(b, &rings, &input, &output);
    ring::all_gather(b, &rings, &output, &output);
}

/// 2D ring: reduce-scatter inside each NUMA group, all-reduce each group-chunk across groups
/// (ring over the ranks with the same local index), all-gather inside each group. Traffic across
/// groups shrinks by the group size compared with a flat ring.
///
/// Cost card (G groups of g ranks): 2(g−1) intra-group steps of n/g and 2(G−1) inter-group steps
/// of n/(gG) per rank; scratch 2·⌈n/g⌉ + 2·⌈n/P⌉.
pub(super) fn ring_2d(b: &mut PlanBuilder, topology: &Topology) -> Result<(), Error> {
    let (p, n) = (b.world(), b.spec().count);
    let groups = topology.numa_groups;
    if !p.is_multiple_of(groups) {
        return Err(Error::NotForWorld(format!(
            "ring-2d needs the world size ({p}) to be a multiple of the NUMA group count ({groups})"
        )));
    }
    let g = p / groups;
    // group-chunk j, cut into the pieces the cross-group ring owns
    let pieces = |j: usize| -> Vec<Range<usize>> {
        let c = chunk_range(n, g, j);
        (0..groups)
            .map(|k| {
                let sub = chunk_range(c.len(), groups, k);
                c.start + sub.start..c.start + sub.end
            })
            .collect()
    };
    let inner: Vec<Ring> = (0..groups)
        .map(|k| Ring {
            members: topology.group_members(k),
            chunks: (0..g).map(pieces).collect(),
        })
        .collect();
    let across: Vec<Ring> = (0..g)
        .map(|j| Ring::simple((0..groups).map(|k| k * g + j).collect(), pieces(j)))
        .collect();
    ring::reduce_scatter(b, &inner, &input, &output);
    ring::reduce_scatter(b, &across, &output, &output);
    ring::all_gather(b, &across, &output, &output);
    ring::all_gather(b, &inner, &output, &output);
    Ok(())
}
