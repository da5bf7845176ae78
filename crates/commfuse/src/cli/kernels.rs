//! `commfuse kernels`: every embedded kernel compiled with NVRTC for sm_90a (no GPU needed),
//! and on request ptxas's report of each entry point.

use anyhow::Result;
use clap::Args;

#[derive(Args, Debug)]
pub struct KernelsArgs {
    /// Print ptxas's report (registers, shared memory, spills) of every entry point
    #[arg(long)]
    pub report: bool,
}

pub(super) fn kernels_cmd(a: KernelsArgs) -> Result<i32> {
    // one NVRTC program runs on one core, and gemm.cu alone takes minutes: the files compile
    // side by side (each also refreshes its kernel-cache entry), then report in order
    let results: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = commfuse_cuda::sys::nvrtc::KERNELS
            .iter()
            .map(|source| scope.spawn(move || commfuse_cuda::sys::nvrtc::compile(*source, true)))
            .collect();
        handles.into_iter().map(|h| h.join()).collect()
    });
    for (source, compiled) in commfuse_cuda::sys::nvrtc::KERNELS.iter().zip(results) {
        let compiled = compiled
            .map_err(|_| anyhow::anyhow!("compiling {} stopped unexpectedly", source.name))??;
        println!(
            "{}: compiled for {} ({} bytes of cubin)",
            source.name,
            commfuse_cuda::sys::nvrtc::ARCH,
            compiled.cubin.len()
        );
        if a.report {
            println!("{}", compiled.log.trim_end());
        }
    }
    Ok(0)
}
