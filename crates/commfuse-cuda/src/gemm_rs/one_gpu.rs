//! The fused GEMM + reduce-scatter's kernel of one rank, alone on one GPU (`bench gemm
//! --rs-ranks`): rank 0 of P with the operator's own schedule, routes and fold, every other
//! rank's receive buffer and flag row a local stand-in. The tiles of the peers' rows go into
//! those stand-ins with their flags, as they would over NVLink; rank 0's own tiles, computed
//! last, fold the P − 1 partials already in its receive buffer, whose flags are up. So the row
//! costs, beside the same build's plain GEMM, what the fused kernel adds on its own GPU: the
//! routed stores, the flags and the fold, with no link and no peer to wait for.
//!
//! Flags up before the call is the operator's steady state, not only its cheapest case: every
//! rank computes its own rows last and the others' first (rank q computes owner r's tiles in
//! its ((r − q − 1) mod P)-th place of P), so at equal speed each partial is finished at least a
//! chunk's worth of tiles before its owner folds it.
//!
//! The same rank runs the ring inside one GEMM too ([`RankSchedule::Ring`],
//! [`super::fused_ring`]): step by step, each tile of steps 1 .. P − 1 folding the one running
//! sum its sender handed on (in rank 0's receive buffers, flags up), each tile of steps
//! 0 .. P − 2 stored into its receiver's stand-in buffer of its step with its flag. With flags
//! up this is the ring's steady state, where each hop's running sum is ready a chunk of tiles
//! before it is needed; where a chunk is shorter than a wave of tiles, the ring's hops wait
//! for each other on real peers, which one GPU does not show.

use super::fused_ring::{ring_fold_source, ring_order, ring_tile_routes};
use super::{fold_source, tile_routes, GemmRsPeer, RingPeer, NCCL_ID_BYTES};
use crate::error::CudaError;
use crate::gemm::bench::upload_output;
use crate::gemm::{GemmKernels, GemmOperands, PreparedGemm, VariantChoice, TILE, WIDE_TILE};
use crate::sys::driver::{DeviceMemory, Gpu};
use commfuse_core::fused::fused_ring::FusedRing;
use commfuse_core::fused::gemm_rs::{GemmRsSchedule, GemmRsShape};
use commfuse_core::fused::ring_rs::{RingSchedule, RingTarget};
use commfuse_core::gemm::{Epilogue, GemmPlan, GemmProblem};
use commfuse_core::reference::input_value;
use commfuse_core::{Element, ReduceOp};

/// How the rank's GEMM sums the partials of the output's rows (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RankSchedule {
    /// The fused path's: the peers' rows first, each tile into its owner's slot; its own rows
    /// last, each folding the P − 1 partials
    Fold,
    /// The ring inside one GEMM: one owner's rows a step, each tile folding the running sum
    /// of the step before and handing it on
    Ring,
}

/// Rank 0's fused GEMM + reduce-scatter kernel of P ranks on one GPU (see the module doc).
pub struct OneGpuRank {
    name: String,
    gemm: PreparedGemm,
    /// Runs its build's general entry where another would serve it
    general_entry: bool,
    /// The tile grid (and, without `ring`, the schedule)
    schedule: GemmRsSchedule,
    /// The ring's schedule, where the rank runs it ([`RankSchedule::Ring`])
    ring: Option<FusedRing>,
    /// Rank 0's output chunk ([chunk rows, N])
    out: DeviceMemory,
    /// Every rank's receive buffer (both sets' P slots, or the ring's P − 1 buffers); rank 0's
    /// holds the partials it folds
    receive: Vec<DeviceMemory>,
    /// Every rank's flag rows; rank 0's all up
    flags: Vec<DeviceMemory>,
    /// Rank 0's receive buffer as uploaded (rounded to the output type), widened
    partials: Vec<f64>,
    /// The bias row its own tiles add (as uploaded), if any
    bias: Option<Vec<f64>>,
}

