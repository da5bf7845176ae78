//! What the kernels' sources must not do, read as text: needs neither NVRTC nor a GPU.

use commfuse_cuda::sys::nvrtc;

/// Every line of code (comments dropped) of every kernel and header that mentions `word`:
/// (file, line number, the code).
fn code_lines_with(word: &str) -> Vec<(&'static str, usize, String)> {
    let mut found = Vec::new();
    for source in nvrtc::KERNELS.iter().chain(nvrtc::HEADERS) {
        for (i, line) in source.text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("").trim();
            if code.contains(word) {
                found.push((source.name, i + 1, code.to_string()));
            }
        }
    }
    found
}

/// The error record's `abort` word lives in host memory, so a read of it crosses PCIe; waits
/// that read it every 256 polls in every spinning thread stalled the GPU's front end and made
/// calls take milliseconds (CHANGELOG.md, "Device waits read host memory rarely"). Only `waiter_check` in common.cuh
/// reads it, gated by `ABORT_POLL_NS` and `ABORT_POLL_SPINS` on the same line; every other
/// mention may only declare or raise it.
#[test]
fn only_the_gated_check_reads_the_abort_word() {
    let mentions = code_lines_with("abort");
    let raises = |code: &str| {
        code.contains("abort = 1")
            || (code.contains("store_release_sys_u32(&") && code.contains("abort, 1u)"))
    };
    let gated_reads: Vec<_> = mentions
        .iter()
        .filter(|(_, _, code)| code.contains("ABORT_POLL_NS") && code.contains("ABORT_POLL_SPINS"))
        .collect();
    assert_eq!(
        gated_reads.len(),
        1,
        "one gated read of the abort word (waiter_check), found {gated_reads:?}"
    );
    assert_eq!(gated_reads[0].0, "common.cuh");
    let others: Vec<_> = mentions
        .iter()
        .filter(|(_, _, code)| {
            !raises(code)
                && code != "u32 abort;"
                && !(code.contains("ABORT_POLL_NS") && code.contains("ABORT_POLL_SPINS"))
        })
        .collect();
    assert!(
        others.is_empty(),
        "the abort word read outside waiter_check (every read crosses PCIe): {others:?}"
    );
}

/// A trap ends every kernel of the CUDA context, other libraries' (PyTorch's) included, and
/// leaves the context unusable for the rest of the process: a wait that gives up records why in
/// its error record and the kernel leaves on its own instead (gemm.cu's `pipeline_stalled`).
#[test]
fn no_kernel_traps() {
    let traps: Vec<_> = code_lines_with("trap")
        .into_iter()
        .filter(|(_, _, code)| code.contains("__trap") || code.contains("trap;"))
        .collect();
    assert!(traps.is_empty(), "kernels that trap: {traps:?}");
}
