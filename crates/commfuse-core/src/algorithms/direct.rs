//! Direct (all-to-all) building blocks.

use crate::plan::{PlanBuilder, Slot};

/// Peers of `rank` in staggered order (rank+1, rank+2, …) so that no two ranks hit the same
/// peer at the same moment.
pub fn staggered_peers(rank: usize, world: usize) -> impl Iterator<Item = usize> {
    (1..world).map(move |d| (rank + d) % world)
}

/// The scratch slot in which `receiver` keeps what `sender` pushed to it: the P−1 peers of a
/// rank take slots 0..P−1 in staggered order.
pub(crate) fn push_slot(receiver: usize, sender: usize, world: usize) -> usize {
    (sender + world - receiver - 1) % world
}

/// Every rank signals column `self` of `row` on every peer, then waits for every peer's column.
/// Used as "my buffers are ready" on entry and "I no longer read your buffers" on exit.
pub(crate) fn handshake(b: &mut PlanBuilder, row: u32) {
    let world = b.world();
    for r in 0..world {
        for q in staggered_peers(r, world) {
            b.signal(r, q, Slot::new(row, r as u32));
        }
    }
    for r in 0..world {
        for q in staggered_peers(r, world) {
            b.wait(r, Slot::new(row, q as u32), 1);
        }
    }
}
