//! Broadcast algorithms: the root's input lands in every rank's output.

use super::all_reduce::{input, output};
use super::direct::staggered_peers;
use crate::op::chunk_range;
use crate::plan::{PlanBuilder, Slot};

/// Direct (push from the root): each rank tells the root its output is free; the root stores
/// the message into every output in one pass and signals each.
///
/// Cost card: the root sends (P−1)·n elements in 1 step; 2(P−1) signals; no scratch.
pub(super) fn direct(b: &mut PlanBuilder) {
    let (p, n, root) = (b.world(), b.spec().count, b.spec().root);
    let ready = b.rows(2);
    let data = ready + 1;
    for r in staggered_peers(root, p) {
        b.signal(r, root, Slot::new(ready, r as u32));
    }
    for r in staggered_peers(root, p) {
        b.wait(root, Slot::new(ready, r as u32), 1);
    }
    let dsts = std::iter::once(root)
        .chain(staggered_peers(root, p))
        .map(|q| output(q, 0..n))
        .collect();
    b.copy_to(root, input(root, 0..n), dsts);
    for q in staggered_peers(root, p) {
        b.signal(root, q, Slot::new(data, 0));
    }
    for r in staggered_peers(root, p) {
        b.wait(r, Slot::new(data, 0), 1);
    }
}

/// How many pieces the ring broadcast pipelines a message of `n` elements into: about 64 Ki
/// elements each, at least 4 (so that small messages still pipeline), at most 64.
pub(crate) fn pipeline_chunks(n: usize) -> usize {
    n.div_ceil(1 << 16).clamp(4, 64).min(n).max(1)
}

/// Ring (pipelined): the message travels root → root+1 → … in pieces, each rank forwarding
/// piece k as soon as it arrives, so all links carry data at once.
///
/// Cost card: every rank but the last sends n elements in K pieces (K = pipeline_chunks(n));
/// time ≈ (P−1+K−1) piece steps; 1 ready + K data signals per hop; no scratch.
pub(super) fn ring(b: &mut PlanBuilder) {
    let (p, n, root) = (b.world(), b.spec().count, b.spec().root);
    let pieces = pipeline_chunks(n);
    let ready = b.rows(2);
    let data = ready + 1;
    let order: Vec<usize> = (0..p).map(|j| (root + j) % p).collect();
    for j in 0..p {
        let r = order[j];
        if j > 0 {
            b.signal(r, order[j - 1], Slot::new(ready, 0));
        } else {
            b.copy(r, input(r, 0..n), output(r, 0..n));
        }
        let right = (j + 1 < p).then(|| order[j + 1]);
        if right.is_some() {
            b.wait(r, Slot::new(ready, 0), 1);
        }
        for k in 0..pieces {
            let c = chunk_range(n, pieces, k);
            if j > 0 {
                b.wait(r, Slot::new(data, k as u32), 1);
            }
            if let Some(right) = right {
                let from = if j == 0 {
                    input(r, c.clone())
                } else {
                    output(r, c.clone())
                };
                b.copy(r, from, output(right, c));
                b.signal(r, right, Slot::new(data, k as u32));
            }
        }
    }
}
