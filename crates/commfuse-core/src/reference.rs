//! Deterministic random inputs and the float64 reference every backend is checked against.
//!
//! Inputs are a pure function of (seed, rank, index), so the reference regenerates them instead
//! of trusting what a backend holds: a collective that scribbles on its input is caught too.
//! Sums, maxima and minima draw from [−1, 1); products draw from {−1, −½, ½, 1}, which keeps
//! every partial product exact in any element type, so a product counted twice or missed always
//! shows.

use crate::backend::{HostSlice, HostSliceMut};
use crate::dtype::{DType, Element};
use crate::op::{OpSpec, Piece};
use crate::reduce::ReduceOp;

fn mix(mut x: u64) -> u64 {
    // splitmix64's finaliser
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The random stream of one rank: splitmix64 keyed by (seed, rank), indexable.
#[inline]
fn stream_key(seed: u64, rank: usize) -> u64 {
    mix(seed ^ mix(rank as u64 + 1))
}

/// Input element `index` of rank `rank` (before rounding to the element type).
#[inline]
pub fn input_value(seed: u64, rank: usize, index: usize, reduce: ReduceOp) -> f32 {
    value_at(stream_key(seed, rank), index, reduce)
}

#[inline(always)]
fn value_at(key: u64, index: usize, reduce: ReduceOp) -> f32 {
    let h = mix(key.wrapping_add((index as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)));
    match reduce {
        ReduceOp::Prod => [-1.0, -0.5, 0.5, 1.0][(h >> 62) as usize],
        _ => (h >> 40) as f32 / (1u64 << 23) as f32 - 1.0,
    }
}

fn threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(8)
}

/// Fills rank `rank`'s input (large buffers on all cores).
pub fn fill_input(seed: u64, rank: usize, reduce: ReduceOp, out: HostSliceMut<'_>) {
    fn fill<T: Element>(seed: u64, rank: usize, reduce: ReduceOp, out: &mut [T]) {
        let key = stream_key(seed, rank);
        let part = out.len().div_ceil(threads()).max(1 << 16);
        std::thread::scope(|s| {
            for (k, chunk) in out.chunks_mut(part).enumerate() {
                s.spawn(move || {
                    for (i, x) in chunk.iter_mut().enumerate() {
                        *x = T::from_f32(value_at(key, k * part + i, reduce));
                    }
                });
            }
        });
    }
    match out {
        HostSliceMut::F32(s) => fill(seed, rank, reduce, s),
        HostSliceMut::BF16(s) => fill(seed, rank, reduce, s),
        HostSliceMut::F16(s) => fill(seed, rank, reduce, s),
    }
}

/// Overwrites a buffer with NaN so that an element the collective forgot to write fails.
pub fn poison(out: HostSliceMut<'_>) {
    fn fill<T: Element>(out: &mut [T]) {
        out.fill(T::poison());
    }
    match out {
        HostSliceMut::F32(s) => fill(s),
        HostSliceMut::BF16(s) => fill(s),
        HostSliceMut::F16(s) => fill(s),
    }
}

/// One wrong output element.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Mismatch {
    pub rank: usize,
    pub index: usize,
    pub got: f64,
    pub expected: f64,
}

/// The outcome of comparing every output element with the reference.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Comparison {
    pub checked: u64,
    pub wrong: u64,
    /// Largest |got − expected| / scale over elements compared with a tolerance.
    pub max_error: f64,
    /// The first few mismatches, by rank then index.
    pub mismatches: Vec<Mismatch>,
}

impl Comparison {
    pub fn ok(&self) -> bool {
        self.wrong == 0
    }

    fn merge(&mut self, other: Comparison, keep: usize) {
        self.checked += other.checked;
        self.wrong += other.wrong;
        self.max_error = self.max_error.max(other.max_error);
        self.mismatches.extend(other.mismatches);
        self.mismatches.sort_by_key(|m| (m.rank, m.index));
        self.mismatches.truncate(keep);
    }
}

const MISMATCHES_KEPT: usize = 8;

