//! `commfuse kernels`: the embedded kernels (every one, or the files named) compiled with NVRTC
//! for sm_90a (no GPU needed), and on request ptxas's report of each entry point.

use anyhow::{bail, Result};
use clap::Args;

#[derive(Args, Debug)]
pub struct KernelsArgs {
    /// Print ptxas's report (registers, shared memory, spills) of every entry point
    #[arg(long)]
    pub report: bool,
    /// Compile only these kernel files (e.g. plan.cu); every one when none is named
    #[arg(value_name = "FILE")]
    pub files: Vec<String>,
}

pub(super) fn kernels_cmd(a: KernelsArgs) -> Result<i32> {
    use commfuse_cuda::sys::nvrtc;
    if let Some(unknown) = a.files.iter().find(|f| nvrtc::kernel(f).is_none()) {
        let names: Vec<&str> = nvrtc::KERNELS.iter().map(|k| k.name).collect();
        bail!(
            "no kernel file '{unknown}' (the kernels: {})",
            names.join(", ")
        );
    }
    let chosen: Vec<nvrtc::Source> = nvrtc::KERNELS
        .iter()
        .copied()
        .filter(|k| a.files.is_empty() || a.files.iter().any(|f| f == k.name))
        .collect();
    // one NVRTC program runs on one core: the files, and the parts of those compiled in parts
    // (gemm.cu), compile side by side, each also refreshing its kernel-cache entry (the entries
    // the kernels load from); then report in order
    let results: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = chosen
            .iter()
            .map(|source| scope.spawn(move || nvrtc::compile_parts(*source, true)))
            .collect();
        handles.into_iter().map(|h| h.join()).collect()
    });
    for (source, parts) in chosen.iter().zip(results) {
        let parts = parts
            .map_err(|_| anyhow::anyhow!("compiling {} stopped unexpectedly", source.name))??;
        let bytes: usize = parts.iter().map(|p| p.cubin.len()).sum();
        let count = match parts.len() {
            1 => String::new(),
            n => format!(" in {n} parts"),
        };
        println!(
            "{}: compiled for {}{count} ({bytes} bytes of cubin)",
            source.name,
            nvrtc::ARCH,
        );
        if a.report {
            for part in &parts {
                println!("{}", part.log.trim_end());
            }
        }
    }
    Ok(0)
}
