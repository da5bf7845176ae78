//! Barriers as objects ranks call repeatedly, built on the protocols in [`crate::protocol`].

use crate::protocol::{all_to_all_barrier, ring_barrier};
use crate::world::{RankContext, World};
use commfuse_core::backend::BackendError;
use commfuse_core::{Cmp, Slot};
use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BarrierKind {
    AllToAll,
    Ring,
}

/// A barrier over every rank of a world. Each rank counts its own epochs, so repeated calls
/// need no reset.
pub struct Barrier {
    kind: BarrierKind,
    row: u32,
    epochs: Vec<AtomicU64>,
}

impl Barrier {
    pub fn new(world: &World, kind: BarrierKind) -> Result<Barrier, BackendError> {
        let rows = match kind {
            BarrierKind::AllToAll => 1,
            BarrierKind::Ring => 2,
        };
        Ok(Barrier {
            kind,
            row: world.reserve_rows(rows)?,
            epochs: (0..world.size()).map(|_| AtomicU64::new(0)).collect(),
        })
    }

    /// Returns once every rank has called `wait` as often as this one.
    pub fn wait(&self, ctx: &RankContext<'_>) -> Result<(), BackendError> {
        let rank = ctx.rank();
        // only rank `rank`'s thread touches its epoch
        let epoch = self.epochs[rank].fetch_add(1, Ordering::Relaxed) + 1;
        let mut backoff = ctx.backoff();
        let world = ctx.world();
        let result = match self.kind {
            BarrierKind::AllToAll => {
                all_to_all_barrier(world, world.size(), rank, self.row, epoch, &mut backoff)
            }
            BarrierKind::Ring => {
                ring_barrier(world, world.size(), rank, self.row, epoch, &mut backoff)
            }
        };
        result.map_err(|s| {
            let slot = Slot::new(s.row, s.col);
            ctx.stuck(s.stop, slot, Cmp::Ge, (s.expected, s.seen), s.peer)
        })
    }
}
