//! Test support shared by every GPU test: whether enough GPUs are here, and what happens when
//! they are not. Without GPUs a test prints why and returns (it is reported as passing), unless
//! `COMMFUSE_REQUIRE_GPU=1` is set (the GPU script sets it): then a skip is a failure, so that
//! a recorded GPU run cannot count a test that did not run.

use crate::sys::driver;

/// The environment switch that turns a skip into a failure.
pub const REQUIRE_GPU: &str = "COMMFUSE_REQUIRE_GPU";

/// Whether skips are failures in this process.
pub fn gpu_required() -> bool {
    std::env::var(REQUIRE_GPU).is_ok_and(|v| !v.is_empty() && v != "0")
}

/// Skips the calling test with `why` printed, or panics with it under `COMMFUSE_REQUIRE_GPU=1`.
pub fn skip(why: &str) {
    skip_or_fail(gpu_required(), why)
}

fn skip_or_fail(required: bool, why: &str) {
    assert!(!required, "{REQUIRE_GPU} is set but: {why}");
    eprintln!("skipped: {why}");
}

/// The number of GPUs when at least `needed` are present; otherwise skips (see [`skip`]) and
/// returns `None`.
pub fn gpus(needed: usize) -> Option<usize> {
    match driver::device_count() {
        Ok(n) if n >= needed => Some(n),
        Ok(n) => {
            skip(&format!(
                "this machine has {n} GPU(s), the test needs {needed}"
            ));
            None
        }
        Err(e) => {
            skip(&e.to_string());
            None
        }
    }
}

/// cuobjdump (on `PATH` or in /usr/local/cuda/bin) where NVRTC is available too; else `None`
/// with the reason printed, or a failure under `COMMFUSE_REQUIRE_SASS=1`.
pub fn cuobjdump() -> Option<std::path::PathBuf> {
    let cuobjdump = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .chain([std::path::PathBuf::from("/usr/local/cuda/bin")])
        .map(|d| d.join("cuobjdump"))
        .find(|p| p.exists());
    let (Some(cuobjdump), true) = (cuobjdump, crate::sys::nvrtc::available()) else {
        assert!(
            std::env::var_os("COMMFUSE_REQUIRE_SASS").is_none(),
            "COMMFUSE_REQUIRE_SASS is set but cuobjdump or NVRTC is missing"
        );
        eprintln!("skipped: needs cuobjdump on PATH and NVRTC");
        return None;
    };
    Some(cuobjdump)
}

