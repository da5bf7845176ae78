//! Checked back-to-back calls of all-gather + GEMM on GPUs (what `commfuse run ag-gemm` does on
//! the cuda backend): one operator per rank ([`AgGemmRank::create_group`]), one host thread
//! each; the calls queued back to back without a synchronisation between them, alternately on
//! two streams of each rank, each output poisoned by its stream first, the gathered A asked for
//! on every other call; then every output element of every rank against the float64 reference
//! and every element of the gathered A exactly.

use crate::ag_gemm::{AgGemmConfig, AgGemmRank};
use crate::error::CudaError;
use crate::rank_bench::{drain, on_every_rank, upload};
use crate::sys::driver::{DeviceMemory, Gpu, Stream};
use commfuse_core::fused::ag_gemm::AgCallInputs;
use commfuse_core::fused::CallCheck;
use commfuse_core::gemm::{check_elements, reference_gemm, Epilogue, GemmProblem};
use commfuse_core::{DType, Element};
use half::{bf16, f16};
use std::sync::Arc;

/// One call's results on one rank: the output and, where asked for, the gathered A.
type RankCall<TO, TI> = (Vec<TO>, Option<Vec<TI>>);

/// Runs one call per entry of `ms` (gathered rows, each at most `config.max_m`) on ranks
/// `0..gpus.len()` (rank r on `gpus[r]`, peer access enabled between them), operands from
/// `seed` by [`AgCallInputs::random`] (the simulator's for the same seed), and checks every
/// element. A gathered A that differs in any element is an error naming it.
pub fn run_checked(
    gpus: &[Arc<Gpu>],
    config: AgGemmConfig,
    ms: &[usize],
    seed: u64,
) -> Result<Vec<CallCheck>, CudaError> {
    match (config.input, config.output) {
        (DType::BF16, DType::BF16) => run::<bf16, bf16>(gpus, config, ms, seed),
        (DType::BF16, DType::F32) => run::<bf16, f32>(gpus, config, ms, seed),
        (DType::F16, DType::F16) => run::<f16, f16>(gpus, config, ms, seed),
        (DType::F16, DType::F32) => run::<f16, f32>(gpus, config, ms, seed),
        (input, output) => Err(CudaError::Unavailable(format!(
            "all-gather + GEMM takes bf16 or f16 inputs and outputs in the input type or f32, got {input} → {output}"
        ))),
    }
}

fn run<TI: Element + bytemuck::Pod, TO: Element + bytemuck::Pod>(
    gpus: &[Arc<Gpu>],
    config: AgGemmConfig,
    ms: &[usize],
    seed: u64,
) -> Result<Vec<CallCheck>, CudaError> {
    let world = gpus.len();
    let (n, k) = (config.n, config.k);
    if let Some(&m) = ms.iter().find(|&&m| m == 0 || m > config.max_m) {
        return Err(CudaError::Unavailable(format!(
            "M must be 1 to {} (the max_m the operator is built for), got {m}",
            config.max_m
        )));
    }
    let inputs = AgCallInputs::<TI, TO>::random(world, (n, k), config.bias, ms, seed);
    let ranks = AgGemmRank::create_group(gpus, config)?;
    let inputs = &inputs;
    let outputs: Vec<Vec<RankCall<TO, TI>>> =
        on_every_rank(ranks, |op| rank_calls(op, inputs, ms))?;
    let epilogue = Epilogue {
        bias: config.bias,
        ..Epilogue::default()
    };
    let mut checks = Vec::with_capacity(ms.len());
    for (c, &m) in ms.iter().enumerate() {
        let problem = GemmProblem::new(m, n, k, config.b_layout, TI::DTYPE, TO::DTYPE)
            .map_err(|e| CudaError::Unavailable(e.to_string()))?;
        let full = inputs.gathered(c);
        let mut ranks = Vec::with_capacity(world);
        for (r, calls) in outputs.iter().enumerate() {
            let (out, gathered) = &calls[c];
            let want = reference_gemm(
                &problem,
                &epilogue,
                &full,
                &inputs.b[c][r],
                None,
                inputs.bias[c].as_deref(),
                None,
            );
            ranks.push(check_elements(
                &problem,
                &epilogue,
                out.iter().map(|x| x.to_f64()),
                &want,
            ));
            // the gathered A is a copy: any difference is a wrong element
            let differs = gathered.as_ref().and_then(|g| {
                g.iter()
                    .zip(&full)
                    .position(|(g, w)| g.to_f64().to_bits() != w.to_f64().to_bits())
            });
            if let Some(i) = differs {
                return Err(CudaError::Unavailable(format!(
                    "call {c} (M={m}): rank {r}'s gathered A differs at element {i} (row {}, column {})",
                    i / k,
                    i % k
                )));
            }
        }
        checks.push(CallCheck { m, ranks });
    }
    Ok(checks)
}

