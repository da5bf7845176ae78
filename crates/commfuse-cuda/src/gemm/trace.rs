//! Where one call of our GEMM spends its time, block by block: given a trace buffer, one
//! thread of each of a block's roles stamps a few points of the call (gemm.cu, `TraceEvent`)
//! with the global timer and its SM's clock. [`PreparedGemm::trace`] runs the call so and
//! gives each point's spread over the blocks, in µs after the block's own entry (by the SM's
//! clock, whose rate the global timer gives over the whole call), and the blocks' entries
//! after the first one's (by the global timer). `commfuse bench gemm --trace` prints it.
//!
//! At one tile an SM (decode sizes, a wave of 128 × 128 tiles) what a block does before its
//! first stage lands and after its last wgmma is a large share of the call; these points say
//! how large, beside cuBLASLt's time in the same run.

use super::{GemmParams, PreparedGemm};
use crate::error::CudaError;
use crate::sys::driver::{DeviceMemory, Gpu, Stream};
use commfuse_core::rounds;

/// The points a block stamps, in gemm.cu's `TraceEvent` order.
pub const EVENTS: [&str; 8] = [
    "entry",
    "producer",
    "first load",
    "first stage full",
    "main loop done",
    "consumer end",
    "producer end",
    "storer end",
];

/// One point's spread over the blocks that stamped it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct EventSpread {
    pub event: &'static str,
    /// Blocks that stamped it (a block without a unit stamps only its roles' ends)
    pub blocks: usize,
    /// µs after the block's own entry (for "entry": after the earliest block's entry)
    pub median_us: f64,
    pub min_us: f64,
    pub max_us: f64,
}

/// What [`PreparedGemm::trace`] found.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct GemmTrace {
    /// Blocks of the grid
    pub blocks: usize,
    /// The SMs' clock over the call (their clock's cycles over the global timer's ns), GHz
    pub clock_ghz: f64,
    /// From the earliest entry to the latest stamp, µs (by the global timer)
    pub span_us: f64,
    /// Every point, in [`EVENTS`] order
    pub events: Vec<EventSpread>,
}

/// A stamp: the global timer (ns) and the SM's clock, both 0 where the point was not reached.
type Stamp = [u64; 2];

impl PreparedGemm {
    /// Runs `warmup` calls as [`PreparedGemm::launch`] does, then one whose blocks stamp the
    /// points of [`EVENTS`], and waits for it.
    ///
    /// # Safety
    /// As [`PreparedGemm::launch`]: the prepared operands must be live and not in use.
    pub unsafe fn trace(
        &self,
        gpu: &Gpu,
        stream: &Stream,
        warmup: usize,
    ) -> Result<GemmTrace, CudaError> {
        let blocks = self.grid as usize;
        let stamps =
            DeviceMemory::zeroed(gpu, blocks * EVENTS.len() * std::mem::size_of::<Stamp>())?;
        for _ in 0..warmup {
            self.launch(stream)?;
        }
        let params = GemmParams {
            trace: stamps.addr(),
            ..self.params
        };
        self.queue(stream, &params)?;
        stream.synchronize()?;
        self.check()?;
        let mut host = vec![[0u64; 2]; blocks * EVENTS.len()];
        stamps.download(gpu, &mut host)?;
        Ok(spread(&host, blocks))
    }
}

/// The spreads of `stamps` (`blocks` × [`EVENTS`] stamps, block-major).
fn spread(stamps: &[Stamp], blocks: usize) -> GemmTrace {
    let per_block: Vec<&[Stamp]> = stamps.chunks(EVENTS.len()).take(blocks).collect();
    // the clock's rate over every block's span from its entry to its latest stamp
    let (mut cycles, mut ns) = (0u64, 0u64);
    let mut last_ns = 0;
    for b in &per_block {
        let entry = b[0];
        if entry[0] == 0 {
            continue;
        }
        if let Some(latest) = b.iter().filter(|s| s[0] != 0).max_by_key(|s| s[0]) {
            cycles += latest[1].saturating_sub(entry[1]);
            ns += latest[0] - entry[0];
            last_ns = last_ns.max(latest[0]);
        }
    }
    let clock_ghz = if ns == 0 {
        0.0
    } else {
        cycles as f64 / ns as f64
    };
    let first_entry = per_block
        .iter()
        .map(|b| b[0][0])
        .filter(|&t| t != 0)
        .min()
        .unwrap_or(0);
    let events = (0..EVENTS.len())
        .map(|e| {
            let us: Vec<f64> = per_block
                .iter()
                .filter(|b| b[0][0] != 0 && b[e][0] != 0)
                .map(|b| {
                    if e == 0 {
                        (b[0][0] - first_entry) as f64 / 1e3
                    } else if clock_ghz > 0.0 {
                        b[e][1].saturating_sub(b[0][1]) as f64 / clock_ghz / 1e3
                    } else {
                        b[e][0].saturating_sub(b[0][0]) as f64 / 1e3
                    }
                })
                .collect();
            let (median_us, min_us, max_us) =
                rounds::summary(&us).unwrap_or((f64::NAN, f64::NAN, f64::NAN));
            EventSpread {
                event: EVENTS[e],
                blocks: us.len(),
                median_us,
                min_us,
                max_us,
            }
        })
        .collect();
    GemmTrace {
        blocks,
        clock_ghz,
        span_us: last_ns.saturating_sub(first_entry) as f64 / 1e3,
        events,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two blocks at a 2 GHz clock: the points come out in µs after each block's own entry,
    /// the entries after the first one's, and a point one block did not reach counts only the
    /// other.
    #[test]
    fn spreads_are_per_block_and_skip_points_not_reached() {
        let n = EVENTS.len();
        let mut stamps = vec![[0u64; 2]; 2 * n];
        // block 0: entry at 1000 ns (clock 10 000), each point 1 µs (2000 cycles) after the last
        for (e, stamp) in stamps[..n].iter_mut().enumerate() {
            *stamp = [1000 + 1000 * e as u64, 10_000 + 2000 * e as u64];
        }
        // block 1: entry 500 ns later on another clock base, each point 2 µs apart, no storer end
        for (e, stamp) in stamps[n..2 * n - 1].iter_mut().enumerate() {
            *stamp = [1500 + 2000 * e as u64, 7 + 4000 * e as u64];
        }
        let t = spread(&stamps, 2);
        assert!((t.clock_ghz - 2.0).abs() < 1e-9, "{}", t.clock_ghz);
        assert_eq!(t.events[0].blocks, 2);
        assert_eq!((t.events[0].min_us, t.events[0].max_us), (0.0, 0.5));
        let producer = &t.events[1];
        assert_eq!(
            (producer.blocks, producer.min_us, producer.max_us),
            (2, 1.0, 2.0)
        );
        let storer_end = &t.events[n - 1];
        assert_eq!(
            (storer_end.blocks, storer_end.median_us),
            (1, (n - 1) as f64)
        );
        // from block 0's entry (1000 ns) to block 1's latest stamp (1500 + 2000 * 6 ns)
        assert!((t.span_us - (1500.0 + 2000.0 * (n - 2) as f64 - 1000.0) / 1e3).abs() < 1e-9);
    }
}
