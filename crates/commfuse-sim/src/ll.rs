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
use commfuse_core::backend::BackendError;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

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
