//! The low-latency (LL) collectives on the simulator: the protocols of
//! [`crate::protocol::ll_one_shot_all_reduce`] and [`crate::ll_chunks`] (data and the call's
//! sequence number in one 64-bit line, so a receiver needs one trip and no separate signal) as
//! an operator object, one call per rank thread, its lines in the world's memory (a group's
//! shared arena for a shared world). The reference for the GPU's LL kernel (`commfuse-cuda`'s
//! `src/collective/ll.cu`): all-reduce, reduce-scatter and all-gather of f32, sums in rank
//! order, so every rank's result is the same bits.

use crate::ll_chunks::{ll_all_gather, ll_reduce_scatter, LlChunks};
use crate::memory::Footprint;
use crate::protocol::{ll_one_shot_all_reduce, ll_two_shot_all_reduce, ll_two_shot_lines, LlLines};
use crate::signal::SignalPad;
use crate::world::{RankContext, World};
use commfuse_core::backend::{
    check_queued_inputs, BackendError, CallTiming, HostBuffer, HostSlice, HostSliceMut,
    PreparedCall,
};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

fn unavailable(msg: String) -> BackendError {
    BackendError::Unavailable(msg)
}

/// Which LL all-reduce: one trip (every rank sends everything to everyone) or two (a
/// reduce-scatter then an all-gather, each rank sending 2·len lines).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LlShots {
    One,
    Two,
}

/// Which collective an LL operator runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LlCollective {
    /// Every rank gets the sum of all `len` elements, in one trip or two.
    AllReduce(LlShots),
    /// Rank r gets its chunk of the sum (`commfuse_core::op::chunk_range`), as the GPU kernel's
    /// reduce-scatter.
    ReduceScatter,
    /// Rank r's chunk goes to every rank, as the GPU kernel's all-gather.
    AllGather,
}

impl LlCollective {
    fn name(self) -> &'static str {
        match self {
            LlCollective::AllReduce(_) => "all-reduce",
            LlCollective::ReduceScatter => "reduce-scatter",
            LlCollective::AllGather => "all-gather",
        }
    }
}

/// An LL collective of `len` f32 elements (sums) for every rank of a world.
pub struct SimLl {
    len: usize,
    collective: LlCollective,
    /// Per rank: the protocol's lines (one-shot: 2 parities × P senders × `len`; two-shot:
    /// `ll_two_shot_lines`; reduce-scatter and all-gather: `LlChunks::buffer_lines`)
    lines: Vec<SignalPad>,
    /// Per rank, calls it has made (only that rank's thread touches it)
    calls: Vec<AtomicU64>,
    broken: AtomicBool,
    world_id: usize,
}

struct Lines<'a>(&'a [SignalPad]);

impl LlLines for Lines<'_> {
    type Word = AtomicU64;
    fn line(&self, rank: usize, index: usize) -> &AtomicU64 {
        let pad = &self.0[rank];
        let cols = pad.cols() as usize;
        pad.slot((index / cols) as u32, (index % cols) as u32)
            .expect("inside the rank's lines")
    }
}

impl SimLl {
    /// The largest collective this protocol takes, in elements: it is for small messages (each
    /// element costs a line per sender in every rank's buffer).
    pub const MAX_LEN: usize = 1 << 20;

    /// The LL `collective` of `len` elements (an all-reduce's, or the whole vector a
    /// reduce-scatter splits and an all-gather gathers) on `world`.
    pub fn new(world: &World, collective: LlCollective, len: usize) -> Result<Self, BackendError> {
        if len > Self::MAX_LEN {
            return Err(unavailable(format!(
                "the LL {} takes up to {} elements, got {len}",
                collective.name(),
                Self::MAX_LEN
            )));
        }
        let p = world.size();
        Self::memory(p, collective, len).check_on(world.arena().is_some())?;
        let words = Self::lines(p, collective, len);
        let cols = 1024u32;
        let rows = words.div_ceil(cols as usize) as u32;
        let lines = (0..p)
            .map(|_| SignalPad::new_in(world.arena().map(|a| &**a), rows, cols))
            .collect::<Result<_, _>>()?;
        Ok(SimLl {
            len,
            collective,
            lines,
            calls: (0..p).map(|_| AtomicU64::new(0)).collect(),
            broken: AtomicBool::new(false),
            world_id: world as *const World as usize,
        })
    }

    /// Lines of one rank's buffer (at least one).
    fn lines(world: usize, collective: LlCollective, len: usize) -> usize {
        match collective {
            LlCollective::AllReduce(LlShots::One) => 2 * world * len,
            LlCollective::AllReduce(LlShots::Two) => ll_two_shot_lines(world, len),
            _ => LlChunks::new(world, len).buffer_lines(),
        }
        .max(1)
    }

