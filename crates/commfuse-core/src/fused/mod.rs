//! Fused operators' schedules: which tiles each rank computes in which order, where each tile
//! goes and which flag says it is there. Pure functions of the shape and the world size, shared
//! by the simulator and the GPU backend (the same tables on both).

pub mod ag_gemm;
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
