//! The low-latency (LL) all-reduce on the simulator: the protocol of
//! [`crate::protocol::ll_one_shot_all_reduce`] (data and the call's sequence number in one
//! 64-bit line, so a receiver needs one trip and no separate signal) as an operator object,
//! one call per rank thread, its lines in the world's memory (a group's shared arena for a
//! shared world). The reference for the GPU kernel of issue 12; f32 sums in rank order, so every
//! rank's result is the same bits.

use crate::protocol::{
    ll_one_shot_all_reduce, ll_two_shot_all_reduce, ll_two_shot_lines, LlLines, Stop,
};
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

/// An LL all-reduce (sum) of `len` f32 elements for every rank of a world.
pub struct SimLlAllReduce {
    len: usize,
    shots: LlShots,
    /// Per rank: 2 parities × P senders × `len` lines
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

impl SimLlAllReduce {
    /// The largest all-reduce this protocol takes, in elements: it is for small messages (each
    /// element costs a line per sender in every rank's buffer).
    pub const MAX_LEN: usize = 1 << 20;

    pub fn new(world: &World, len: usize, shots: LlShots) -> Result<Self, BackendError> {
        if len > Self::MAX_LEN {
            return Err(unavailable(format!(
                "the LL all-reduce takes up to {} elements, got {len}",
                Self::MAX_LEN
            )));
        }
        let p = world.size();
        let words = match shots {
            LlShots::One => 2 * p * len,
            LlShots::Two => ll_two_shot_lines(p, len),
        }
        .max(1);
        let cols = 1024u32;
        let rows = words.div_ceil(cols as usize) as u32;
        let lines = (0..p)
            .map(|_| SignalPad::new_in(world.arena().map(|a| &**a), rows, cols))
            .collect::<Result<_, _>>()?;
        Ok(SimLlAllReduce {
            len,
            shots,
            lines,
            calls: (0..p).map(|_| AtomicU64::new(0)).collect(),
            broken: AtomicBool::new(false),
            world_id: world as *const World as usize,
        })
    }

    /// One call on rank `ctx.rank()`: every rank's `input` summed into `output` (both `len`
    /// elements). Every rank makes the same calls in order.
    pub fn forward(
        &self,
        ctx: &RankContext<'_>,
        input: &[f32],
        output: &mut [f32],
    ) -> Result<(), BackendError> {
        let rank = ctx.rank();
        if ctx.world() as *const World as usize != self.world_id {
            return Err(unavailable(
                "this LL all-reduce was built for another world".into(),
            ));
        }
        if self.broken.load(Ordering::Acquire) {
            return Err(unavailable(
                "this LL all-reduce failed earlier; its peers' state is unknown".into(),
            ));
        }
        if input.len() != self.len || output.len() != self.len {
            return Err(unavailable(format!(
                "rank {rank}: the LL all-reduce of {} elements got {} input and {} output elements",
                self.len,
                input.len(),
                output.len()
            )));
        }
        let call = self.calls[rank].load(Ordering::Relaxed) + 1;
        let seq =
            u32::try_from(call).map_err(|_| unavailable("2^32 calls: build a new one".into()))?;
        let mut backoff = ctx.backoff();
        let p = ctx.world_size();
        let who = (p, rank, seq);
        let lines = Lines(&self.lines);
        let result = match self.shots {
            LlShots::One => ll_one_shot_all_reduce(&lines, who, input, output, &mut backoff),
            LlShots::Two => ll_two_shot_all_reduce(&lines, who, input, output, &mut backoff),
        };
        match result {
            Ok(()) => {
                self.calls[rank].store(call, Ordering::Relaxed);
                Ok(())
            }
            Err(s) => {
                self.broken.store(true, Ordering::Release);
                Err(match s.stop {
                    Stop::Aborted => BackendError::Aborted { rank },
                    Stop::Timeout => unavailable(format!(
                        "timeout after {} ms: LL all-reduce ({:?} shot) rank {rank} waits for sender {}'s line {} to carry call {}, sees call {} (line {:#018x})",
                        ctx.world().config().timeout.as_millis(),
                        self.shots,
                        s.sender,
                        s.line,
                        s.seq,
                        s.seen >> 32,
                        s.seen
                    )),
                })
            }
        }
    }
}

/// One rank's outputs of a batch of calls, in call order, and the batch's time on that rank.
type RankCalls = (Vec<Vec<f32>>, Duration);

/// The LL all-reduce as one of the sim backend's protocols
/// ([`commfuse_core::backend::Backend::protocols`]): the same checks and benches as the plans
/// (and as the GPU kernel's, `commfuse_cuda::ll`), on host buffers. The simulator's twin sums
/// f32 only.
pub(crate) struct SimLlCall<'a> {
    world: &'a World,
    op: SimLlAllReduce,
    inputs: Vec<Vec<f32>>,
    outputs: Vec<Vec<f32>>,
}

impl<'a> SimLlCall<'a> {
    /// The one-shot LL all-reduce of `spec` on `world`, for f32 sums.
    pub(crate) fn new(
        world: &'a World,
        spec: &commfuse_core::OpSpec,
        dtype: commfuse_core::DType,
        reduce: commfuse_core::ReduceOp,
    ) -> Result<Self, BackendError> {
        use commfuse_core::{DType, OpKind, ReduceOp};
        if spec.kind != OpKind::AllReduce || dtype != DType::F32 || reduce != ReduceOp::Sum {
            return Err(unavailable(format!(
                "the simulator's LL protocol is an f32 sum all-reduce, not a {dtype} {reduce} {}",
                spec.kind
            )));
        }
        let p = world.size();
        Ok(SimLlCall {
            world,
            op: SimLlAllReduce::new(world, spec.count, LlShots::One)?,
            inputs: vec![vec![0.0; spec.count]; p],
            outputs: vec![vec![0.0; spec.count]; p],
        })
    }

    /// Every rank's calls on `inputs[c]`, queued on its own thread without waiting for the
    /// others in between; each rank's outputs in call order, and its time.
    fn calls(&self, inputs: &[&[Vec<f32>]]) -> Result<Vec<RankCalls>, BackendError> {
        let len = self.outputs[0].len();
        let gate = std::sync::Barrier::new(self.world.size());
        self.world.run(|ctx| {
            let r = ctx.rank();
            gate.wait();
            let start = Instant::now();
            let mut outs = Vec::with_capacity(inputs.len());
            for call in inputs {
                let mut out = vec![f32::NAN; len];
                self.op.forward(ctx, &call[r], &mut out)?;
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