    /// What the LL `collective` of `len` elements on `world` ranks allocates: every rank's
    /// lines, rounded up to whole rows of its pad (see [`SimLl::new`]).
    pub fn memory(world: usize, collective: LlCollective, len: usize) -> Footprint {
        let rows = Self::lines(world, collective, len.min(Self::MAX_LEN)).div_ceil(1024);
        let what = format!(
            "the LL {} of {len} elements on {world} ranks",
            collective.name()
        );
        Footprint::new(what).item(&[world, rows, 1024, 8])
    }

    /// This rank's input and output lengths: `len` each for an all-reduce, `len` in and the
    /// rank's chunk out for a reduce-scatter, the reverse for an all-gather.
    pub fn lens(&self, rank: usize, world: usize) -> (usize, usize) {
        let chunk = LlChunks::new(world, self.len).chunk(rank).len();
        match self.collective {
            LlCollective::AllReduce(_) => (self.len, self.len),
            LlCollective::ReduceScatter => (self.len, chunk),
            LlCollective::AllGather => (chunk, self.len),
        }
    }

    /// One call on rank `ctx.rank()`, `input` into `output` (of [`SimLl::lens`]). Every rank
    /// makes the same calls in order.
    pub fn forward(
        &self,
        ctx: &RankContext<'_>,
        input: &[f32],
        output: &mut [f32],
    ) -> Result<(), BackendError> {
        let (rank, p, name) = (ctx.rank(), ctx.world_size(), self.collective.name());
        if ctx.world() as *const World as usize != self.world_id {
            return Err(unavailable(format!(
                "this LL {name} was built for another world"
            )));
        }
        if self.broken.load(Ordering::Acquire) {
            return Err(unavailable(format!(
                "this LL {name} failed earlier; its peers' state is unknown"
            )));
        }
        let (want_in, want_out) = self.lens(rank, p);
        if input.len() != want_in || output.len() != want_out {
            return Err(unavailable(format!(
                "rank {rank}: the LL {name} of {} elements takes {want_in} input and {want_out} output elements, got {} and {}",
                self.len,
                input.len(),
                output.len()
            )));
        }
        let call = self.calls[rank].load(Ordering::Relaxed) + 1;
        let seq =
            u32::try_from(call).map_err(|_| unavailable("2^32 calls: build a new one".into()))?;
        let mut backoff = ctx.backoff();
        let lines = Lines(&self.lines);
        let chunks = LlChunks::new(p, self.len);
        let result = match self.collective {
            LlCollective::AllReduce(LlShots::One) => {
                ll_one_shot_all_reduce(&lines, (p, rank, seq), input, output, &mut backoff)
            }
            LlCollective::AllReduce(LlShots::Two) => {
                ll_two_shot_all_reduce(&lines, (p, rank, seq), input, output, &mut backoff)
            }
            LlCollective::ReduceScatter => {
                ll_reduce_scatter(&lines, chunks, (rank, seq), input, output, &mut backoff)
            }
            LlCollective::AllGather => {
                ll_all_gather(&lines, chunks, (rank, seq), input, output, &mut backoff)
            }
        };
        match result {
            Ok(()) => {
                self.calls[rank].store(call, Ordering::Relaxed);
                Ok(())
            }
            Err(s) => {
                self.broken.store(true, Ordering::Release);
                Err(ctx.wait_ended(s.stop, s.sender, |timeout_ms| {
                    unavailable(format!(
                        "timeout after {timeout_ms} ms: LL {} rank {rank} waits for rank {}'s line {} to carry call {}, sees call {} (line {:#018x})",
                        match self.collective {
                            LlCollective::AllReduce(shots) => format!("{name} ({shots:?} shot)"),
                            _ => name.to_string(),
                        },
                        s.sender,
                        s.line,
                        s.seq,
                        s.seen >> 32,
                        s.seen
                    ))
                }))
            }
        }
    }
}

/// One rank's outputs of a batch of calls, in call order, and the batch's time on that rank.
type RankCalls = (Vec<Vec<f32>>, Duration);

/// The LL collectives as one of the sim backend's protocols
/// ([`commfuse_core::backend::Backend::protocols`]): the same checks and benches as the plans
/// (and as the GPU kernel's, `commfuse_cuda::collective::ll`), on host buffers. The simulator's
/// twin computes f32 only: sums (all-reduce one-shot, reduce-scatter) and all-gathers.
pub(crate) struct SimLlCall<'a> {
    world: &'a World,
    op: SimLl,
    /// Per rank, as long as the longest rank's (rank 0's: its chunk is the longest); rank r's
    /// own are the first `op.lens(r, P)`
    inputs: Vec<Vec<f32>>,
    outputs: Vec<Vec<f32>>,
}

impl<'a> SimLlCall<'a> {
    /// What [`SimLlCall::new`] of `spec` on `world` ranks allocates: the protocol's lines and
    /// every rank's f32 input and output (none where the protocol does not serve `spec`).
    pub(crate) fn memory(
        world: usize,
        spec: &commfuse_core::OpSpec,
        dtype: commfuse_core::DType,
    ) -> Footprint {
        use commfuse_core::{DType, OpKind};
        let collective = match spec.kind {
            OpKind::AllReduce => LlCollective::AllReduce(LlShots::One),
            OpKind::ReduceScatter => LlCollective::ReduceScatter,
            OpKind::AllGather => LlCollective::AllGather,
            _ => return Footprint::new("the LL protocol"),
        };
        if dtype != DType::F32 || spec.count > SimLl::MAX_LEN {
            return Footprint::new("the LL protocol");
        }
        SimLl::memory(world, collective, spec.count).item(&[world, 2, spec.count, 4])
    }

