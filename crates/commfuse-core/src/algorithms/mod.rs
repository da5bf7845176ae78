//! Every collective algorithm as a pure function from (op, world size, topology, sizes) to a
//! [`Plan`]. Shared building blocks: [`ring`] (ring reduce-scatter and all-gather phases that
//! compose into ring and 2D-ring algorithms) and [`direct`] (all-to-all handshakes).

mod all_gather;
mod all_reduce;
mod all_to_all;
mod barrier;
mod broadcast;
pub(crate) mod direct;
pub use direct::staggered_peers;
mod reduce_scatter;
pub use reduce_scatter::{PIPELINE_STAGES_MAX, PIPELINE_STAGE_MIN};
pub(crate) mod ring;

use crate::error::Error;
use crate::op::{OpKind, OpSpec};
use crate::plan::{Plan, PlanBuilder};
use crate::topology::Topology;
use std::fmt;
use std::str::FromStr;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Algo {
    /// Every rank reads every peer's whole input and reduces locally (mesh).
    OneShot,
    /// Every rank stores its whole input into every peer's scratch and reduces what it
    /// received locally: stores instead of loads, and no exit handshake.
    OneShotPush,
    /// Reduce-scatter then all-gather, each direct.
    TwoPhase,
    /// Neighbour-only ring.
    Ring,
    /// Ring inside each NUMA group, then across groups, then inside again.
    Ring2d,
    /// Every rank talks to every peer at once.
    Direct,
    /// Direct, with every transfer a store into the receiver's scratch (no exit handshake).
    Push,
    /// Push in stages, each stage's reduction overlapping the next one's transfer.
    PushPipelined,
    /// Barrier where every rank signals every peer.
    AllToAll,
}

impl Algo {
    pub const ALL: [Algo; 9] = [
        Algo::OneShot,
        Algo::OneShotPush,
        Algo::TwoPhase,
        Algo::Ring,
        Algo::Ring2d,
        Algo::Direct,
        Algo::Push,
        Algo::PushPipelined,
        Algo::AllToAll,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Algo::OneShot => "one-shot",
            Algo::OneShotPush => "one-shot-push",
            Algo::TwoPhase => "two-phase",
            Algo::Ring => "ring",
            Algo::Ring2d => "ring-2d",
            Algo::Direct => "direct",
            Algo::Push => "push",
            Algo::PushPipelined => "push-pipelined",
            Algo::AllToAll => "all-to-all",
        }
    }

    /// The algorithms an op offers, the default first.
    pub fn for_op(op: OpKind) -> &'static [Algo] {
        match op {
            OpKind::AllReduce => &[
                Algo::TwoPhase,
                Algo::OneShot,
                Algo::OneShotPush,
                Algo::Ring,
                Algo::Ring2d,
            ],
            OpKind::ReduceScatter => &[Algo::Direct, Algo::Push, Algo::PushPipelined, Algo::Ring],
            OpKind::AllGather | OpKind::Broadcast => &[Algo::Direct, Algo::Ring],
            OpKind::AllToAll => &[Algo::Direct],
            OpKind::Barrier => &[Algo::AllToAll, Algo::Ring],
        }
    }

    /// Parses `name` as one of `op`'s algorithms.
    pub fn parse_for(op: OpKind, name: &str) -> Result<Algo, Error> {
        let choices = Algo::for_op(op);
        choices
            .iter()
            .copied()
            .find(|a| a.name() == name)
            .ok_or_else(|| Error::UnknownAlgo {
                op: op.name().to_string(),
                algo: name.to_string(),
                choices: choices
                    .iter()
                    .map(|a| a.name())
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }
}

impl fmt::Display for Algo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Algo {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Algo::ALL
            .into_iter()
            .find(|a| a.name() == s)
            .ok_or_else(|| format!("unknown algorithm '{s}'"))
    }
}

/// Builds the plan of `algo` for `spec` on `topology`.
pub fn build_plan(spec: OpSpec, algo: Algo, topology: &Topology) -> Result<Plan, Error> {
    if !Algo::for_op(spec.kind).contains(&algo) {
        return Err(Algo::parse_for(spec.kind, algo.name()).unwrap_err());
    }
    if topology.world != spec.world {
        return Err(Error::Unsupported(format!(
            "topology describes {} ranks but the op has {}",
            topology.world, spec.world
        )));
    }
    let mut b = PlanBuilder::new(spec);
    match (spec.kind, algo) {
        (OpKind::AllReduce, Algo::OneShot) => all_reduce::one_shot(&mut b),
        (OpKind::AllReduce, Algo::OneShotPush) => all_reduce::one_shot_push(&mut b),
        (OpKind::ReduceScatter, Algo::Push) => reduce_scatter::push(&mut b),
        (OpKind::ReduceScatter, Algo::PushPipelined) => reduce_scatter::push_pipelined(&mut b),
        (OpKind::AllReduce, Algo::TwoPhase) => all_reduce::two_phase(&mut b),
        (OpKind::AllReduce, Algo::Ring) => all_reduce::ring(&mut b),
        (OpKind::AllReduce, Algo::Ring2d) => all_reduce::ring_2d(&mut b, topology)?,
        (OpKind::ReduceScatter, Algo::Direct) => reduce_scatter::direct(&mut b),
        (OpKind::ReduceScatter, Algo::Ring) => reduce_scatter::ring(&mut b),
        (OpKind::AllGather, Algo::Direct) => all_gather::direct(&mut b),
        (OpKind::AllGather, Algo::Ring) => all_gather::ring(&mut b),
        (OpKind::Broadcast, Algo::Direct) => broadcast::direct(&mut b),
        (OpKind::Broadcast, Algo::Ring) => broadcast::ring(&mut b),
        (OpKind::AllToAll, Algo::Direct) => all_to_all::direct(&mut b),
        (OpKind::Barrier, Algo::AllToAll) => barrier::all_to_all(&mut b),
        (OpKind::Barrier, Algo::Ring) => barrier::ring(&mut b),
        _ => unreachable!("checked against Algo::for_op above"),
    }
    Ok(b.finish(algo.name()))
}
