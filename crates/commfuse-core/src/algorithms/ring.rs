//! Ring phases: a reduce-scatter and an all-gather over any ordered set of ranks, push-based,
//! with neighbour-only handshakes. Several disjoint rings can run in one phase (the 2D ring runs
//! one per NUMA group, or one per local index); they share signal rows and scratch offsets,
//! which is safe because slots and scratch are per rank.

use crate::plan::{BufferKind, PlanBuilder, Region, Slot};
use crate::topology::ring_neighbours;
use std::ops::Range;

/// One ring: `members` in ring order; `chunks[j]` (in the message's element space) ends up
/// owned by `members[j]`.
pub(crate) struct Ring {
    pub members: Vec<usize>,
    pub chunks: Vec<Range<usize>>,
}

/// Maps (rank, element range of the message) to a region of that rank's buffers.
pub(crate) type Place<'a> = &'a dyn Fn(usize, Range<usize>) -> Region;

/// Ring reduce-scatter.
///
/// Cost card (ring of m ranks, message n elements): per rank m−1 steps, each sending n/m
/// elements to the right neighbour; bytes sent per rank (m−1)/m·n; signals per rank: 1 ready,
/// m−1 data, up to m−3 acks; scratch 2·⌈n/m⌉ (double-buffered receive slots).
///
/// Step s (0 ≤ s < m−1) of position j pushes the partial sum of chunk (j−s−1) mod m into the
/// right neighbour's scratch slot s mod 2; the final step reduces chunk j into `dst`.
/// Reusing a slot at step s needs the right neighbour's ack that it consumed step s−2.
pub(crate) fn reduce_scatter(b: &mut PlanBuilder, rings: &[Ring], src: Place, dst: Place) {
    let ready = b.rows(3);
    let (data, ack) = (ready + 1, ready + 2);
    let slot_len = rings
        .iter()
        .filter(|ring| ring.members.len() > 1)
        .flat_map(|ring| ring.chunks.iter().map(|c| c.len()))
        .max()
        .unwrap_or(0);
    let base = b.scratch(2 * slot_len);
    let slot_buf = |rank: usize, step: usize, len: usize| {
        let start = base + (step % 2) * slot_len;
        Region::new(rank, BufferKind::Scratch, start..start + len)
    };
    for ring in rings {
        let m = ring.members.len();
        if m == 1 {
            let (r, c) = (ring.members[0], ring.chunks[0].clone());
            b.reduce(r, vec![src(r, c.clone())], dst(r, c));
            continue;
        }
        for j in 0..m {
            let r = ring.members[j];
            let (left, right) = ring_neighbours(&ring.members, j);
            b.signal(r, left, Slot::new(ready, 0));
            b.wait(r, Slot::new(ready, 0), 1);
            for s in 0..m - 1 {
                let chunk = ring.chunks[(j + m - (s + 1) % m) % m].clone();
                let len = chunk.len();
                let mut srcs = vec![src(r, chunk)];
                if s >= 1 {
                    b.wait(r, Slot::new(data, s as u32 - 1), 1);
                    srcs.push(slot_buf(r, s - 1, len));
                }
                if s >= 2 {
                    b.wait(r, Slot::new(ack, s as u32 - 2), 1);
                }
                b.reduce(r, srcs, slot_buf(right, s, len));
                b.signal(r, right, Slot::new(data, s as u32));
                // the left neighbour reuses slot s−1 at its step s+1, if it has one
                if s >= 1 && s + 2 < m {
                    b.signal(r, left, Slot::new(ack, s as u32 - 1));
                }
            }
            let own = ring.chunks[j].clone();
            b.wait(r, Slot::new(data, m as u32 - 2), 1);
            let partial = slot_buf(r, m - 2, own.len());
            b.reduce(r, vec![src(r, own.clone()), partial], dst(r, own));
        }
    }
}

/// Ring all-gather: member j starts with chunk j at `owned(rank, chunk j)` and ends with every
/// chunk at `dst`.
///
/// Cost card: per rank m−1 steps of n/m elements to the right neighbour; bytes sent per rank
/// (m−1)/m·n; signals per rank 1 ready + m−1 data; no scratch (chunks land in place).
pub(crate) fn all_gather(b: &mut PlanBuilder, rings: &[Ring], owned: Place, dst: Place) {
    let ready = b.rows(2);
    let data = ready + 1;
    for ring in rings {
        let m = ring.members.len();
        for j in 0..m {
            let r = ring.members[j];
            let own = ring.chunks[j].clone();
            b.copy(r, owned(r, own.clone()), dst(r, own));
            if m == 1 {
                continue;
            }
            let (left, right) = ring_neighbours(&ring.members, j);
            b.signal(r, left, Slot::new(ready, 0));
            b.wait(r, Slot::new(ready, 0), 1);
            for t in 0..m - 1 {
                let chunk = ring.chunks[(j + m - t) % m].clone();
                let from = if t == 0 {
                    owned(r, chunk.clone())
                } else {
                    b.wait(r, Slot::new(data, t as u32 - 1), 1);
                    dst(r, chunk.clone())
                };
                b.copy(r, from, dst(right, chunk));
                b.signal(r, right, Slot::new(data, t as u32));
            }
            b.wait(r, Slot::new(data, m as u32 - 2), 1);
        }
    }
}
