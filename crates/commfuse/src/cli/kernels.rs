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
    for source in commfuse_cuda::sys::nvrtc::KERNELS {
        let compiled = commfuse_cuda::sys::nvrtc::compile(*source, true)?;
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
