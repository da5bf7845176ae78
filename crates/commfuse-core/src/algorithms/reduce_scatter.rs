//! Reduce-scatter algorithms: rank r ends with chunk r of the reduction, at output[0..].

use super::all_reduce::{input, output};
use super::direct::{handshake, push_slot, staggered_peers};
use super::ring::{self, Ring};
use crate::op::chunk_range;
use crate::plan::{BufferKind, PlanBuilder, Region, Slot};

/// Direct: after an entry handshake rank r reads chunk r of every input and reduces it; an exit
/// handshake keeps inputs alive until all peers have read them.
///
/// Cost card: 1 data step per rank receiving (P−1)/P·n elements; 2(P−1) signals; no scratch.
pub(super) fn direct(b: &mut PlanBuilder) {
    let (p, n) = (b.world(), b.spec().count);
    let rows = b.rows(2);
    handshake(b, rows);
    for r in 0..p {
        let c = chunk_range(n, p, r);
        let srcs = (0..p).map(|q| input(q, c.clone())).collect();
        b.reduce(r, srcs, output(r, 0..c.len()));
    }
    handshake(b, rows + 1);
}

/// Push: after an entry handshake ("my scratch is free"), every rank stores chunk q of its
/// input into a slot of rank q's scratch and signals it; rank r then reduces its own chunk with
/// the P−1 it received, in rank order. No rank reads another's memory, so no exit handshake.
///
/// Cost card: P−1 stores of n/P elements per rank, 1 local reduction; 2(P−1) signals; scratch
/// (P−1)·⌈n/P⌉ (≤ the message).
pub(super) fn push(b: &mut PlanBuilder) {
    push_in_stages(b, 1);
}

/// Elements per stage that [`push_pipelined`] aims at (a chunk of n elements goes in
/// ⌈n / this⌉ stages, at least two and at most [`PIPELINE_STAGES_MAX`]): smaller stages would
/// pay more in signals than their overlap saves.
pub const PIPELINE_STAGE_MIN: usize = 1 << 18;
/// Stage boundaries fall on multiples of this many elements from the chunk's start, so that a
/// stage of an aligned chunk stays 16-byte aligned (the GPU kernel's vector path).
const STAGE_GRAIN: usize = 64;
/// Stages at most, in [`push_pipelined`].
pub const PIPELINE_STAGES_MAX: usize = 8;

/// Push, pipelined: as [`push`], but each chunk goes in stages (see [`PIPELINE_STAGE_MIN`]; a
/// stage of a short chunk may be empty, its signal still sent), each with its own signal,
/// and a rank reduces stage k of its own chunk right after pushing stage k + 1 of its peers' —
/// so while one stage's stores cross the link the previous one is reduced locally, where
/// [`push`] leaves the link idle during its one reduction at the end (on 2 × H200 at 256 MiB that
/// reduction is about a fifth of the call). In the GPU kernel every lane (block) runs these
/// steps over its slice of each stage, so lanes out of phase keep the link busy.
///
/// Cost card: as [`push`], with S·(P−1) data signals instead of P−1 and S reductions.
pub(super) fn push_pipelined(b: &mut PlanBuilder) {
    let cap = chunk_range(b.spec().count, b.world(), 0).len();
    // two stages at least wherever a chunk has two elements: the pipeline is what this plan
    // is, and small messages (which `auto` leaves to other plans) check it as well as large ones
    let stages = cap
        .div_ceil(PIPELINE_STAGE_MIN)
        .clamp(2, PIPELINE_STAGES_MAX)
        .min(cap)
        .max(1);
    push_in_stages(b, stages);
}

/// The push reduce-scatter with each chunk in `stages` stages (one: [`push`]), stage k reduced
/// after stage k + 1 is pushed.
fn push_in_stages(b: &mut PlanBuilder, stages: usize) {
    let (p, n) = (b.world(), b.spec().count);
    let cap = chunk_range(n, p, 0).len();
    let rows = b.rows(1 + stages as u32);
    let data = |k: usize| rows + 1 + k as u32;
    let base = b.scratch((p - 1) * cap);
    // stage k of chunk q: its elements, counted from the chunk's start, in whole grains
    let stage = |q: usize, k: usize| {
        let len = chunk_range(n, p, q).len();
        let grains = chunk_range(len.div_ceil(STAGE_GRAIN), stages, k);
        (grains.start * STAGE_GRAIN).min(len)..(grains.end * STAGE_GRAIN).min(len)
    };
    // stage k of what `sender` pushes into `receiver`'s scratch
    let slot = |receiver: usize, sender: usize, k: usize| {
        let at = base + push_slot(receiver, sender, p) * cap;
        let s = stage(receiver, k);
        Region::new(receiver, BufferKind::Scratch, at + s.start..at + s.end)
    };
    handshake(b, rows);
    for r in 0..p {
        let own = chunk_range(n, p, r);
        let reduce_stage = |b: &mut PlanBuilder, k: usize| {
            for q in staggered_peers(r, p) {
                b.wait(r, Slot::new(data(k), q as u32), 1);
            }
            let s = stage(r, k);
            let at = own.start + s.start..own.start + s.end;
            let srcs = (0..p)
                .map(|q| {
                    if q == r {
                        input(r, at.clone())
                    } else {
                        slot(r, q, k)
                    }
                })
                .collect();
            b.reduce(r, srcs, output(r, s));
        };
        for k in 0..stages {
            for q in staggered_peers(r, p) {
                let c = chunk_range(n, p, q);
                let s = stage(q, k);
                b.copy(
                    r,
                    input(r, c.start + s.start..c.start + s.end),
                    slot(q, r, k),
                );
                b.signal(r, q, Slot::new(data(k), r as u32));
            }
            if k > 0 {
                reduce_stage(b, k - 1);
            }
        }
        reduce_stage(b, stages - 1);
    }
}

/// Ring: the reduce-scatter phase of the ring all-reduce, finishing into output[0..].
///
/// Cost card: P−1 steps of n/P elements per rank to the right neighbour; scratch 2·⌈n/P⌉.
pub(super) fn ring(b: &mut PlanBuilder) {
    let (p, n) = (b.world(), b.spec().count);
    let rings = [Ring::simple(
        (0..p).collect(),
        (0..p).map(|j| chunk_range(n, p, j)),
    )];
    ring::reduce_scatter(b, &rings, &input, &|r, c| output(r, 0..c.len()));
}