    /// The LL collective of `spec` on `world`, for f32 (sums where it reduces).
    pub(crate) fn new(
        world: &'a World,
        spec: &commfuse_core::OpSpec,
        dtype: commfuse_core::DType,
        reduce: commfuse_core::ReduceOp,
    ) -> Result<Self, BackendError> {
        use commfuse_core::{DType, OpKind, ReduceOp};
        let collective = match spec.kind {
            OpKind::AllReduce => Some(LlCollective::AllReduce(LlShots::One)),
            OpKind::ReduceScatter => Some(LlCollective::ReduceScatter),
            OpKind::AllGather => Some(LlCollective::AllGather),
            _ => None,
        };
        let reduces = spec.kind != OpKind::AllGather;
        let collective = match collective {
            Some(c) if dtype == DType::F32 && (reduce == ReduceOp::Sum || !reduces) => c,
            _ => {
                return Err(unavailable(format!(
                    "the simulator's LL protocol computes f32 sums (all-reduce, reduce-scatter) and f32 all-gathers, not a {dtype} {reduce} {}",
                    spec.kind
                )))
            }
        };
        let p = world.size();
        Self::memory(p, spec, dtype).check()?;
        let op = SimLl::new(world, collective, spec.count)?;
        let (input, output) = op.lens(0, p);
        Ok(SimLlCall {
            world,
            op,
            inputs: vec![vec![0.0; input]; p],
            outputs: vec![vec![0.0; output]; p],
        })
    }

    /// Every rank's calls on `inputs[c]`, queued on its own thread without waiting for the
    /// others in between; each rank's outputs in call order (as long as `outputs`' buffers, the
    /// rank's own elements first), and its time.
    fn calls(&self, inputs: &[&[Vec<f32>]]) -> Result<Vec<RankCalls>, BackendError> {
        let len = self.outputs[0].len();
        let gate = std::sync::Barrier::new(self.world.size());
        self.world.run(|ctx| {
            let r = ctx.rank();
            let (input, output) = self.op.lens(r, ctx.world_size());
            gate.wait();
            let start = Instant::now();
            let mut outs = Vec::with_capacity(inputs.len());
            for call in inputs {
                let mut out = vec![f32::NAN; len];
                self.op
                    .forward(ctx, &call[r][..input], &mut out[..output])?;
                outs.push(out);
            }
            Ok((outs, start.elapsed()))
        })
    }
}

impl PreparedCall for SimLlCall<'_> {
    fn input_mut(&mut self, rank: usize) -> HostSliceMut<'_> {
        HostSliceMut::F32(&mut self.inputs[rank])
    }

    fn output_mut(&mut self, rank: usize) -> HostSliceMut<'_> {
        HostSliceMut::F32(&mut self.outputs[rank])
    }

    fn upload(&mut self) -> Result<(), BackendError> {
        Ok(())
    }

    fn run(&mut self) -> Result<CallTiming, BackendError> {
        let result = self.calls(&[&self.inputs])?;
        let mut per_rank = Vec::new();
        for (r, (mut outs, time)) in result.into_iter().enumerate() {
            self.outputs[r] = outs.pop().expect("one call");
            per_rank.push(time);
        }
        Ok(CallTiming { per_rank })
    }

    fn run_queued(
        &mut self,
        inputs: &[Vec<HostBuffer>],
    ) -> Result<Vec<Vec<HostBuffer>>, BackendError> {
        let p = self.world.size();
        check_queued_inputs(inputs, p, commfuse_core::DType::F32, self.inputs[0].len())?;
        let calls: Vec<Vec<Vec<f32>>> = inputs
            .iter()
            .map(|per_rank| {
                per_rank
                    .iter()
                    .map(|b| match b {
                        HostBuffer::F32(v) => v.clone(),
                        _ => unreachable!("checked f32"),
                    })
                    .collect()
            })
            .collect();
        let views: Vec<&[Vec<f32>]> = calls.iter().map(Vec::as_slice).collect();
        let per_rank = self.calls(&views)?;
        Ok((0..calls.len())
            .map(|c| {
                per_rank
                    .iter()
                    .map(|(outs, _)| HostBuffer::F32(outs[c].clone()))
                    .collect()
            })
            .collect())
    }

    fn download(&mut self) -> Result<(), BackendError> {
        Ok(())
    }

    fn input(&self, rank: usize) -> HostSlice<'_> {
        HostSlice::F32(&self.inputs[rank])
    }

    fn output(&self, rank: usize) -> HostSlice<'_> {
        HostSlice::F32(&self.outputs[rank])
    }
}