/// The SASS of the compiled parts of one kernel file, one after the other (`cuobjdump -sass`
/// of each cubin): for tests that compile a file once and read both ptxas's report and its SASS.
pub fn sass_of_compiled(
    cuobjdump: &std::path::Path,
    parts: &[crate::sys::nvrtc::Compiled],
) -> String {
    // (a number per file written, so that threads reading the same file's SASS never share one)
    static WRITTEN: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let mut sass = String::new();
    for compiled in parts {
        let path = std::env::temp_dir().join(format!(
            "commfuse-{}-{}-{}-{}.cubin",
            compiled.name.trim_end_matches(".cu"),
            compiled.part.unwrap_or(0),
            std::process::id(),
            WRITTEN.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        std::fs::write(&path, &compiled.cubin).expect("a temporary cubin");
        let out = std::process::Command::new(cuobjdump)
            .arg("-sass")
            .arg(&path)
            .output()
            .expect("cuobjdump runs");
        let _ = std::fs::remove_file(&path);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        sass.push_str(&String::from_utf8_lossy(&out.stdout));
    }
    sass
}

/// A Python virtual environment whose site-packages hold the NVRTC wheels of the folder that
/// `COMMFUSE_TEST_NVRTC_WHEELS` names (linked, not copied), for the tests of finding NVRTC
/// there; `None`, with the skip printed, where that variable is unset (a failure instead under
/// `COMMFUSE_REQUIRE_NVRTC`, which CI sets).
pub fn venv_with_nvrtc_wheels() -> Option<tempfile::TempDir> {
    let Some(wheels) = std::env::var_os("COMMFUSE_TEST_NVRTC_WHEELS") else {
        assert!(
            std::env::var_os("COMMFUSE_REQUIRE_NVRTC").is_none(),
            "COMMFUSE_REQUIRE_NVRTC is set but COMMFUSE_TEST_NVRTC_WHEELS is not"
        );
        eprintln!("skipped: COMMFUSE_TEST_NVRTC_WHEELS names no folder of NVRTC wheels");
        return None;
    };
    let venv = tempfile::tempdir().expect("a temporary folder");
    let site = venv.path().join("lib/python3.11/site-packages");
    std::fs::create_dir_all(&site).expect("a site-packages folder");
    std::os::unix::fs::symlink(
        std::path::Path::new(&wheels).join("nvidia"),
        site.join("nvidia"),
    )
    .expect("the wheels linked into site-packages");
    Some(venv)
}

/// The switch that lets GPU tests place more ranks than there are GPUs, ranks sharing them.
pub const SHARE_GPUS: &str = "COMMFUSE_SHARE_GPUS";

/// Whether `COMMFUSE_SHARE_GPUS=1` lets GPU tests place ranks on a GPU together.
pub fn sharing_gpus() -> bool {
    std::env::var(SHARE_GPUS).is_ok_and(|v| v == "1")
}

/// Devices for `p` ranks: GPUs 0..p where there are that many; else, under
/// `COMMFUSE_SHARE_GPUS=1`, the GPUs there are, round-robin (ranks sharing a GPU, as
/// `CudaBackend::open` allows); else `None` with the reason printed (not a skip of the test:
/// its other world sizes run), or a failure under `COMMFUSE_REQUIRE_GPU=1`. `None` (skipped,
/// see [`gpus`]) without any GPU.
///
/// Sharing is opt-in because it is best effort: ranks on one GPU need their kernels to run at
/// the same time, which CUDA does not promise — streams may share a hardware queue (there are
/// `CUDA_DEVICE_MAX_CONNECTIONS`, 8 by default), and a kernel queued behind a peer's spinning
/// kernel then waits until the device-side timeout (seen on one H200; CHANGELOG.md, "Ranks may share a GPU").
pub fn ranks_on_gpus(p: usize) -> Option<Vec<usize>> {
    let n = gpus(1)?;
    if n >= p {
        return Some((0..p).collect());
    }
    if sharing_gpus() {
        return Some((0..p).map(|r| r % n).collect());
    }
    let why = format!("P = {p} not run: {n} GPU(s) here; {SHARE_GPUS}=1 lets ranks share them");
    // a world size left out is a check not made: under COMMFUSE_REQUIRE_GPU=1 it fails
    skip_or_fail(gpu_required(), &why);
    None
}

/// GPUs 0 and 1 with peer access enabled both ways, or `None` (skipped, see [`gpus`]).
pub fn two_gpus() -> Option<Vec<std::sync::Arc<driver::Gpu>>> {
    gpus(2)?;
    Some(driver::open_group(&[0, 1]).expect("GPUs 0 and 1 with peer access"))
}

/// `len` values of `T` uniform in [-1, 1) from the project's indexable stream (`seed`,
/// `stream`), as the references draw them.
pub fn random<T: commfuse_core::Element>(len: usize, seed: u64, stream: usize) -> Vec<T> {
    use commfuse_core::reference::input_value;
    (0..len)
        .map(|i| T::from_f32(input_value(seed, stream, i, commfuse_core::ReduceOp::Sum)))
        .collect()
}

/// `host` copied into new device memory of `gpu` (at least 16 bytes, so that an empty slice
/// still has an address a kernel may be given).
pub fn upload<T: bytemuck::NoUninit>(gpu: &driver::Gpu, host: &[T]) -> driver::DeviceMemory {
    let mem = driver::DeviceMemory::zeroed(gpu, std::mem::size_of_val(host).max(16))
        .expect("device memory for a test");
    mem.upload(gpu, host).expect("upload");
    mem
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[should_panic(expected = "COMMFUSE_REQUIRE_GPU is set but: no GPU here")]
    fn a_required_gpu_turns_a_skip_into_a_failure() {
        skip_or_fail(true, "no GPU here");
    }

    #[test]
    fn without_the_switch_a_skip_returns() {
        skip_or_fail(false, "no GPU here");
    }
}
