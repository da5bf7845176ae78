//! Barriers as plans: no data, only signals.

use super::direct::handshake;
use crate::plan::{PlanBuilder, Slot};

/// Every rank signals every peer and waits for all: one latency, P−1 signals per rank.
pub(super) fn all_to_all(b: &mut PlanBuilder) {
    let row = b.rows(1);
    handshake(b, row);
}

/// Ring: an arrival token goes once around the ring from rank 0, then a release token; 2P−1
/// latencies, 2 signals per rank. Suits links where fan-out is expensive.
pub(super) fn ring(b: &mut PlanBuilder) {
    let p = b.world();
    let arrive = b.rows(2);
    let release = arrive + 1;
    if p == 1 {
        return;
    }
    let right = |r: usize| (r + 1) % p;
    b.signal(0, right(0), Slot::new(arrive, 0));
    b.wait(0, Slot::new(arrive, 0), 1);
    b.signal(0, right(0), Slot::new(release, 0));
    for r in 1..p {
        b.wait(r, Slot::new(arrive, 0), 1);
        b.signal(r, right(r), Slot::new(arrive, 0));
        b.wait(r, Slot::new(release, 0), 1);
        if r + 1 < p {
            b.signal(r, right(r), Slot::new(release, 0));
        }
    }
}
