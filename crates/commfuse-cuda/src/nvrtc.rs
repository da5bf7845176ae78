//! Kernels are CUDA C++ files embedded in the binary and compiled by NVRTC for `sm_90a` on first
//! use. Cubins are cached in memory and on disk, keyed by a hash of the sources, the options and
//! the NVRTC version, so a second run loads in milliseconds. NVRTC needs no GPU: CI compiles
//! every kernel with the NVRTC of the PyPI wheels and fails on a compile error.

use crate::error::CudaError;
use cudarc::nvrtc::sys;
use std::collections::HashMap;
use std::ffi::{c_char, CStr, CString};
use std::hash::{Hash, Hasher};
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

/// The architecture every kernel is built for (wgmma and setmaxnreg need the `a` variant).
pub const ARCH: &str = "sm_90a";

/// An embedded CUDA source file.
#[derive(Debug, Clone, Copy)]
pub struct Source {
    pub name: &'static str,
    pub text: &'static str,
}

/// Headers every kernel may include by name.
pub const HEADERS: &[Source] = &[Source {
    name: "common.cuh",
    text: include_str!("../kernels/common.cuh"),
}];

/// Every kernel file of the crate, for `commfuse kernels` and the CI compile check.
pub const KERNELS: &[Source] = &[
    Source {
        name: "plan.cu",
        text: include_str!("../kernels/plan.cu"),
    },
    Source {
        name: "gemm.cu",
        text: include_str!("../kernels/gemm.cu"),
    },
    Source {
        name: "reference_gemm.cu",
        text: include_str!("../kernels/reference_gemm.cu"),
    },
];

pub fn kernel(name: &str) -> Option<Source> {
    KERNELS.iter().copied().find(|k| k.name == name)
}

/// A compiled kernel file: its cubin and what ptxas said (registers, spills).
#[derive(Debug, Clone)]
pub struct Compiled {
    pub name: &'static str,
    pub cubin: Vec<u8>,
    pub log: String,
    pub from_cache: bool,
}

/// Whether the NVRTC library can be loaded (cudarc panics on use otherwise).
pub fn available() -> bool {
    // SAFETY: only tries to dlopen the library
    unsafe { sys::is_culib_present() }
}

fn version() -> Result<(i32, i32), CudaError> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: plain out-parameters
    let rc = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    if rc != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(CudaError::Nvrtc(format!("nvrtcVersion failed: {rc:?}")));
    }
    Ok((major, minor))
}

fn options() -> Vec<String> {
    let mut opts = vec![
        format!("--gpu-architecture={ARCH}"),
        "--std=c++17".to_string(),
        "-default-device".to_string(),
        "--ptxas-options=-v".to_string(),
        "-lineinfo".to_string(),
    ];
    if let Ok(dir) = std::env::var("COMMFUSE_CUDA_INCLUDE") {
        opts.push(format!("--include-path={dir}"));
    }
    for dir in ["/usr/local/cuda/include", "/usr/local/cuda-13.0/include"] {
        if std::path::Path::new(dir).join("cuda_bf16.h").exists() {
            opts.push(format!("--include-path={dir}"));
        }
    }
    opts
}

fn cache_dir() -> Option<PathBuf> {
    if let Ok(dir) = std::env::var("COMMFUSE_KERNEL_CACHE") {
        return Some(PathBuf::from(dir));
    }
    std::env::var_os("HOME").map(|h| {
        PathBuf::from(h)
            .join(".cache")
            .join("commfuse")
            .join("kernels")
    })
}

fn cache_key(source: &Source, opts: &[String], version: (i32, i32)) -> String {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    source.text.hash(&mut h);
    for header in HEADERS {
        header.text.hash(&mut h);
    }
    opts.hash(&mut h);
    version.hash(&mut h);
    format!(
        "{}-{:016x}.cubin",
        source.name.trim_end_matches(".cu"),
        h.finish()
    )
}

fn memory_cache() -> &'static Mutex<HashMap<String, Compiled>> {
    static CACHE: OnceLock<Mutex<HashMap<String, Compiled>>> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

fn check(rc: sys::nvrtcResult, what: &str) -> Result<(), CudaError> {
    if rc == sys::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(CudaError::Nvrtc(format!("{what} failed: {rc:?}")))
    }
}

