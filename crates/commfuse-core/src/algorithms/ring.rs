//! Ring phases: a reduce-scatter and an all-gather over any ordered set of ranks, push-based,
//! with neighbour-only handshakes. Several disjoint rings can run in one phase (the 2D ring runs
//! one per NUMA group, or one per local index); they share signal rows and scratch offsets,
//! which is safe because slots and scratch are per rank.

use crate::plan::{BufferKind, PlanBuilder, Region, Slot};
use crate::topology::ring_neighbours;
use std::ops::Range;

/// One ring: `members` in ring order; chunk j (in the message's element space) ends up owned
/// by `members[j]`. A chunk is a list of contiguous pieces moved by separate steps, so that a
/// later phase that works on the pieces touches exactly the regions this one wrote (the CUDA
/// backend splits every step across blocks by offset; see the checker's alignment rule).
pub(crate) struct Ring {
    pub members: Vec<usize>,
    pub chunks: Vec<Vec<Range<usize>>>,
}

impl Ring {
    /// A ring whose chunks are single pieces.
    pub(crate) fn simple(
        members: Vec<usize>,
        chunks: impl IntoIterator<Item = Range<usize>>,
    ) -> Ring {
        Ring {
            members,
            chunks: chunks.into_iter().map(|c| vec![c]).collect(),
        }
    }
}

/// Maps (rank, element range of the message) to a region of that rank's buffers.
pub(crate) type Place<'a> = &'a dyn Fn(usize, Range<usize>) -> Region;

/// Ring reduce-scatter.
///
/// Cost card (ring of m ranks, message n elements): per rank m−1 steps, each sending n/m
/// elements to the right neighbour; bytes sent per rank (m−1)/m·n; signals per rank: 1 ready,
/// m−1 data, up to m−3 acks; scratch 2·⌈n/m⌉ (double-buffered receive slots; a little more
/// when chunks are cut into pieces, each piece slot sized for the largest piece).
///
/// Step s (0 ≤ s < m−1) of position j pushes the partial sum of chunk (j−s−1) mod m into the
/// right neighbour's scratch slot s mod 2; the final step reduces chunk j into `dst`.
/// Reusing a slot at step s needs the right neighbour's ack that it consumed step s−2.
pub(crate) fn reduce_scatter(b: &mut PlanBuilder, rings: &[Ring], src: Place, dst: Place) {
    let ready = b.rows(3);
    let (data, ack) = (ready + 1, ready + 2);
    let busy = || rings.iter().filter(|ring| ring.members.len() > 1);
    let pieces = busy()
        .flat_map(|r| r.chunks.iter().map(|c| c.len()))
        .max()
        .unwrap_or(0);
    let piece_cap = busy()
        .flat_map(|r| r.chunks.iter().flatten().map(|p| p.len()))
        .max()
        .unwrap_or(0);
    let slot_len = pieces * piece_cap;
    let base = b.scratch(2 * slot_len);
    // piece k of whatever chunk a receive slot holds sits at k·piece_cap, so that every reuse
    // of a slot touches regions starting at the same offsets
    let slot_buf = |rank: usize, step: usize, k: usize, piece: &Range<usize>| {
        let start = base + (step % 2) * slot_len + k * piece_cap;
        Region::new(rank, BufferKind::Scratch, start..start + piece.len())
    };
    for ring in rings {
        let m = ring.members.len();
        if m == 1 {
            let r = ring.members[0];
            for piece in &ring.chunks[0] {
                b.reduce(r, vec![src(r, piece.clone())], dst(r, piece.clone()));
            }
            continue;
        }
        for j in 0..m {
            let r = ring.members[j];
            let (left, right) = ring_neighbours(&ring.members, j);
            b.signal(r, left, Slot::new(ready, 0));
            b.wait(r, Slot::new(ready, 0), 1);
            for s in 0..m - 1 {
                let chunk = &ring.chunks[(j + m - (s + 1) % m) % m];
                if s >= 1 {
                    b.wait(r, Slot::new(data, s as u32 - 1), 1);
                }
                if s >= 2 {
                    b.wait(r, Slot::new(ack, s as u32 - 2), 1);
                }
                for (k, piece) in chunk.iter().enumerate() {
                    let mut srcs = vec![src(r, piece.clone())];
                    if s >= 1 {
                        srcs.push(slot_buf(r, s - 1, k, piece));
                    }
                    b.reduce(r, srcs, slot_buf(right, s, k, piece));
                }
                b.signal(r, right, Slot::new(data, s as u32));
                // the left neighbour reuses slot s−1 at its step s+1, if it has one
                if s >= 1 && s + 2 < m {
                    b.signal(r, left, Slot::new(ack, s as u32 - 1));
                }
            }
            let own = &ring.chunks[j];
            b.wait(r, Slot::new(data, m as u32 - 2), 1);
            for (k, piece) in own.iter().enumerate() {
                let partial = slot_buf(r, m - 2, k, piece);
                b.reduce(
                    r,
                    vec![src(r, piece.clone()), partial],
                    dst(r, piece.clone()),
                );
            }
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
            for piece in &ring.chunks[j] {
                b.copy(r, owned(r, piece.clone()), dst(r, piece.clone()));
            }
            if m == 1 {
                continue;
            }
            let (left, right) = ring_neighbours(&ring.members, j);
            b.signal(r, left, Slot::new(ready, 0));
            b.wait(r, Slot::new(ready, 0), 1);
            for t in 0..m - 1 {
                if t >= 1 {
                    b.wait(r, Slot::new(data, t as u32 - 1), 1);
                }
                for piece in &ring.chunks[(j + m - t) % m] {
                    let from = if t == 0 {
                        owned(r, piece.clone())
                    } else {
                        dst(r, piece.clone())
                    };
                    b.copy(r, from, dst(right, piece.clone()));
                }
                b.signal(r, right, Slot::new(data, t as u32));
            }
            b.wait(r, Slot::new(data, m as u32 - 2), 1);
        }
    }
}
