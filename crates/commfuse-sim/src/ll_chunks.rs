//! The LL protocol's reduce-scatter and all-gather, one trip over chunks, as the GPU kernel
//! (`commfuse-cuda`'s `src/collective/ll.cu`, modes reduce-scatter and all-gather) runs them — the
//! protocol, not the buffer layout (the kernel's reduce-scatter numbers its units from the
//! input's start, these lines from each chunk's): rank q's
//! chunk is `chunk_range(len, P, q)`; a sender stores its lines straight into the receiver's
//! buffer, half `seq mod 2` of it, and the receiver polls each line until it carries the call's
//! number. One element per line here (the kernel packs 2 or 3 words per 8- or 16-byte unit);
//! written over [`LlLines`] so that the model checks run it on loom's or shuttle's atomics.
//!
//! Why two halves suffice: a rank writes call c + 2's lines into a peer only after finishing
//! call c + 1, which needed a line of that peer's call c + 1, which the peer sent only after
//! finishing call c. That holds only if every receiver waits on every sender in every call —
//! and a chunk may be empty (fewer elements than ranks). So a sender whose chunk for a receiver
//! is empty still sends one line (its value unused): [`LlChunks::lines`] is never empty. Without
//! that line the rank that receives nothing could run calls ahead and overwrite a half its late
//! peer still reads (the GPU kernel did, before this was known: `tests/model_check.rs` catches
//! it with [`LlChunks::without_padding`]).

use crate::protocol::{ll_receive, ll_store, Backoff, LlLines, LlStuck};
use commfuse_core::algorithms::staggered_peers;
use commfuse_core::op::chunk_range;
use std::ops::Range;

/// How `len` elements split over `world` ranks, and where each sender's lines lie in a
/// receiver's buffer: 2 halves × `world` senders × [`LlChunks::pitch`] lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LlChunks {
    pub world: usize,
    pub len: usize,
    /// Whether an empty chunk still travels as one line (the protocol); `false` only to show
    /// what goes wrong without it.
    pad_empty: bool,
}

impl LlChunks {
    pub fn new(world: usize, len: usize) -> Self {
        LlChunks {
            world,
            len,
            pad_empty: true,
        }
    }

    /// The protocol as the kernel first had it: an empty chunk sends nothing. Runs ahead and
    /// breaks on back-to-back calls; only for the model check that shows so.
    pub fn without_padding(self) -> Self {
        LlChunks {
            pad_empty: false,
            ..self
        }
    }

    /// Rank q's elements.
    pub fn chunk(&self, q: usize) -> Range<usize> {
        chunk_range(self.len, self.world, q)
    }

    /// The lines that carry chunk q, counted from the chunk's start: one per element, and one
    /// (carrying nothing) for an empty chunk.
    pub fn lines(&self, q: usize) -> Range<usize> {
        let n = self.chunk(q).len();
        0..if self.pad_empty { n.max(1) } else { n }
    }

    /// Lines per sender in each half of a buffer: the longest chunk's, at least one.
    pub fn pitch(&self) -> usize {
        self.len.div_ceil(self.world).max(1)
    }

    /// Lines of one rank's buffer.
    pub fn buffer_lines(&self) -> usize {
        2 * self.world * self.pitch()
    }

    /// Where sender `sender`'s line `i` of call `seq` lies in a receiver's buffer.
    pub fn index(&self, seq: u32, sender: usize, i: usize) -> usize {
        ((seq as usize % 2) * self.world + sender) * self.pitch() + i
    }
}

/// Reduce-scatter (sum), call `seq` (≥ 1) of rank `rank`: chunk q of its `len`-element input as
/// lines to every peer q, then its own chunk summed over the senders in rank order (its own part
/// from its input) into `output` (the chunk's length).
pub fn ll_reduce_scatter<L: LlLines, B: Backoff + ?Sized>(
    lines: &L,
    layout: LlChunks,
    (rank, seq): (usize, u32),
    input: &[f32],
    output: &mut [f32],
    backoff: &mut B,
) -> Result<(), LlStuck> {
    // element i of chunk q of the input; 0 for the line of an empty chunk
    let part = |q: usize, i: usize| {
        let chunk = layout.chunk(q);
        if i < chunk.len() {
            input[chunk.start + i]
        } else {
            0.0
        }
    };
    for peer in staggered_peers(rank, layout.world) {
        for i in layout.lines(peer) {
            let at = layout.index(seq, rank, i);
            ll_store(lines.line(peer, at), part(peer, i).to_bits(), seq);
        }
    }
    let mine = layout.chunk(rank);
    for i in layout.lines(rank) {
        let mut sum = 0.0f32;
        for sender in 0..layout.world {
            sum += if sender == rank {
                part(rank, i)
            } else {
                let at = layout.index(seq, sender, i);
                ll_receive(lines, (rank, at, seq), (sender, mine.start + i), backoff)?
            };
        }
        if i < mine.len() {
            output[i] = sum;
        }
    }
    Ok(())
}

/// All-gather, call `seq` (≥ 1) of rank `rank`: its chunk (`input`, the chunk's length) as lines
/// to every peer, then every rank's chunk into `output` (`len` elements) at its place.
pub fn ll_all_gather<L: LlLines, B: Backoff + ?Sized>(
    lines: &L,
    layout: LlChunks,
    (rank, seq): (usize, u32),
    input: &[f32],
    output: &mut [f32],
    backoff: &mut B,
) -> Result<(), LlStuck> {
    for peer in staggered_peers(rank, layout.world) {
        for i in layout.lines(rank) {
            let x = input.get(i).copied().unwrap_or(0.0);
            ll_store(
                lines.line(peer, layout.index(seq, rank, i)),
                x.to_bits(),
                seq,
            );
        }
    }
    for q in 0..layout.world {
        let chunk = layout.chunk(q);
        for i in layout.lines(q) {
            let x = if q == rank {
                input.get(i).copied().unwrap_or(0.0)
            } else {
                let at = layout.index(seq, q, i);
                ll_receive(lines, (rank, at, seq), (q, chunk.start + i), backoff)?
            };
            if i < chunk.len() {
                output[chunk.start + i] = x;
            }
        }
    }
    Ok(())
}
