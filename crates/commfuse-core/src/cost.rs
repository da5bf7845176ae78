//! Cost cards: what a plan moves and how long the latency–bandwidth model says it takes; and
//! the default choice of algorithm, [`choose_algo`]: the one the model predicts fastest.

use crate::algorithms::{build_plan, Algo};
use crate::checker::{check, CheckedPlan};
use crate::error::Error;
use crate::op::OpSpec;
use crate::plan::Step;
use crate::topology::Topology;
use std::fmt;

/// The algorithm [`choose_algo`] picked, its checked plan, and every candidate's prediction.
#[derive(Debug, Clone)]
pub struct AlgoChoice {
    pub algo: Algo,
    pub plan: CheckedPlan,
    /// The model's time for `algo`, µs.
    pub predicted_us: f64,
    /// Every algorithm of the op in its default order, with its predicted time or why it cannot
    /// run here (e.g. ring-2d when the world size is not a multiple of the NUMA group count).
    pub candidates: Vec<(Algo, Result<f64, Error>)>,
}

/// Bytes a rank sends in all up to which an all-reduce, a reduce-scatter or an all-gather goes
/// by the LL protocol (data and the call's number in every 8-byte line, one NVLink trip) where a
/// backend has it and the caller left the choice to `auto`: on 2 × H200 the all-reduce beat
/// every plan and NCCL from 4 KiB to 1 MiB and lost to both at 4 MiB (docs/performance.md,
/// "Small messages: the LL protocol"), and the all-gather beat them to 2 MiB (measured at
/// `7fd0771`; no result file kept). The one-shot
/// all-reduce sends its whole message to each of the P − 1 peers, the reduce-scatter each
/// peer's chunk, the all-gather its own chunk; beyond two GPUs the crossover is a prediction,
/// not a measurement.
pub const LL_AUTO_MAX_SENT_BYTES: usize = 1 << 20;

/// Whether `auto` takes the LL protocol for `spec` with elements of `elem_bytes` bytes.
pub fn prefers_ll(spec: &OpSpec, elem_bytes: usize) -> bool {
    use crate::op::OpKind;
    let peers = spec.world.saturating_sub(1);
    let sent = match spec.kind {
        OpKind::AllReduce => peers * spec.count,
        OpKind::ReduceScatter | OpKind::AllGather => peers * spec.count.div_ceil(spec.world.max(1)),
        _ => return false,
    } * elem_bytes;
    peers > 0 && spec.count > 0 && sent <= LL_AUTO_MAX_SENT_BYTES
}

/// The largest message (bytes of the all-reduce's tensor, the reduce-scatter's and all-to-all's
/// input, the all-gather's output) for which a library that has NCCL beside commfuse should run
/// commfuse's plan on buffers of the caller's own. The plans read and write commfuse's
/// symmetric buffers (peers load from and store into them), so a call on the caller's memory
/// copies its input in and its output out, and past a few MiB those copies cost more than the
/// plans gain over NCCL. Through `commfuse.torch` on 2 × H200 (bf16, eager): the one-shot
/// all-reduce took 1.16–1.33× NCCL's speed at 4 MiB but 0.87–0.94× from 16 MiB
/// (CHANGELOG.md, "commfuse.torch routes collectives by size"); once device waits stopped
/// stalling the GPU's front end the reduce-scatter and all-gather plans took 1.09× and 1.06×
/// at 4 MiB and 0.92× and 1.00× at 16 MiB (docs/results/torch/collectives-2xH200-4K-16M.txt;
/// earlier measurements at 4 MiB, 0.94–1.25×, had stalled rounds).
pub const USER_BUFFER_MAX_BYTES: usize = 4 << 20;

/// Whether commfuse's collective `spec` (elements of `elem_bytes` bytes) on a caller's own
/// buffers is expected to beat NCCL's on them: where the LL protocol takes it (it copies
/// nothing), and an all-reduce, reduce-scatter, all-gather or all-to-all up to
/// [`USER_BUFFER_MAX_BYTES`] (counted as [`USER_BUFFER_MAX_BYTES`] says).
pub fn prefers_commfuse_on_user_buffers(spec: &OpSpec, elem_bytes: usize) -> bool {
    use crate::op::OpKind;
    let copied = matches!(
        spec.kind,
        OpKind::AllReduce | OpKind::AllToAll | OpKind::ReduceScatter | OpKind::AllGather
    );
    prefers_ll(spec, elem_bytes)
        || copied && spec.count * elem_bytes <= USER_BUFFER_MAX_BYTES
        || matches!(spec.kind, OpKind::Barrier | OpKind::Broadcast)
}

