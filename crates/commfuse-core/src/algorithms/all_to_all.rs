//! All-to-all: block q of rank r's input (chunk q) lands in rank q's output at block r.

use super::all_reduce::{input, output};
use super::direct::{handshake, staggered_peers};
use crate::op::chunk_range;
use crate::plan::{PlanBuilder, Slot};

/// Direct (push): after an entry handshake every rank stores each block straight into its
/// destination's output, staggered, and signals it.
///
/// Cost card: P−1 stores per rank totalling (P−1)/P·n elements; 2(P−1) signals; no scratch.
pub(super) fn direct(b: &mut PlanBuilder) {
    let (p, n) = (b.world(), b.spec().count);
    let rows = b.rows(2);
    let data = rows + 1;
    handshake(b, rows);
    for r in 0..p {
        let mine = chunk_range(n, p, r);
        b.copy(
            r,
            input(r, mine.clone()),
            output(r, r * mine.len()..(r + 1) * mine.len()),
        );
        for q in staggered_peers(r, p) {
            let block = chunk_range(n, p, q);
            let at = r * block.len();
            b.copy(r, input(r, block.clone()), output(q, at..at + block.len()));
            b.signal(r, q, Slot::new(data, r as u32));
        }
        for q in staggered_peers(r, p) {
            b.wait(r, Slot::new(data, q as u32), 1);
        }
    }
}