/// Rank `op`'s part: its calls queued back to back, then its outputs downloaded.
fn rank_calls<TI: Element + bytemuck::Pod, TO: Element + bytemuck::Pod>(
    mut op: AgGemmRank,
    inputs: &AgCallInputs<TI, TO>,
    ms: &[usize],
) -> Result<Vec<RankCall<TO, TI>>, CudaError> {
    let gpu = op.gpu().clone();
    gpu.bind()?;
    let r = op.rank();
    let (n, k) = (op.config().n, op.config().k);
    let (in_size, out_size) = (TI::DTYPE.size(), TO::DTYPE.size());
    // calls alternate between two streams: the operator orders each call after the previous
    // one whatever stream it came on
    let streams = [Stream::new(&gpu)?, Stream::new(&gpu)?];
    let mut buffers = Vec::with_capacity(ms.len());
    for (c, &m) in ms.iter().enumerate() {
        buffers.push((
            upload(&gpu, &inputs.a[c][r])?,
            upload(&gpu, &inputs.b[c][r])?,
            match &inputs.bias[c] {
                Some(bias) => Some(upload(&gpu, bias)?),
                None => None,
            },
            DeviceMemory::zeroed(&gpu, m * n * out_size)?,
            DeviceMemory::zeroed(&gpu, m * k * in_size)?,
        ));
    }
    let queued = (|| -> Result<(), CudaError> {
        for (c, (&m, (a, b, bias, out, gathered))) in ms.iter().zip(&buffers).enumerate() {
            let stream = &streams[c % 2];
            // SAFETY: every buffer is of this GPU, sized for call c, and lives until both
            // streams are idle below
            unsafe {
                stream.fill_async(out.addr(), 0xff, m * n * out_size)?;
                let operands = (a.addr(), b.addr(), bias.as_ref().map(DeviceMemory::addr));
                let g = (c % 2 == 0).then(|| gathered.addr());
                op.forward(stream, m, operands, out.addr(), g)?;
            }
        }
        Ok(())
    })();
    // whatever was queued ends before the buffers are freed: every wait of the operator gives
    // up after its timeout, so this wait is bounded by the calls' count times it
    let limit = 4 * ms.len().max(1) as u32 * op.config().timeout;
    drain(
        &streams,
        limit,
        &format!("rank {r}"),
        "its all-gather + GEMM calls",
    )?;
    queued?;
    op.check()?;
    ms.iter()
        .zip(&buffers)
        .enumerate()
        .map(|(c, (&m, (_, _, _, out, gathered)))| {
            let mut o = vec![TO::from_f32(0.0); m * n];
            out.download(&gpu, &mut o)?;
            let g = if c % 2 == 0 {
                let mut g = vec![TI::from_f32(0.0); m * k];
                gathered.download(&gpu, &mut g)?;
                Some(g)
            } else {
                None
            };
            Ok((o, g))
        })
        .collect()
}