/// Picks, among `spec`'s algorithms, the one whose checked plan the latency–bandwidth model of
/// `topology` predicts fastest for elements of `elem_bytes` bytes. Ties go to the algorithm
/// listed first by [`Algo::for_op`] (the op's default). Fails only when no algorithm can be
/// built for `spec` on `topology`, with the first algorithm's reason.
pub fn choose_algo(
    spec: OpSpec,
    topology: &Topology,
    elem_bytes: usize,
) -> Result<AlgoChoice, Error> {
    let mut best: Option<(Algo, CheckedPlan, f64)> = None;
    let mut candidates = Vec::new();
    for &algo in Algo::for_op(spec.kind) {
        let planned = build_plan(spec, algo, topology).and_then(|p| Ok(check(p)?));
        let predicted = planned.map(|plan| {
            let us = plan.timing(topology, elem_bytes).total_us();
            if best.as_ref().is_none_or(|(_, _, b)| us < *b) {
                best = Some((algo, plan, us));
            }
            us
        });
        candidates.push((algo, predicted));
    }
    match best {
        Some((algo, plan, predicted_us)) => Ok(AlgoChoice {
            algo,
            plan,
            predicted_us,
            candidates,
        }),
        None => Err(candidates
            .into_iter()
            .find_map(|(_, r)| r.err())
            .expect("every op has at least one algorithm")),
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    use crate::op::OpKind;

    fn spec(kind: OpKind, world: usize, count: usize) -> OpSpec {
        OpSpec::new(kind, world, count, 0).unwrap()
    }

    #[test]
    fn auto_takes_ll_for_small_messages_only() {
        assert!(prefers_ll(&spec(OpKind::AllReduce, 2, 2048), 2));
        assert!(prefers_ll(&spec(OpKind::AllReduce, 2, 1 << 19), 2)); // 1 MiB
        assert!(!prefers_ll(&spec(OpKind::AllReduce, 2, (1 << 19) + 1), 2));
        // four ranks send three copies: the crossover a third as large
        assert!(!prefers_ll(&spec(OpKind::AllReduce, 4, 1 << 18), 2));
        assert!(prefers_ll(&spec(OpKind::AllReduce, 4, 1 << 17), 2));
        assert!(!prefers_ll(&spec(OpKind::AllReduce, 1, 16), 4));
        // a reduce-scatter sends each peer its chunk only
        assert!(prefers_ll(&spec(OpKind::ReduceScatter, 2, 1 << 20), 2));
        assert!(!prefers_ll(
            &spec(OpKind::ReduceScatter, 2, (1 << 20) + 2),
            2
        ));
        assert!(prefers_ll(&spec(OpKind::AllGather, 2, 2048), 2));
        assert!(!prefers_ll(&spec(OpKind::AllGather, 2, (1 << 20) + 2), 2));
        assert!(!prefers_ll(&spec(OpKind::AllToAll, 2, 2048), 2));
    }

    #[test]
    fn on_user_buffers_commfuse_takes_what_copies_nothing_and_messages_up_to_4_mib() {
        let on_user =
            |kind, world, count| prefers_commfuse_on_user_buffers(&spec(kind, world, count), 2);
        // the LL protocol's sizes, every op it runs
        for kind in [OpKind::AllReduce, OpKind::ReduceScatter, OpKind::AllGather] {
            assert!(on_user(kind, 2, 1 << 10));
        }
        // past them, every op up to 4 MiB of its largest tensor; past that NCCL
        for kind in [
            OpKind::AllReduce,
            OpKind::ReduceScatter,
            OpKind::AllGather,
            OpKind::AllToAll,
        ] {
            assert!(on_user(kind, 2, 2 << 20), "{kind:?}");
            assert!(!on_user(kind, 2, (2 << 20) + 2), "{kind:?}");
        }
        assert!(on_user(OpKind::AllToAll, 2, 1 << 20));
    }

    /// The choice is the candidate with the least predicted time, and it changes with size:
    /// latency-bound small messages and bandwidth-bound large ones want different plans.
    #[test]
    fn choice_is_the_fastest_predicted_and_depends_on_size() {
        let topology = Topology::new(8, 1).unwrap();
        let mut picks = Vec::new();
        for count in [256, 64 << 20] {
            let spec = OpSpec::new(OpKind::AllReduce, 8, count, 0).unwrap();
            let choice = choose_algo(spec, &topology, 2).unwrap();
            let fastest = choice
                .candidates
                .iter()
                .filter_map(|(_, t)| t.as_ref().ok().copied())
                .fold(f64::INFINITY, f64::min);
            assert_eq!(choice.predicted_us, fastest);
            assert_eq!(choice.plan.plan().algo, choice.algo.name());
            assert_eq!(
                choice.candidates.len(),
                Algo::for_op(OpKind::AllReduce).len()
            );
            picks.push(choice.algo);
        }
        assert_ne!(picks[0], picks[1], "{picks:?}");
    }

    /// Algorithms that cannot be built here are skipped, not fatal.
    #[test]
    fn unbuildable_candidates_are_skipped() {
        // ring-2d needs the world size to be a multiple of the group count
        let topology = Topology::new(5, 2).unwrap();
        let spec = OpSpec::new(OpKind::AllReduce, 5, 1000, 0).unwrap();
        let choice = choose_algo(spec, &topology, 4).unwrap();
        let ring_2d = choice
            .candidates
            .iter()
            .find(|(a, _)| *a == Algo::Ring2d)
            .unwrap();
        assert!(ring_2d.1.is_err());
        assert_ne!(choice.algo, Algo::Ring2d);
    }
}