/// Compiles `source` (or finds it in a cache). `fresh` skips the caches (for the compile report).
pub fn compile(source: Source, fresh: bool) -> Result<Compiled, CudaError> {
    if !available() {
        return Err(CudaError::Unavailable(
            "NVRTC (libnvrtc.so.13) was not found: install CUDA 13.0 or the nvidia-cuda-nvrtc wheel and put its lib folder on LD_LIBRARY_PATH".into(),
        ));
    }
    let opts = options();
    let key = cache_key(&source, &opts, version()?);
    if !fresh {
        if let Some(hit) = memory_cache().lock().unwrap().get(&key) {
            return Ok(hit.clone());
        }
        if let Some(path) = cache_dir().map(|d| d.join(&key)) {
            if let Ok(cubin) = std::fs::read(&path) {
                let compiled = Compiled {
                    name: source.name,
                    cubin,
                    log: String::new(),
                    from_cache: true,
                };
                memory_cache().lock().unwrap().insert(key, compiled.clone());
                return Ok(compiled);
            }
        }
    }
    let compiled = compile_uncached(source, &opts)?;
    if let Some(dir) = cache_dir() {
        // a cache that cannot be written only costs a recompilation next time
        if std::fs::create_dir_all(&dir).is_ok() {
            let _ = std::fs::write(dir.join(&key), &compiled.cubin);
        }
    }
    memory_cache().lock().unwrap().insert(key, compiled.clone());
    Ok(compiled)
}

fn compile_uncached(source: Source, opts: &[String]) -> Result<Compiled, CudaError> {
    let text = CString::new(source.text).expect("kernel sources hold no NUL");
    let name = CString::new(source.name).unwrap();
    let header_texts: Vec<CString> = HEADERS
        .iter()
        .map(|h| CString::new(h.text).unwrap())
        .collect();
    let header_names: Vec<CString> = HEADERS
        .iter()
        .map(|h| CString::new(h.name).unwrap())
        .collect();
    let header_text_ptrs: Vec<*const c_char> = header_texts.iter().map(|c| c.as_ptr()).collect();
    let header_name_ptrs: Vec<*const c_char> = header_names.iter().map(|c| c.as_ptr()).collect();
    let c_opts: Vec<CString> = opts
        .iter()
        .map(|o| CString::new(o.as_str()).unwrap())
        .collect();
    let opt_ptrs: Vec<*const c_char> = c_opts.iter().map(|c| c.as_ptr()).collect();
    let mut prog: sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: every pointer refers to a live NUL-terminated string for the duration of the calls
    unsafe {
        check(
            sys::nvrtcCreateProgram(
                &mut prog,
                text.as_ptr(),
                name.as_ptr(),
                HEADERS.len() as i32,
                header_text_ptrs.as_ptr(),
                header_name_ptrs.as_ptr(),
            ),
            "nvrtcCreateProgram",
        )?;
        let rc = sys::nvrtcCompileProgram(prog, opt_ptrs.len() as i32, opt_ptrs.as_ptr());
        let log = program_log(prog);
        if rc != sys::nvrtcResult::NVRTC_SUCCESS {
            sys::nvrtcDestroyProgram(&mut prog);
            return Err(CudaError::Compile {
                name: source.name.to_string(),
                log,
            });
        }
        let mut size = 0usize;
        check(sys::nvrtcGetCUBINSize(prog, &mut size), "nvrtcGetCUBINSize")?;
        let mut cubin = vec![0u8; size];
        check(
            sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut c_char),
            "nvrtcGetCUBIN",
        )?;
        sys::nvrtcDestroyProgram(&mut prog);
        Ok(Compiled {
            name: source.name,
            cubin,
            log,
            from_cache: false,
        })
    }
}

/// # Safety
/// `prog` must be a live program.
unsafe fn program_log(prog: sys::nvrtcProgram) -> String {
    let mut size = 0usize;
    if sys::nvrtcGetProgramLogSize(prog, &mut size) != sys::nvrtcResult::NVRTC_SUCCESS || size == 0
    {
        return String::new();
    }
    let mut buf = vec![0 as c_char; size];
    if sys::nvrtcGetProgramLog(prog, buf.as_mut_ptr()) != sys::nvrtcResult::NVRTC_SUCCESS {
        return String::new();
    }
    CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned()
}
