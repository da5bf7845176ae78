//! Cost cards: what a plan moves and how long the latency–bandwidth model says it takes.

use crate::checker::CheckedPlan;
use crate::plan::Step;
use crate::topology::Topology;
use std::fmt;

/// Per-rank traffic and signalling of one call.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RankCost {
    /// Bytes that leave this rank's memory over links (its stores to peers and peers' loads).
    pub bytes_sent: u64,
    /// Bytes that arrive in this rank's memory or registers over links.
    pub bytes_received: u64,
    /// Data steps (copies and reductions).
    pub steps: usize,
    /// Largest number of bytes one data step moves across links.
    pub max_bytes_per_step: u64,
    /// Notifies issued.
    pub signals: usize,
    /// Predicted finishing time, µs.
    pub predicted_us: f64,
}

#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct CostCard {
    pub op: String,
    pub algo: String,
    pub world: usize,
    pub count: usize,
    pub elem_bytes: usize,
    pub scratch_bytes_per_rank: u64,
    pub per_rank: Vec<RankCost>,
    /// The slowest rank's predicted time, µs.
    pub predicted_us: f64,
}

impl CostCard {
    pub fn of(checked: &CheckedPlan, topology: &Topology, elem_bytes: usize) -> CostCard {
        let plan = checked.plan();
        let p = plan.world();
        let timing = checked.timing(topology, elem_bytes);
        let mut per_rank: Vec<RankCost> = (0..p)
            .map(|r| RankCost {
                bytes_sent: 0,
                bytes_received: 0,
                steps: 0,
                max_bytes_per_step: 0,
                signals: 0,
                predicted_us: timing.per_rank_us[r],
            })
            .collect();
        let eb = elem_bytes as u64;
        for (r, steps) in plan.steps.iter().enumerate() {
            for step in steps {
                if let Step::Notify { .. } = step {
                    per_rank[r].signals += 1;
                }
                let (srcs, dsts) = step.regions();
                if dsts.is_empty() {
                    continue;
                }
                per_rank[r].steps += 1;
                let mut moved = 0;
                for src in srcs.iter().filter(|s| s.rank != r) {
                    let bytes = src.len as u64 * eb;
                    per_rank[src.rank].bytes_sent += bytes;
                    per_rank[r].bytes_received += bytes;
                    moved += bytes;
                }
                for dst in dsts.iter().filter(|d| d.rank != r) {
                    let bytes = dst.len as u64 * eb;
                    per_rank[r].bytes_sent += bytes;
                    per_rank[dst.rank].bytes_received += bytes;
                    moved += bytes;
                }
                per_rank[r].max_bytes_per_step = per_rank[r].max_bytes_per_step.max(moved);
            }
        }
        CostCard {
            op: plan.spec.kind.name().into(),
            algo: plan.algo.clone(),
            world: p,
            count: plan.spec.count,
            elem_bytes,
            scratch_bytes_per_rank: plan.buffers.scratch as u64 * eb,
            per_rank,
            predicted_us: timing.total_us(),
        }
    }
}

impl fmt::Display for CostCard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "cost card: {} {} on {} ranks, {} elements of {} bytes; scratch {} bytes per rank",
            self.op,
            self.algo,
            self.world,
            self.count,
            self.elem_bytes,
            self.scratch_bytes_per_rank
        )?;
        writeln!(
            f,
            "  {:>4}  {:>14}  {:>14}  {:>6}  {:>14}  {:>7}  {:>12}",
            "rank", "bytes sent", "bytes recv", "steps", "max B/step", "signals", "predicted µs"
        )?;
        for (r, c) in self.per_rank.iter().enumerate() {
            writeln!(
                f,
                "  {:>4}  {:>14}  {:>14}  {:>6}  {:>14}  {:>7}  {:>12.2}",
                r,
                c.bytes_sent,
                c.bytes_received,
                c.steps,
                c.max_bytes_per_step,
                c.signals,
                c.predicted_us
            )?;
        }
        write!(
            f,
            "  predicted time (slowest rank): {:.2} µs",
            self.predicted_us
        )
    }
}
