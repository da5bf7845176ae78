//! Fused operators' schedules: which tiles each rank computes in which order, where each tile
//! goes and which flag says it is there. Pure functions of the shape and the world size, shared
//! by the simulator and the GPU backend (the same tables on both).

pub mod ag_gemm;
pub mod fused_ring;
pub mod gemm_rs;
pub mod ring_rs;

use crate::dtype::DType;
use crate::error::Error;
use crate::gemm::{BLayout, ElementCheck, GemmProblem};

/// One checked call of a fused operator: its M and, per rank, the check of every element that
/// rank computed against the float64 reference.
#[derive(Debug, Clone)]
pub struct CallCheck {
    pub m: usize,
    pub ranks: Vec<ElementCheck>,
}

impl CallCheck {
    /// The check of every rank's elements together.
    pub fn total(&self) -> ElementCheck {
        self.ranks
            .iter()
            .fold(ElementCheck::default(), |all, r| all.merge(*r))
    }
}

/// Per call, every rank's values of one operand of a run of calls (`what`: 0 for A, 1 for B),
/// `len(call, rank)` of them, uniform in [-1, 1) from `seed`; call c's rank r draws from
/// stream (c·P + r)·3 + what of [`crate::reference::input_value`], so that every operator and
/// backend gives one seed the same operands.
pub(crate) fn random_per_rank<T: crate::Element>(
    world: usize,
    calls: usize,
    (what, seed): (usize, u64),
    len: impl Fn(usize, usize) -> usize,
) -> Vec<Vec<Vec<T>>> {
    (0..calls)
        .map(|c| {
            (0..world)
                .map(|r| random_values(seed, (c * world + r) * 3 + what, len(c, r)))
                .collect()
        })
        .collect()
}

/// Per call, the bias of N elements where `bias` (stream (c·P)·3 + 2: the same on every rank,
/// as a replicated parameter is).
pub(crate) fn random_bias<T: crate::Element>(
    world: usize,
    calls: usize,
    (n, bias): (usize, bool),
    seed: u64,
) -> Vec<Option<Vec<T>>> {
    (0..calls)
        .map(|c| bias.then(|| random_values(seed, c * world * 3 + 2, n)))
        .collect()
}

fn random_values<T: crate::Element>(seed: u64, stream: usize, len: usize) -> Vec<T> {
    use crate::reference::input_value;
    (0..len)
        .map(|i| T::from_f32(input_value(seed, stream, i, crate::ReduceOp::Sum)))
        .collect()
}

/// What every fused operator's shape must be: at least one rank, an output of the input type or
/// f32, and a GEMM the contract accepts (positive sizes, K a multiple of 8, bf16/f16 inputs).
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_shape(
    op: &str,
    world: usize,
    (m, n, k): (usize, usize, usize),
    b_layout: BLayout,
    input: DType,
    output: DType,
) -> Result<(), Error> {
    if world == 0 {
        return Err(Error::Unsupported(format!("{op} needs at least one rank")));
    }
    if output != DType::F32 && output != input {
        return Err(Error::Unsupported(format!(
            "the output is {input} (the input type) or f32, got {output}"
        )));
    }
    GemmProblem::new(m, n, k, b_layout, input, output)?;
    Ok(())
}