impl OneGpuRank {
    /// Rank 0 of `world` computing `problem` (all M rows of its partial product) from the A
    /// and B at `a` and `b`, on at most `cap` SMs (0: all). The partials it folds are drawn
    /// from `seed`, in ±[1, 2), so that one skipped or added twice fails every element it
    /// touches. With `bias` (the row's address and its values as uploaded), its own tiles add
    /// the bias and the tiles it sends do not, as in the operator. `kind`: the fused path's
    /// schedule or the ring's.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        gpu: &Gpu,
        kernels: &GemmKernels,
        problem: &GemmProblem,
        (a, b): (u64, u64),
        (world, cap): (usize, u32),
        kind: RankSchedule,
        seed: u64,
        bias: Option<(u64, &[f64])>,
    ) -> Result<OneGpuRank, CudaError> {
        let p = problem;
        if world < 2 || world > p.m {
            return Err(CudaError::Unavailable(format!(
                "a one-GPU rank of GEMM + reduce-scatter needs 2 to M = {} ranks, got {world}",
                p.m
            )));
        }
        let shape = GemmRsShape::new(world, p.m, p.n, p.k, p.b_layout, p.input, p.output)
            .map_err(|e| CudaError::Unavailable(e.to_string()))?;
        // the wide ping-pong build's tiles where it is named, else the operator's
        let tile = match kernels.choice() {
            VariantChoice::PingPongWide => WIDE_TILE,
            _ => TILE,
        };
        let schedule = GemmRsSchedule::new(shape, tile);
        let ring = (kind == RankSchedule::Ring)
            .then(|| FusedRing::new(RingSchedule::within(shape, p.m, 1), tile));
        let eb = p.output.size();
        let (slots, flag_bytes) = match &ring {
            Some(r) => (r.ring.receive_len(), r.flag_words() * 8),
            None => (
                2 * world * schedule.slot_len,
                2 * schedule.flag_columns() * 8,
            ),
        };
        let values: Vec<f64> = (0..slots)
            .map(|j| {
                let u = input_value(seed, 20, j, ReduceOp::Sum) as f64;
                u.signum() * (1.0 + u.abs())
            })
            .collect();
        let (mine, partials) = upload_output(gpu, p.output, &values)?;
        let mut receive = vec![mine];
        for _ in 1..world {
            receive.push(DeviceMemory::zeroed(gpu, slots * eb)?);
        }
        let flags = (0..world)
            .map(|_| DeviceMemory::zeroed(gpu, flag_bytes))
            .collect::<Result<Vec<_>, _>>()?;
        // rank 0's flags up for any call (a flag holds at least the call's number)
        flags[0].fill(gpu, 0xff)?;
        let peers: Vec<GemmRsPeer> = receive
            .iter()
            .zip(&flags)
            .map(|(r, f)| GemmRsPeer {
                receive: r.addr(),
                flags: f.addr(),
                ring: RingPeer::default(),
                nccl_id: [0; NCCL_ID_BYTES],
            })
            .collect();
        let out = DeviceMemory::zeroed(gpu, shape.chunk(0).len() * p.n * eb)?;
        let ops = GemmOperands {
            bias: bias.map(|(addr, _)| addr),
            ..GemmOperands::plain(a, b, out.addr())
        };
        // call 1: set 0's routes, order and bands, as the operator prepares them
        let mut plan = schedule.gemm_plan(0, 1);
        plan.epilogue.bias = bias.is_some();
        let (routes, folds, name) = match &ring {
            None => (
                tile_routes(&schedule, 0, 0, &peers, true),
                fold_source(peers[0].receive, &schedule),
                format!("commfuse-rs{world}"),
            ),
            Some(r) => {
                // the ring's routes carry the destinations and flags; set 0 for call 1, as the
                // fused path numbers its sets (`GemmRsSchedule::set_of`), in every table of
                // this rank (the ring of library GEMMs numbers its own the other way round)
                plan.order = ring_order(&schedule, r, 0);
                (plan.destinations, plan.flags) = (None, None);
                (
                    ring_tile_routes(&schedule, r, 0, 0, &peers),
                    ring_fold_source(peers[0].receive, r),
                    format!("commfuse-ring{world}"),
                )
            }
        };
        let gemm = PreparedGemm::with_routes(
            gpu,
            kernels,
            &plan,
            &ops,
            routes,
            Some(folds),
            world,
            cap,
            0,
        )?;
        Ok(OneGpuRank {
            name,
            general_entry: false,
            gemm,
            schedule,
            ring,
            out,
            receive,
            flags,
            partials,
            bias: bias.map(|(_, values)| values.to_vec()),
        })
    }

    /// Its blocks load the units of their second, fourth, ... wave from the last k-block to
    /// the first ([`PreparedGemm::set_k_serpentine`]); the row's name takes `-serpentine`.
    pub fn set_k_serpentine(&mut self) {
        self.gemm.set_k_serpentine(1);
        self.name.push_str("-serpentine");
    }

    /// Its name takes the build its routes run on (`commfuse-rs<P>-direct`): the bench's rows
    /// of one rank on builds other than `auto`'s.
    pub fn name_build(&mut self) {
        self.name.push('-');
        self.name.push_str(self.gemm.variant().name());
    }

    /// It runs its build's general entry where a routed one would serve it
    /// ([`PreparedGemm::use_general_entry`]); the row's name takes `-general`.
    pub fn use_general_entry(&mut self) {
        self.gemm.use_general_entry();
        self.general_entry = true;
        self.name.push_str("-general");
    }

    /// Its producer asks L2 for each folding tile's partials `k_blocks` k-blocks before the end
    /// of the tile's main loop ([`PreparedGemm::set_fold_prefetch`]); the row's name takes
    /// `-prefetch<k_blocks>`.
    pub fn set_fold_prefetch(&mut self, k_blocks: u32) {
        self.gemm.set_fold_prefetch(k_blocks);
        self.name.push_str(&format!("-prefetch{k_blocks}"));
    }

    /// Whether [`OneGpuRank::use_general_entry`] turned the other entries off.
    pub fn general_entry(&self) -> bool {
        self.general_entry
    }

    /// The bench row's name: `commfuse-rs<P>` (`commfuse-ring<P>` on the ring), the build where
    /// [`OneGpuRank::name_build`] named it, `-general` where it runs its general entry, and
    /// `-serpentine` after it where it is on.
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn gemm(&self) -> &PreparedGemm {
        &self.gemm
    }

    /// The rank's GEMM as a plain one: its tile order and row bands, every tile into the local
    /// output (no routes, flags or fold): what its order costs beside the plain GEMM's.
    pub fn order_plan(&self) -> GemmPlan {
        let s = &self.schedule;
        let epilogue = Epilogue {
            bias: self.bias.is_some(),
            ..Epilogue::default()
        };
        GemmPlan {
            order: match &self.ring {
                Some(r) => ring_order(s, r, 0),
                None => s.order(0),
            },
            bands: Some(s.bands.clone()),
            ..GemmPlan::local(s.shape.problem(), s.tile, epilogue)
        }
    }

    /// Poisons the outputs the bench checks: the output chunk and the peers' receive buffers,
    /// and clears the peers' flag rows ([`OneGpuRank::check_flags`]).
    pub fn poison(&self, gpu: &Gpu) -> Result<(), CudaError> {
        self.out.fill(gpu, 0xff)?;
        self.receive[1..]
            .iter()
            .try_for_each(|r| r.fill(gpu, 0xff))?;
        self.flags[1..].iter().try_for_each(|f| f.fill(gpu, 0))
    }

    /// After one call on poisoned buffers (the rank's GEMM runs as call 1): every flag word of
    /// the peers' stand-in rows holds what the schedule says rank 0 raises there in call 1
    /// ([`GemmRsSchedule::flag`]: the call's number, at the set's row and the tile's column;
    /// on the ring, [`FusedRing::flag_index`] of set 0 in its receiver's words) and 0
    /// everywhere else; an error names the first word that does not and counts them.
    pub fn check_flags(&self, gpu: &Gpu) -> Result<(), CudaError> {
        let s = &self.schedule;
        let columns = s.flag_columns();
        let want = match &self.ring {
            None => {
                let mut want = vec![vec![0u64; 2 * columns]; s.shape.world];
                for t in s.order(0) {
                    let (owner, _) = s.placement[t];
                    if owner != 0 {
                        let flag = s.flag(0, t, 1);
                        want[owner][flag.slot.row as usize * columns + flag.slot.col as usize] =
                            flag.value;
                    }
                }
                want
            }
            Some(r) => {
                // the flag of each tile it hands on, in its receiver's words of set 0
                let mut want = vec![vec![0u64; r.flag_words()]; s.shape.world];
                for t in r.tiles_of(0) {
                    if let RingTarget::Send { step } = t.target {
                        want[r.ring.receiver(0, step)][r.flag_index(0, step, t.index)] = 1;
                    }
                }
                want
            }
        };
        let mut wrong = Vec::new();
        for (owner, want) in want.iter().enumerate().skip(1) {
            let mut got = vec![0u64; want.len()];
            self.flags[owner].download(gpu, &mut got)?;
            wrong.extend(
                (0..got.len())
                    .filter(|&i| got[i] != want[i])
                    .map(|i| (owner, i, got[i], want[i])),
            );
        }
        match wrong.first() {
            None => Ok(()),
            Some(&(owner, word, got, want)) => Err(CudaError::Unavailable(format!(
                "{}: {} flag words of the peers' stand-ins not as one call leaves them; the \
                 first: rank {owner}'s word {word} holds {got}, expected {want}",
                self.name,
                wrong.len()
            ))),
        }
    }

    /// The call's [M, N] product as the ranks received it: rank 0's chunk from its output, each
    /// other chunk from the slot rank 0 sent it to in its owner's receive buffer (on the ring,
    /// from its receiver's buffer of the step that computed it).
    pub fn assemble<T: Element>(&self, gpu: &Gpu) -> Result<Vec<T>, CudaError> {
        let s = &self.schedule;
        let (world, n) = (s.shape.world, s.shape.n);
        let mut d = vec![T::from_f32(0.0); s.shape.m * n];
        let own = s.shape.chunk(0);
        self.out.download(gpu, &mut d[own.start * n..own.end * n])?;
        if let Some(r) = &self.ring {
            // each step's chunk from its receiver's buffer of that step (set 0)
            for step in 0..world - 1 {
                let rows = s.shape.chunk(r.ring.owner_at(0, step));
                let at = r.ring.receive_offset(0, step) * std::mem::size_of::<T>();
                let to = &self.receive[r.ring.receiver(0, step)];
                to.download_at(gpu, at, &mut d[rows.start * n..rows.end * n])?;
            }
            return Ok(d);
        }
        for owner in 1..world {
            // set 0's slot of rank 0's tiles in the owner's receive buffer
            let rows = s.shape.chunk(owner);
            let at = s.slot_of(0, owner) * s.slot_len * std::mem::size_of::<T>();
            self.receive[owner].download_at(gpu, at, &mut d[rows.start * n..rows.end * n])?;
        }
        Ok(d)
    }

    /// What the fold adds to element `index` of the product: on rank 0's rows the peers'
    /// partials (set 0's slots of its receive buffer) and the bias, elsewhere nothing (on the
    /// ring: the running sum of the step before the one that computed the row, and the bias on
    /// rank 0's rows); and the sum of their magnitudes.
    pub fn added(&self, index: usize) -> (f64, f64) {
        let s = &self.schedule;
        let n = s.shape.n;
        let own = s.shape.chunk(0);
        let row = index / n;
        if let Some(r) = &self.ring {
            // the running sum of the step before the one that computes the row (set 0), and on
            // its own rows (the last step) the bias
            let world = s.shape.world;
            let (step, rows) = (0..world)
                .map(|step| (step, s.shape.chunk(r.ring.owner_at(0, step))))
                .find(|(_, rows)| rows.contains(&row))
                .expect("every row has an owner");
            let within = (row - rows.start) * n + index % n;
            let sum = step.checked_sub(1).map_or(0.0, |prev| {
                self.partials[r.ring.receive_offset(0, prev) + within]
            });
            let bias = match &self.bias {
                Some(b) if step + 1 == world => b[index % n],
                _ => 0.0,
            };
            return (sum + bias, sum.abs() + bias.abs());
        }
        if !own.contains(&row) {
            return (0.0, 0.0);
        }
        let within = (row - own.start) * n + index % n;
        let bias = self.bias.as_ref().map_or(0.0, |b| b[index % n]);
        (1..s.shape.world)
            .map(|q| self.partials[s.slot_of(q, 0) * s.slot_len + within])
            .fold((bias, bias.abs()), |(sum, abs), v| (sum + v, abs + v.abs()))
    }
}
