//! The implementations of a collective that can be chosen by name: the plans of steps
//! ([`Algo`]), commfuse's protocol kernels beyond the plans ([`Protocol`]: LL, LL16, the copy
//! engine), and the libraries measured beside them ([`Baseline`]: NCCL, the copy engine's
//! memcpy). Names are text only at the edges (the command line, bench JSON, a path's name);
//! everything inside passes these types, so that a backend's offer, a bench row and `--algo`
//! cannot disagree on a spelling.

use crate::algorithms::Algo;
use crate::error::Error;
use crate::op::OpKind;
use std::fmt;

/// One of commfuse's own implementations that is a kernel of its own rather than a plan of
/// steps: prepared by name ([`crate::backend::Backend::prepare_baseline`]) and benched as ours.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Protocol {
    /// Data and the call's number in every 8-byte line, one NVLink trip (small messages).
    Ll,
    /// The LL protocol with 16-byte lines: three data words and the call's number in each, where
    /// LL's 8-byte lines carry one word and the number: fewer bytes on the link for the same
    /// data, for sizes where those bytes set the time. Not taken by `auto` until measured
    /// against LL.
    Ll16,
    /// Large messages moved by the copy engines, the SMs only reducing.
    Ce,
}

impl Protocol {
    /// Every protocol, in the order a bench lists them.
    pub const ALL: [Protocol; 3] = [Protocol::Ll, Protocol::Ll16, Protocol::Ce];

    /// The name `--algo`, bench rows and an operator's path use.
    pub const fn name(self) -> &'static str {
        match self {
            Protocol::Ll => "ll",
            Protocol::Ll16 => "ll16",
            Protocol::Ce => "ce",
        }
    }

    /// What it is, in a few words (for `run`'s report, where a plan prints its cost card).
    pub const fn describe(self) -> &'static str {
        match self {
            Protocol::Ll => "the LL protocol: data and the call's number in every 8-byte line, one trip over the link",
            Protocol::Ll16 => "the LL protocol with 16-byte lines: three data words and the call's number in each",
            Protocol::Ce => "the copy-engine protocol: the copy engines move the chunks, the SMs only reduce",
        }
    }

    /// Whether the protocol implements `op` (on the backends that have it).
    pub fn implements(self, op: OpKind) -> bool {
        matches!(
            op,
            OpKind::AllReduce | OpKind::ReduceScatter | OpKind::AllGather
        )
    }
}

/// A library implementation measured beside ours in the same run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Baseline {
    /// NCCL's collective, single-process communicators over all ranks.
    Nccl,
    /// Peer-to-peer copies by the copy engine (`cuMemcpyPeerAsync`), for the ops that only move
    /// data.
    CopyEngine,
}

impl Baseline {
    /// Every baseline, in the order a bench lists them.
    pub const ALL: [Baseline; 2] = [Baseline::Nccl, Baseline::CopyEngine];

    /// The name `--algo` and bench rows use.
    pub const fn name(self) -> &'static str {
        match self {
            Baseline::Nccl => "nccl",
            Baseline::CopyEngine => "copy-engine",
        }
    }

    /// What it is, in a few words.
    pub const fn describe(self) -> &'static str {
        match self {
            Baseline::Nccl => "NCCL's collective, a baseline",
            Baseline::CopyEngine => "peer copies by the copy engine, a baseline",
        }
    }

    /// Whether the baseline implements `op`.
    pub fn implements(self, op: OpKind) -> bool {
        match self {
            Baseline::Nccl => op != OpKind::Barrier,
            Baseline::CopyEngine => {
                matches!(op, OpKind::AllGather | OpKind::Broadcast | OpKind::AllToAll)
            }
        }
    }

    /// The baselines of `op`, in the order a bench lists them.
    pub fn for_op(op: OpKind) -> Vec<Baseline> {
        Baseline::ALL
            .into_iter()
            .filter(|b| b.implements(op))
            .collect()
    }
}

/// Any implementation of a collective: what `--algo` names (beside `auto` and `all`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Implementation {
    /// A plan of steps, which both backends interpret.
    Plan(Algo),
    /// A protocol kernel of ours.
    Protocol(Protocol),
    /// A library baseline.
    Baseline(Baseline),
}

impl Implementation {
    /// The name `--algo` and bench rows use.
    pub fn name(self) -> &'static str {
        match self {
            Implementation::Plan(a) => a.name(),
            Implementation::Protocol(p) => p.name(),
            Implementation::Baseline(b) => b.name(),
        }
    }

    /// Every implementation of `op` on some backend: its plans (the default first), then our
    /// protocols, then the baselines.
    pub fn for_op(op: OpKind) -> Vec<Implementation> {
        let plans = Algo::for_op(op).iter().copied().map(Implementation::Plan);
        let protocols = Protocol::ALL
            .into_iter()
            .filter(|p| p.implements(op))
            .map(Implementation::Protocol);
        let baselines = Baseline::for_op(op)
            .into_iter()
            .map(Implementation::Baseline);
        plans.chain(protocols).chain(baselines).collect()
    }

    /// `op`'s implementations' names, comma-separated.
    pub fn names_for(op: OpKind) -> String {
        Implementation::for_op(op)
            .iter()
            .map(|i| i.name())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Parses `name` as one of `op`'s implementations; the error lists them all.
    pub fn parse_for(op: OpKind, name: &str) -> Result<Implementation, Error> {
        Implementation::for_op(op)
            .into_iter()
            .find(|i| i.name() == name)
            .ok_or_else(|| Error::UnknownAlgo {
                op: op.name().to_string(),
                algo: name.to_string(),
                choices: Implementation::names_for(op),
            })
    }
}

impl fmt::Display for Implementation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl fmt::Display for Baseline {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_parses_back_to_its_implementation_and_no_two_share_one() {
        for op in OpKind::ALL {
            let all = Implementation::for_op(op);
            for (i, imp) in all.iter().enumerate() {
                assert_eq!(Implementation::parse_for(op, imp.name()).unwrap(), *imp);
                assert!(
                    all[..i].iter().all(|o| o.name() != imp.name()),
                    "{op}: {imp} twice"
                );
            }
        }
    }

    #[test]
    fn each_op_offers_its_plans_then_protocols_then_baselines() {
        assert_eq!(
            Implementation::names_for(OpKind::AllReduce),
            "two-phase, one-shot, one-shot-push, ring, ring-2d, ll, ll16, ce, nccl"
        );
        assert_eq!(
            Implementation::names_for(OpKind::AllGather),
            "direct, ring, ll, ll16, ce, nccl, copy-engine"
        );
        assert_eq!(
            Implementation::names_for(OpKind::Barrier),
            "all-to-all, ring"
        );
        let e = Implementation::parse_for(OpKind::Broadcast, "ll").unwrap_err();
        assert_eq!(
            e.to_string(),
            "broadcast has no algorithm 'll' (choose one of: direct, ring, nccl, copy-engine)"
        );
    }
}
