//! What the fused operators' benches ([`crate::gemm_rs::bench`], [`crate::ag_gemm::bench`])
//! and their checked runners ([`crate::gemm_rs::checked`], [`crate::ag_gemm::checked`]) share:
//! one host thread per rank timing a row's calls with CUDA events on each rank's stream,
//! rows interleaved in rounds, a call's time its slowest rank's, each row the median of its
//! rounds' medians; the row type; one host thread per rank for a run of calls; uploads and
//! downloads.

use crate::error::CudaError;
use crate::sys::driver::{DeviceMemory, Event, Gpu, Stream};
use crate::sys::host_sync::StartBarrier;
use commfuse_core::{rounds, DType};
use half::{bf16, f16};
use std::time::Duration;

/// A rank of a bench: its GPU and the stream its calls go on.
pub(crate) trait RankStream: Sync {
    fn gpu(&self) -> &Gpu;
    fn stream(&self) -> &Stream;
}

/// One row's call on rank r.
pub(crate) type Launch<'a, D> = Box<dyn Fn(usize, &D) -> Result<(), CudaError> + Sync + 'a>;

/// One row of a fused operator's table.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FusedRow {
    pub implementation: String,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub world: usize,
    /// Median over rounds of the round's median slowest-rank call time
    pub time_ms: f64,
    pub min_ms: f64,
    pub max_ms: f64,
    /// Every rank's GEMM flops over the time, per rank
    pub tflops: f64,
    /// Output elements checked against float64 (0: the row is a baseline not checked here)
    pub checked: usize,
    pub out_of_bound: usize,
    pub worst_ratio: f64,
}

/// Times every row in [`rounds::ROUNDS`] interleaved rounds of `iters / ROUNDS` calls (the
/// first with `warmup` untimed calls, at least one, the others with one); returns per row its
/// rounds' medians of the slowest rank's call time, in ms.
pub(crate) fn interleaved<D: RankStream>(
    ranks: &[D],
    launches: &[Launch<'_, D>],
    warmup: usize,
    iters: usize,
) -> Result<Vec<Vec<f64>>, CudaError> {
    let per_round = rounds::calls_per_round(iters);
    rounds::interleaved(
        launches.len(),
        |v, round| {
            let warm = rounds::warmup_of(round, warmup.max(1));
            let mut slowest = rounds::slowest_rank(&timed(ranks, &launches[v], warm, per_round)?);
            Ok(rounds::median(&mut slowest).expect("a round times at least one call"))
        },
        |_| {},
    )
}

/// A row from its rounds' medians (unchecked: `checked` 0).
pub(crate) fn row(
    implementation: &str,
    (m, n, k, world): (usize, usize, usize, usize),
    flops: f64,
    round_medians: &[f64],
) -> FusedRow {
    let (time_ms, min_ms, max_ms) = rounds::summary(round_medians).expect("a row has its rounds");
    FusedRow {
        implementation: implementation.to_string(),
        m,
        n,
        k,
        world,
        time_ms,
        min_ms,
        max_ms,
        tflops: flops / (time_ms * 1e-3) / 1e12,
        checked: 0,
        out_of_bound: 0,
        worst_ratio: 0.0,
    }
}

/// Runs `launch` on every rank's stream from one thread per rank: `warm` untimed calls, then
/// `iters` calls with events around each; returns per rank the times in ms.
pub(crate) fn timed<D: RankStream>(
    ranks: &[D],
    launch: &Launch<'_, D>,
    warm: usize,
    iters: usize,
) -> Result<Vec<Vec<f64>>, CudaError> {
    let all: Vec<usize> = (0..ranks.len()).collect();
    let start = StartBarrier::new(&all, Duration::from_secs(60));
    std::thread::scope(|scope| {
        let handles: Vec<_> = ranks
            .iter()
            .enumerate()
            .map(|(r, d)| {
                let start = &start;
                scope.spawn(move || -> Result<Vec<f64>, CudaError> {
                    let body = || -> Result<Vec<f64>, CudaError> {
                        d.gpu().bind()?;
                        let events: Vec<Event> = (0..=iters)
                            .map(|_| Event::new(d.gpu()))
                            .collect::<Result<_, _>>()?;
                        start
                            .wait(r)
                            .map_err(|e| CudaError::Unavailable(e.to_string()))?;
                        for _ in 0..warm {
                            launch(r, d)?;
                        }
                        events[0].record(d.stream())?;
                        for e in &events[1..] {
                            launch(r, d)?;
                            e.record(d.stream())?;
                        }
                        if !d.stream().wait_idle(Duration::from_secs(60))? {
                            return Err(CudaError::Unavailable(format!(
                                "rank {r}'s stream still busy after 60 s"
                            )));
                        }
                        events
                            .windows(2)
                            .map(|w| Ok(w[0].elapsed_ms(&w[1])? as f64))
                            .collect()
                    };
                    let out = body();
                    if let Err(e) = &out {
                        start.abort(r, e);
                    }
                    out
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(CudaError::Unavailable("a rank thread panicked".into()))
                })
            })
            .collect()
    })
}

/// `host` copied into new device memory of `gpu` (at least 16 bytes).
pub(crate) fn upload<T: bytemuck::NoUninit>(
    gpu: &Gpu,
    host: &[T],
) -> Result<DeviceMemory, CudaError> {
    let mem = DeviceMemory::zeroed(gpu, std::mem::size_of_val(host).max(16))?;
    mem.upload(gpu, host)?;
    Ok(mem)
}

/// Runs `part` for every rank, each on a host thread of its own; returns their results in
/// rank order, the first error among them (a panicked thread is one).
pub(crate) fn on_every_rank<R: Send, T: Send>(
    ranks: Vec<R>,
    part: impl Fn(R) -> Result<T, CudaError> + Sync,
) -> Result<Vec<T>, CudaError> {
    let part = &part;
    std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|rank| s.spawn(move || part(rank)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(CudaError::Unavailable(
                        "a rank's host thread panicked".into(),
                    ))
                })
            })
            .collect()
    })
}

/// Waits for every one of `streams`, each at most `limit`: past it, the error says that
/// `who` waited on `what`.
pub(crate) fn drain(
    streams: &[Stream],
    limit: Duration,
    who: &str,
    what: &str,
) -> Result<(), CudaError> {
    streams
        .iter()
        .try_for_each(|s| s.synchronize_within(limit, who, what))
}

/// `len` elements of `dtype` from `mem`, widened to f64.
pub(crate) fn download(
    gpu: &Gpu,
    mem: &DeviceMemory,
    dtype: DType,
    len: usize,
) -> Result<Vec<f64>, CudaError> {
    Ok(match dtype {
        DType::F32 => {
            let mut h = vec![0f32; len];
            mem.download(gpu, &mut h)?;
            h.into_iter().map(f64::from).collect()
        }
        DType::BF16 => {
            let mut h = vec![bf16::ZERO; len];
            mem.download(gpu, &mut h)?;
            h.into_iter().map(|x| x.to_f64()).collect()
        }
        DType::F16 => {
            let mut h = vec![f16::ZERO; len];
            mem.download(gpu, &mut h)?;
            h.into_iter().map(|x| x.to_f64()).collect()
        }
    })
}
