//! NVRTC from the NVIDIA wheels on PyPI, found without `LD_LIBRARY_PATH`.
//!
//! `pip install nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-runtime==13.0.96` puts
//! `nvidia/cu13/lib/libnvrtc.so.13` and `nvidia/cu13/include/` into a Python environment's
//! site-packages, where the dynamic linker does not look. When `libnvrtc.so.13` cannot be loaded
//! by name, the site-packages of the active virtual or conda environment, of the user and of the
//! system (and, last, those the `python3` on `PATH` reports) are searched; the first copy found
//! is loaded by its full path and kept loaded, so that cudarc's later load by name finds the
//! library already in the process (the dynamic linker matches loaded libraries by soname).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The one command that installs what the kernels need.
pub const INSTALL: &str = "pip install nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-runtime==13.0.96";

/// Where the wheels' `nvidia/cu13` folder is, relative to a site-packages folder.
const CU13: &str = "nvidia/cu13";

static FOUND: OnceLock<Option<PathBuf>> = OnceLock::new();

/// Searches the Python environments once and loads the first NVRTC found there: the
/// `nvidia/cu13` folder it came from. For when loading by name failed.
pub fn load() -> Option<&'static Path> {
    FOUND.get_or_init(preload).as_deref()
}

/// The headers (`cuda_bf16.h` and the rest) beside the NVRTC [`load`] loaded, if it did.
pub fn include_dir() -> Option<PathBuf> {
    let dir = FOUND.get()?.as_ref()?.join("include");
    dir.join("cuda_bf16.h").exists().then_some(dir)
}

fn preload() -> Option<PathBuf> {
    // python3 is asked only when none of the usual folders holds a copy
    let cu13 = site_packages()
        .into_iter()
        .chain(std::iter::once_with(reported_by_python).flatten())
        .map(|sp| sp.join(CU13))
        .find(|d| d.join("lib/libnvrtc.so.13").is_file())?;
    // NVRTC loads its builtins by name when it compiles: they go first, from the same folder
    let builtins = std::fs::read_dir(cu13.join("lib"))
        .ok()?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("libnvrtc-builtins.so"))
        });
    for library in builtins.chain([cu13.join("lib/libnvrtc.so.13")]) {
        // SAFETY: loading runs only the libraries' initialisers
        let lib = unsafe {
            libloading::os::unix::Library::open(
                Some(&library),
                libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
            )
        }
        .ok()?;
        // kept loaded for the process's life: loads by name resolve to this copy
        std::mem::forget(lib);
    }
    Some(cu13)
}

/// The usual site-packages folders, most specific first.
fn site_packages() -> Vec<PathBuf> {
    let mut prefixes: Vec<PathBuf> = ["VIRTUAL_ENV", "CONDA_PREFIX"]
        .iter()
        .filter_map(|v| std::env::var_os(v).map(PathBuf::from))
        .map(|p| p.join("lib"))
        .collect();
    if let Some(home) = std::env::var_os("HOME") {
        prefixes.push(PathBuf::from(home).join(".local/lib"));
    }
    prefixes.extend(["/usr/local/lib", "/usr/lib"].map(PathBuf::from));
    let mut found = Vec::new();
    for lib in prefixes {
        let Ok(entries) = std::fs::read_dir(&lib) else {
            continue;
        };
        let mut pythons: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("python3"))
            })
            .collect();
        pythons.sort();
        for python in pythons {
            found.push(python.join("site-packages"));
            found.push(python.join("dist-packages"));
        }
    }
    found
}

/// The site-packages folders of the `python3` on `PATH` (nothing when there is none).
fn reported_by_python() -> Vec<PathBuf> {
    let script = "import site, sys\n\
                  paths = list(getattr(site, 'getsitepackages', lambda: [])())\n\
                  paths.append(site.getusersitepackages())\n\
                  print('\\n'.join(paths))";
    std::process::Command::new("python3")
        .args(["-c", script])
        .stderr(std::process::Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .map(PathBuf::from)
                .collect()
        })
        .unwrap_or_default()
}
