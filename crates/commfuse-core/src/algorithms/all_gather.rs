//! All-gather algorithms: rank r contributes input[0..len_r] as chunk r of every output.

use super::all_reduce::{input, output};
use super::direct::{handshake, staggered_peers};
use super::ring::{self, Ring};
use crate::op::chunk_range;
use crate::plan::{PlanBuilder, Slot};

/// Direct (push): after an entry handshake ("my output may be written"), every rank stores its
/// chunk into its own and every peer's output in one pass and signals each peer; it then waits
/// for every peer's chunk.
///
/// Cost card: 1 data step per rank sending (P−1)·n/P elements; 2(P−1) signals; no scratch.
pub(super) fn direct(b: &mut PlanBuilder) {
    let (p, n) = (b.world(), b.spec().count);
    let rows = b.rows(2);
    let data = rows + 1;
    handshake(b, rows);
    for r in 0..p {
        let c = chunk_range(n, p, r);
        // one pass: the local copy overlaps the pushes to the peers
        let dsts = std::iter::once(r)
            .chain(staggered_peers(r, p))
            .map(|q| output(q, c.clone()))
            .collect();
        b.copy_to(r, input(r, 0..c.len()), dsts);
        for q in staggered_peers(r, p) {
            b.signal(r, q, Slot::new(data, r as u32));
        }
        for q in staggered_peers(r, p) {
            b.wait(r, Slot::new(data, q as u32), 1);
        }
    }
}

/// Ring: P−1 neighbour steps of n/P elements, chunks landing in place.
pub(super) fn ring(b: &mut PlanBuilder) {
    let (p, n) = (b.world(), b.spec().count);
    let rings = [Ring::simple(
        (0..p).collect(),
        (0..p).map(|j| chunk_range(n, p, j)),
    )];
    ring::all_gather(b, &rings, &|r, c| input(r, 0..c.len()), &output);
}
