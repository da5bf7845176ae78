//! Checked back-to-back calls of GEMM + reduce-scatter on GPUs (what `commfuse run gemm-rs`
//! does on the cuda backend, and what the GPU tests assert on): one operator per rank
//! ([`GemmRsRank::create_group`]), one host thread each; the calls queued back to back without
//! a synchronisation between them, alternately on two streams of each rank, each output
//! poisoned by its stream first; then every output element of every rank against the float64
//! reference and the bound of the path each call took.

use crate::error::CudaError;
use crate::gemm_rs::{GemmRsConfig, GemmRsPath, GemmRsRank};
use crate::rank_bench::{drain, on_every_rank, upload};
use crate::sys::driver::{DeviceMemory, Gpu, Stream};
use commfuse_core::fused::gemm_rs::{check_elements_on, reference, CallInputs, GemmRsShape};
use commfuse_core::fused::CallCheck;
use commfuse_core::{DType, Element};
use half::{bf16, f16};
use std::sync::Arc;

/// One call's result on one rank: the path it took and its output chunk.
type RankCall<TO> = (GemmRsPath, Vec<TO>);

/// Runs one call per entry of `ms` (each at most `config.max_m`) on ranks `0..gpus.len()`
/// (rank r on `gpus[r]`, peer access enabled between them), operands from `seed` by
/// [`CallInputs::random`] (the simulator's for the same seed), and checks every output
/// element. Returns per call its check and the path it took.
pub fn run_checked(
    gpus: &[Arc<Gpu>],
    config: GemmRsConfig,
    ms: &[usize],
    seed: u64,
) -> Result<Vec<(CallCheck, GemmRsPath)>, CudaError> {
    match (config.input, config.output) {
        (DType::BF16, DType::BF16) => run::<bf16, bf16>(gpus, config, ms, seed),
        (DType::BF16, DType::F32) => run::<bf16, f32>(gpus, config, ms, seed),
        (DType::F16, DType::F16) => run::<f16, f16>(gpus, config, ms, seed),
        (DType::F16, DType::F32) => run::<f16, f32>(gpus, config, ms, seed),
        (input, output) => Err(CudaError::Unavailable(format!(
            "GEMM + reduce-scatter takes bf16 or f16 inputs and outputs in the input type or f32, got {input} → {output}"
        ))),
    }
}

fn run<TI: Element + bytemuck::Pod, TO: Element + bytemuck::Pod>(
    gpus: &[Arc<Gpu>],
    config: GemmRsConfig,
    ms: &[usize],
    seed: u64,
) -> Result<Vec<(CallCheck, GemmRsPath)>, CudaError> {
    let world = gpus.len();
    let (n, k) = (config.n, config.k);
    if let Some(&m) = ms.iter().find(|&&m| m == 0 || m > config.max_m) {
        return Err(CudaError::Unavailable(format!(
            "M must be 1 to {} (the max_m the operator is built for), got {m}",
            config.max_m
        )));
    }
    let inputs = CallInputs::<TI, TO>::random(world, (n, k), config.bias, ms, seed);
    let ranks = GemmRsRank::create_group(gpus, config)?;
    let inputs = &inputs;
    let outputs: Vec<Vec<RankCall<TO>>> = on_every_rank(ranks, |op| rank_calls(op, inputs, ms))?;
    let mut checks = Vec::with_capacity(ms.len());
    for (c, &m) in ms.iter().enumerate() {
        let shape = GemmRsShape::new(world, m, n, k, config.b_layout, TI::DTYPE, TO::DTYPE)
            .map_err(|e| CudaError::Unavailable(e.to_string()))?;
        let a: Vec<&[TI]> = inputs.a[c].iter().map(Vec::as_slice).collect();
        let b: Vec<&[TI]> = inputs.b[c].iter().map(Vec::as_slice).collect();
        let path = outputs[0][c].0;
        let ranks = outputs
            .iter()
            .enumerate()
            .map(|(r, calls)| {
                let want = reference(&shape, r, &a, &b, inputs.bias[c].as_deref());
                let got = calls[c].1.iter().map(|x| x.to_f64());
                check_elements_on(&shape, calls[c].0, got, &want)
            })
            .collect();
        checks.push((CallCheck { m, ranks }, path));
    }
    Ok(checks)
}

/// Rank `op`'s part: its calls queued back to back, then its outputs downloaded.
fn rank_calls<TI: Element + bytemuck::Pod, TO: Element + bytemuck::Pod>(
    mut op: GemmRsRank,
    inputs: &CallInputs<TI, TO>,
    ms: &[usize],
) -> Result<Vec<RankCall<TO>>, CudaError> {
    let gpu = op.gpu().clone();
    gpu.bind()?;
    let (r, n) = (op.rank(), op.config().n);
    let out_size = TO::DTYPE.size();
    // calls alternate between two streams: the operator orders each call after the previous
    // one whatever stream it came on
    let streams = [Stream::new(&gpu)?, Stream::new(&gpu)?];
    let mut buffers = Vec::with_capacity(ms.len());
    for (c, &m) in ms.iter().enumerate() {
        let rows = op.chunk(m).len();
        buffers.push((
            upload(&gpu, &inputs.a[c][r])?,
            upload(&gpu, &inputs.b[c][r])?,
            match &inputs.bias[c] {
                Some(bias) => Some(upload(&gpu, bias)?),
                None => None,
            },
            DeviceMemory::zeroed(&gpu, (rows * n * out_size).max(16))?,
        ));
    }
    let mut paths = Vec::with_capacity(ms.len());
    let queued = (|| -> Result<(), CudaError> {
        for (c, (&m, (a, b, bias, out))) in ms.iter().zip(&buffers).enumerate() {
            let stream = &streams[c % 2];
            // SAFETY: every buffer is of this GPU, sized for call c, and lives until both
            // streams are idle below
            unsafe {
                stream.fill_async(out.addr(), 0xff, op.chunk(m).len() * n * out_size)?;
                op.forward(
                    stream,
                    m,
                    a.addr(),
                    b.addr(),
                    bias.as_ref().map(DeviceMemory::addr),
                    out.addr(),
                )?;
            }
            paths.push(op.last_path().ok_or_else(|| {
                CudaError::Unavailable(format!("call {c} was queued but names no path"))
            })?);
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
        "its GEMM + reduce-scatter calls",
    )?;
    queued?;
    op.check()?;
    ms.iter()
        .zip(&buffers)
        .zip(paths)
        .map(|((&m, (_, _, _, out)), path)| {
            let len = op.chunk(m).len() * n;
            let mut host = vec![TO::from_f32(0.0); len.max(16 / out_size)];
            out.download(&gpu, &mut host)?;
            host.truncate(len);
            Ok((path, host))
        })
        .collect()
}
