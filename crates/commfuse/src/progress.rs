//! What the commands that can run long (a simulated fused GEMM, `verify`, a bench sweep) show
//! while they run: a progress bar on stderr, drawn only when stderr is a terminal (piped output
//! and logs hold the results alone) and cleared when done; and, before a simulated GEMM starts,
//! a one-line warning with an estimate of its time when that is long.

use indicatif::{ProgressBar, ProgressFinish, ProgressStyle};
use std::io::IsTerminal;

/// A bar of `len` steps titled `what` on stderr where stderr is a terminal, else one that draws
/// nothing. Dropped unfinished (a command that fails midway), it clears itself, so that the
/// one-line error stands alone.
pub fn bar(len: u64, what: &str) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len).with_finish(ProgressFinish::AndClear);
    let style = ProgressStyle::with_template(
        "{msg} [{elapsed_precise}] {wide_bar} {pos}/{len} (about {eta} left)",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar());
    bar.set_style(style);
    bar.set_message(what.to_string());
    bar
}

/// Floating-point operations per second of one core running a simulated rank's GEMM together
/// with its share of the float64 check, end to end: a checked run's FLOPs
/// ([`simulated_gemm_flops`]) over its wall time. `commfuse run gemm-rs --m 1024 --n 1024
/// --k 1024 -p 2` counts 12.9 GFLOP and takes about 3 s on two x86-64 cores shared with other
/// builds (`run ag-gemm` of the same shape about as long), about 2 GFLOP/s per core; at
/// 512×512×512 the run is 1.6 GFLOP in 0.5 s. Idle or wider-SIMD cores run faster: the figure
/// only sets the order of magnitude of a warning.
pub const SIMULATED_GEMM_FLOPS_PER_CORE: f64 = 2.0e9;

/// A run estimated to take longer than this gets a warning first, seconds.
pub const LONG_RUN_SECONDS: f64 = 10.0;

/// FLOPs a checked simulated run of a fused GEMM counts: for each call of `m` rows, every one
/// of the `ranks` ranks multiplies an M×K by a K×N operand (GEMM + reduce-scatter: its own A and
/// B; all-gather + GEMM: the gathered A by its B), 2·M·N·K each, and the float64 check redoes
/// as much once more.
pub fn simulated_gemm_flops(ms: &[usize], n: usize, k: usize, ranks: usize) -> f64 {
    let per_call = |m: usize| 2.0 * m as f64 * n as f64 * k as f64 * ranks as f64;
    2.0 * ms.iter().map(|&m| per_call(m)).sum::<f64>()
}

/// Seconds the simulator is expected to take for `flops` on `ranks` ranks (one thread each)
/// over `cores` cores: the ranks run side by side on at most `cores` of them.
pub fn simulated_gemm_seconds(flops: f64, ranks: usize, cores: usize) -> f64 {
    let busy = ranks.clamp(1, cores.max(1));
    flops / (SIMULATED_GEMM_FLOPS_PER_CORE * busy as f64)
}

/// The warning for `what` (e.g. "gemm-rs 8192×8192×4096 on 8 ranks"), a run of calls of `ms`
/// rows of an N×K GEMM, on `cores` cores, where its estimate exceeds [`LONG_RUN_SECONDS`].
pub fn long_run_warning(
    what: &str,
    (ms, n, k): (&[usize], usize, usize),
    (ranks, cores): (usize, usize),
) -> Option<String> {
    let flops = simulated_gemm_flops(ms, n, k, ranks);
    let seconds = simulated_gemm_seconds(flops, ranks, cores);
    (seconds > LONG_RUN_SECONDS).then(|| {
        format!(
            "warning: {what} on the simulator will take about {} ({:.0} GFLOP with the check, at about {:.0} GFLOP/s on each of {} cores); smaller --m, --n or --k run faster",
            duration(seconds),
            flops / 1e9,
            SIMULATED_GEMM_FLOPS_PER_CORE / 1e9,
            ranks.clamp(1, cores.max(1))
        )
    })
}

/// The cores this process may use (1 where that cannot be told).
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// `40 s`, `12 min`, `3.5 h`.
fn duration(seconds: f64) -> String {
    if seconds < 120.0 {
        format!("{seconds:.0} s")
    } else if seconds < 7200.0 {
        format!("{:.0} min", seconds / 60.0)
    } else {
        format!("{:.1} h", seconds / 3600.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_estimate_counts_every_ranks_gemm_and_its_check() {
        // two calls, M then M/2, 2 ranks: 2 · (2·64·32·16·2 + 2·32·32·16·2) = 393 216
        assert_eq!(simulated_gemm_flops(&[64, 32], 32, 16, 2), 393_216.0);
        let flops = simulated_gemm_flops(&[1024, 512], 1024, 1024, 2);
        // two ranks on two cores run side by side; on one core they take turns; more cores
        // than ranks do not help
        let both = simulated_gemm_seconds(flops, 2, 2);
        assert!((simulated_gemm_seconds(flops, 2, 1) - 2.0 * both).abs() < 1e-9);
        assert_eq!(simulated_gemm_seconds(flops, 2, 64), both);
        assert!((both - flops / (2.0 * SIMULATED_GEMM_FLOPS_PER_CORE)).abs() < 1e-9);
    }

    #[test]
    fn a_long_shape_gets_one_line_of_warning_and_a_short_one_none() {
        let short = long_run_warning("gemm-rs 64×32×16 on 2 ranks", (&[64, 32], 32, 16), (2, 2));
        assert_eq!(short, None);
        let big = [8192, 4096];
        let w = long_run_warning(
            "gemm-rs 8192×8192×8192 on 8 ranks",
            (&big, 8192, 8192),
            (8, 2),
        )
        .expect("a warning");
        // 2 · 2 · (8192 + 4096)·8192·8192·8 = 26 388 GFLOP over 2 cores at 2 GFLOP/s: 110 min
        assert_eq!(
            w,
            "warning: gemm-rs 8192×8192×8192 on 8 ranks on the simulator will take about 110 min (26388 GFLOP with the check, at about 2 GFLOP/s on each of 2 cores); smaller --m, --n or --k run faster"
        );
        assert_eq!(w.lines().count(), 1);
        assert_eq!(duration(40.0), "40 s");
        assert_eq!(duration(5400.0), "90 min");
        assert_eq!(duration(12_600.0), "3.5 h");
    }
}