/// Compares every rank's output with the float64 reference of `spec` on inputs made by
/// [`fill_input`] with `seed`. Sums may be off by `tol` times the sum of the magnitudes of the
/// contributions, where `tol` is the dtype's tolerance (1e-5 for f32, 1e-2 for the half types)
/// or, if larger, the worst case of k roundings of a running partial sum for k contributions
/// (k·u): ring algorithms store partial sums in the element type at every hop, as NCCL does,
/// so bf16 over 8 ranks may legitimately reach 3 %. Products may be off by `tol`·|expected|
/// (they are exact with these inputs); max, min and pure copies must match exactly. NaN never
/// passes.
pub fn compare(
    spec: &OpSpec,
    reduce: ReduceOp,
    seed: u64,
    outputs: &[HostSlice<'_>],
) -> Comparison {
    fn typed<'a, T: Element>(outputs: &[HostSlice<'a>]) -> Vec<&'a [T]> {
        outputs
            .iter()
            .map(|s| T::from_host(*s).expect("outputs of one dtype"))
            .collect()
    }
    match outputs.first().map(|s| s.dtype()) {
        None => Comparison::default(),
        Some(DType::F32) => compare_typed::<f32>(spec, reduce, seed, &typed(outputs)),
        Some(DType::BF16) => compare_typed::<half::bf16>(spec, reduce, seed, &typed(outputs)),
        Some(DType::F16) => compare_typed::<half::f16>(spec, reduce, seed, &typed(outputs)),
    }
}

fn compare_typed<T: Element>(
    spec: &OpSpec,
    reduce: ReduceOp,
    seed: u64,
    outputs: &[&[T]],
) -> Comparison {
    // ranks whose outputs have the same definition share one reference computation
    let mut groups: Vec<(Vec<Piece>, Vec<usize>)> = Vec::new();
    for r in 0..spec.world {
        let pieces = spec.expected_pieces(r);
        match groups.iter_mut().find(|(p, _)| *p == pieces) {
            Some((_, ranks)) => ranks.push(r),
            None => groups.push((pieces, vec![r])),
        }
    }
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(8);
    let mut total = Comparison::default();
    for (pieces, ranks) in &groups {
        for piece in pieces {
            let parts = if piece.len < 1 << 16 { 1 } else { threads };
            let results: Vec<Comparison> = std::thread::scope(|s| {
                let handles: Vec<_> = (0..parts)
                    .map(|t| {
                        let range = crate::op::chunk_range(piece.len, parts, t);
                        s.spawn(move || {
                            compare_range::<T>(
                                spec.world, reduce, seed, piece, range, ranks, outputs,
                            )
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().expect("compare thread"))
                    .collect()
            });
            for r in results {
                total.merge(r, MISMATCHES_KEPT);
            }
        }
    }
    total
}

fn compare_range<T: Element>(
    world: usize,
    reduce: ReduceOp,
    seed: u64,
    piece: &Piece,
    range: std::ops::Range<usize>,
    ranks: &[usize],
    outputs: &[&[T]],
) -> Comparison {
    const BLOCK: usize = 1024;
    let contributors: Vec<usize> = (0..world).filter(|q| piece.mask >> q & 1 == 1).collect();
    let tol = T::DTYPE
        .tolerance()
        .max(contributors.len() as f64 * T::DTYPE.unit_roundoff());
    let exact = contributors.len() == 1 || matches!(reduce, ReduceOp::Max | ReduceOp::Min);
    let mut out = Comparison::default();
    let mut expected = [0f64; BLOCK];
    let mut scale = [0f64; BLOCK];
    let mut start = range.start;
    while start < range.end {
        let len = BLOCK.min(range.end - start);
        for (k, &q) in contributors.iter().enumerate() {
            let key = stream_key(seed, q);
            for i in 0..len {
                let x = T::from_f32(value_at(key, piece.elem + start + i, reduce)).to_f64();
                if k == 0 {
                    expected[i] = x;
                    scale[i] = x.abs();
                } else {
                    expected[i] = reduce.apply_f64(expected[i], x);
                    scale[i] += x.abs();
                }
            }
        }
        for &r in ranks {
            let got = &outputs[r][piece.start + start..piece.start + start + len];
            for i in 0..len {
                let g = got[i].to_f64();
                let err = (g - expected[i]).abs();
                let allowed = if exact {
                    0.0
                } else if reduce == ReduceOp::Prod {
                    tol * expected[i].abs()
                } else {
                    tol * scale[i]
                };
                if !exact && allowed > 0.0 {
                    out.max_error = out.max_error.max(err / (allowed / tol));
                }
                // NaN compares as neither less nor equal, so it fails
                let within = err.partial_cmp(&allowed).is_some_and(|o| o.is_le());
                if !within {
                    out.wrong += 1;
                    if out.mismatches.len() < MISMATCHES_KEPT {
                        out.mismatches.push(Mismatch {
                            rank: r,
                            index: piece.start + start + i,
                            got: g,
                            expected: expected[i],
                        });
                    }
                }
            }
            out.checked += len as u64;
        }
        start += len;
    }
    out
}
