//! Kernels are CUDA C++ files embedded in the binary and compiled by NVRTC for `sm_90a` on first
//! use. Cubins are cached in memory and on disk ([`DiskCache`]: verified entries, atomic
//! writes), keyed by a SHA-256 of the source, the embedded headers, the CUDA headers they
//! include, the options and NVRTC's full version, so a second run loads in milliseconds. NVRTC
//! needs no GPU: CI compiles every kernel with the NVRTC of the PyPI wheels and fails on a
//! compile error.

use crate::error::CudaError;
use cudarc::nvrtc::sys;
use std::collections::HashMap;
use std::ffi::{c_char, CStr, CString};
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

mod cache;
pub mod wheels;
pub use cache::{CacheKey, DiskCache, Miss};

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
    text: include_str!("common.cuh"),
}];

/// Every kernel file of the crate, for `commfuse kernels` and the CI compile check.
pub const KERNELS: &[Source] = &[
    Source {
        name: "plan.cu",
        text: include_str!("../backend/plan.cu"),
    },
    Source {
        name: "gemm.cu",
        text: include_str!("../gemm/gemm.cu"),
    },
    Source {
        name: "reference_gemm.cu",
        text: include_str!("../gemm/reference_gemm.cu"),
    },
    Source {
        name: "gemm_rs.cu",
        text: include_str!("../gemm_rs/gemm_rs.cu"),
    },
    Source {
        name: "ll.cu",
        text: include_str!("../collective/ll.cu"),
    },
    Source {
        name: "ce.cu",
        text: include_str!("../collective/ce.cu"),
    },
];

pub fn kernel(name: &str) -> Option<Source> {
    KERNELS.iter().copied().find(|k| k.name == name)
}

/// Files compiled in parts, and how many: each part is the file with `-DCOMMFUSE_PART=i`,
/// which keeps some of its entry points (gemm.cu: one build's entries for one input type a
/// part; its comment says which). One NVRTC program runs on one core, and ptxas over gemm.cu's
/// every entry takes minutes; its parts compile side by side ([`compile_parts`]). gemm.cu's
/// last part is its helper kernels'.
const SPLIT: &[(&str, u32)] = &[("gemm.cu", crate::gemm::GEMM_HELPER_PART + 1)];

/// How many parts [`compile_parts`] compiles `source` in (1: the whole file as one program).
pub fn parts_of(source: Source) -> u32 {
    SPLIT
        .iter()
        .find(|(name, _)| *name == source.name)
        .map_or(1, |&(_, parts)| parts)
}

/// A compiled kernel file: its cubin and what ptxas said (registers, spills).
#[derive(Debug, Clone)]
pub struct Compiled {
    pub name: &'static str,
    /// Which part of a file compiled in parts ([`parts_of`]); none: the whole file
    pub part: Option<u32>,
    pub cubin: Vec<u8>,
    pub log: String,
    pub from_cache: bool,
}

/// What ptxas reported for one function of a compiled file: an entry point or a callee it kept
/// out of line (`--ptxas-options=-v` prints a block for each).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FunctionResources {
    /// The function's (possibly mangled) name.
    pub name: String,
    /// Whether it is a kernel entry point (`Compiling entry function`).
    pub entry: bool,
    pub stack_frame_bytes: u64,
    pub spill_store_bytes: u64,
    pub spill_load_bytes: u64,
}

impl FunctionResources {
    /// Whether ptxas had to spill registers to local memory in this function.
    pub fn spills(&self) -> bool {
        self.spill_store_bytes > 0 || self.spill_load_bytes > 0
    }
}

/// Every function of a ptxas `-v` log with its stack frame and spills, in the log's order.
/// ptxas prints `Function properties for NAME` followed by a line such as
/// `8 bytes stack frame, 4 bytes spill stores, 8 bytes spill loads`; entry points are the names
/// of its `Compiling entry function 'NAME'` lines. A function whose figures line is missing is
/// left out (so a check over the result also asks that every entry point is present).
pub fn ptxas_functions(log: &str) -> Vec<FunctionResources> {
    let entries: Vec<&str> = log
        .lines()
        .filter_map(|l| l.split("Compiling entry function '").nth(1))
        .filter_map(|rest| rest.split('\'').next())
        .collect();
    let mut functions = Vec::new();
    let mut current: Option<&str> = None;
    for line in log.lines() {
        if let Some(name) = line.split("Function properties for ").nth(1) {
            current = Some(name.trim());
            continue;
        }
        let Some(name) = current else { continue };
        if !line.contains("bytes stack frame") {
            continue;
        }
        current = None;
        // "ptxas . 8 bytes stack frame, 4 bytes spill stores, 8 bytes spill loads"
        let figure = |label: &str| -> Option<u64> {
            line.split(',')
                .find(|part| part.trim_end().ends_with(label))
                .and_then(|part| {
                    part.trim_end()
                        .strip_suffix(label)?
                        .split_whitespace()
                        .last()?
                        .parse()
                        .ok()
                })
        };
        if let (Some(stack), Some(stores), Some(loads)) = (
            figure("bytes stack frame"),
            figure("bytes spill stores"),
            figure("bytes spill loads"),
        ) {
            functions.push(FunctionResources {
                name: name.to_string(),
                entry: entries.contains(&name),
                stack_frame_bytes: stack,
                spill_store_bytes: stores,
                spill_load_bytes: loads,
            });
        }
    }
    functions
}

/// Whether the NVRTC library can be loaded (cudarc panics on use otherwise). Decided once per
/// process: threads that compile side by side must not see a wheel's NVRTC loaded by another
/// thread (loadable by name from then on) before that thread has recorded the wheel's folder,
/// whose headers [`options`] names; they wait for the first answer instead.
pub fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        // SAFETY: only tries to dlopen the library
        if unsafe { sys::is_culib_present() } {
            return true;
        }
        // not on the library path: a pip-installed copy, loaded by its full path
        // SAFETY: as above
        wheels::load().is_some() && unsafe { sys::is_culib_present() }
    })
}

/// NVRTC's full version: `nvrtcVersion` gives only major.minor, so the comment block that
/// heads the PTX of an empty program supplies the rest ("Compiler Build ID: CL-…", "Cuda
/// compilation tools, release 13.0, V13.0.88", the NVVM version). One small compile per process.
fn nvrtc_version() -> Result<String, CudaError> {
    static VERSION: OnceLock<Result<String, String>> = OnceLock::new();
    VERSION
        .get_or_init(|| probe_version().map_err(|e| e.to_string()))
        .clone()
        .map_err(CudaError::Nvrtc)
}

fn probe_version() -> Result<String, CudaError> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: plain out-parameters
    check(
        unsafe { sys::nvrtcVersion(&mut major, &mut minor) },
        "nvrtcVersion",
    )?;
    let text = CString::new("").unwrap();
    let name = CString::new("version.cu").unwrap();
    let arch = CString::new("--gpu-architecture=compute_90").unwrap();
    let opts = [arch.as_ptr()];
    let mut prog: sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: every pointer refers to a live NUL-terminated string for the duration of the calls
    let ptx = unsafe {
        check(
            sys::nvrtcCreateProgram(
                &mut prog,
                text.as_ptr(),
                name.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            ),
            "nvrtcCreateProgram",
        )?;
        let ptx = (|| {
            check(
                sys::nvrtcCompileProgram(prog, 1, opts.as_ptr()),
                "nvrtcCompileProgram (version probe)",
            )?;
            let mut size = 0usize;
            check(sys::nvrtcGetPTXSize(prog, &mut size), "nvrtcGetPTXSize")?;
            let mut buf = vec![0 as c_char; size.max(1)];
            check(sys::nvrtcGetPTX(prog, buf.as_mut_ptr()), "nvrtcGetPTX")?;
            Ok::<_, CudaError>(CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned())
        })();
        sys::nvrtcDestroyProgram(&mut prog);
        ptx?
    };
    let banner: Vec<&str> = ptx
        .lines()
        .take_while(|l| l.starts_with("//"))
        .filter(|l| l.len() > 2)
        .collect();
    Ok(format!("NVRTC {major}.{minor}\n{}", banner.join("\n")))
}

/// The options of `part` of a file (none: the whole file).
fn options_for(part: Option<u32>) -> Vec<String> {
    let mut opts = options();
    if let Some(part) = part {
        opts.push(format!("-DCOMMFUSE_PART={part}"));
    }
    opts
}

fn options() -> Vec<String> {
    let mut opts = vec![
        format!("--gpu-architecture={ARCH}"),
        "--std=c++17".to_string(),
        "-default-device".to_string(),
        "--ptxas-options=-v".to_string(),
        "-lineinfo".to_string(),
        // the one maximum world size, also sizing the kernels' per-rank arrays
        format!("-DCOMMFUSE_MAX_RANKS={}", commfuse_core::MAX_WORLD_SIZE),
    ];
    if let Ok(dir) = std::env::var("COMMFUSE_CUDA_INCLUDE") {
        opts.push(format!("--include-path={dir}"));
    } else if let Some(dir) = wheels::include_dir() {
        // the headers of the wheel whose NVRTC was loaded
        opts.push(format!("--include-path={}", dir.display()));
    }
    for dir in ["/usr/local/cuda/include", "/usr/local/cuda-13.0/include"] {
        if std::path::Path::new(dir).join("cuda_bf16.h").exists() {
            opts.push(format!("--include-path={dir}"));
        }
    }
    opts
}

/// The disk-cache key of `source` under this process's options and NVRTC.
pub fn cache_key(source: Source) -> Result<CacheKey, CudaError> {
    ensure_available()?;
    Ok(key_for(source, &options(), &nvrtc_version()?))
}

fn key_for(source: Source, opts: &[String], version: &str) -> CacheKey {
    let include_dirs: Vec<PathBuf> = opts
        .iter()
        .filter_map(|o| o.strip_prefix("--include-path="))
        .map(PathBuf::from)
        .collect();
    let texts: Vec<&str> = std::iter::once(source.text)
        .chain(HEADERS.iter().map(|h| h.text))
        .collect();
    // the CUDA headers (cuda_bf16.h, …) come from the include folders: a different copy at the
    // same path must not reuse a cubin built from the old one
    let included = cache::included_files(&texts, &include_dirs);
    let mut inputs: Vec<&[u8]> = vec![source.name.as_bytes(), source.text.as_bytes()];
    for header in HEADERS {
        inputs.extend([header.name.as_bytes(), header.text.as_bytes()]);
    }
    let included: Vec<(String, Vec<u8>)> = included
        .into_iter()
        .map(|(path, bytes)| (path.display().to_string(), bytes))
        .collect();
    for (path, bytes) in &included {
        inputs.extend([path.as_bytes(), bytes.as_slice()]);
    }
    inputs.extend(opts.iter().map(|o| o.as_bytes()));
    inputs.push(version.as_bytes());
    CacheKey::new(source.name, &inputs)
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

fn ensure_available() -> Result<(), CudaError> {
    if available() {
        Ok(())
    } else {
        Err(CudaError::Unavailable(
            format!(
                "NVRTC (libnvrtc.so.13) was found neither on the library path nor in a Python environment: `{}` (or put CUDA 13.0's lib folder on LD_LIBRARY_PATH)",
                wheels::INSTALL
            ),
        ))
    }
}

/// Compiles `source` as one program (or finds it in the memory cache, then in
/// [`DiskCache::from_env`]). `fresh` skips the caches (for the compile report) and refreshes
/// the disk entry.
pub fn compile(source: Source, fresh: bool) -> Result<Compiled, CudaError> {
    compile_program(source, None, fresh)
}

/// Compiles every part of `source` ([`parts_of`]) side by side, one thread each, as
/// [`compile`] does (caches included); in the order of the parts. A file not split is one part:
/// the whole file.
pub fn compile_parts(source: Source, fresh: bool) -> Result<Vec<Compiled>, CudaError> {
    let parts = parts_of(source);
    if parts == 1 {
        return Ok(vec![compile(source, fresh)?]);
    }
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..parts)
            .map(|part| scope.spawn(move || compile_program(source, Some(part), fresh)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(CudaError::Nvrtc(format!(
                        "compiling a part of {} stopped unexpectedly",
                        source.name
                    )))
                })
            })
            .collect()
    })
}

fn compile_program(source: Source, part: Option<u32>, fresh: bool) -> Result<Compiled, CudaError> {
    ensure_available()?;
    let opts = options_for(part);
    let key = key_for(source, &opts, &nvrtc_version()?);
    if !fresh {
        if let Some(hit) = memory_cache().lock().unwrap().get(key.file_name()) {
            return Ok(hit.clone());
        }
    }
    let compiled = match (DiskCache::from_env(), fresh) {
        (Some(disk), false) => compile_with_key(source, part, &opts, &disk, &key)?,
        (disk, _) => {
            let compiled = compile_uncached(source, part, &opts)?;
            if let Some(disk) = disk {
                // a cache that cannot be written only costs a recompilation next time
                let _ = disk.store(&key, &compiled.cubin);
            }
            compiled
        }
    };
    memory_cache()
        .lock()
        .unwrap()
        .insert(key.file_name().to_string(), compiled.clone());
    Ok(compiled)
}

/// Loads `source`'s cubin from `disk` if its entry verifies; otherwise compiles it and
/// overwrites the entry (atomically: a concurrent compile of the same kernel also succeeds).
/// Bypasses the memory cache.
pub fn compile_with_cache(source: Source, disk: &DiskCache) -> Result<Compiled, CudaError> {
    ensure_available()?;
    let opts = options();
    let key = key_for(source, &opts, &nvrtc_version()?);
    compile_with_key(source, None, &opts, disk, &key)
}

fn compile_with_key(
    source: Source,
    part: Option<u32>,
    opts: &[String],
    disk: &DiskCache,
    key: &CacheKey,
) -> Result<Compiled, CudaError> {
    // a missing or invalid entry (truncated, corrupted, another key's) is recompiled below
    if let Ok(cubin) = disk.load_verified(key) {
        return Ok(Compiled {
            name: source.name,
            part,
            cubin,
            log: String::new(),
            from_cache: true,
        });
    }
    let compiled = compile_uncached(source, part, opts)?;
    // a cache that cannot be written only costs a recompilation next time
    let _ = disk.store(key, &compiled.cubin);
    Ok(compiled)
}

fn compile_uncached(
    source: Source,
    part: Option<u32>,
    opts: &[String],
) -> Result<Compiled, CudaError> {
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
                name: match part {
                    Some(part) => format!("{} (part {part})", source.name),
                    None => source.name.to_string(),
                },
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
            part,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// An excerpt of ptxas's report for gemm.cu before the f32 epilogue stopped spilling.
    const GEMM_LOG: &str = "\
ptxas info    : 57 bytes gmem
ptxas info    : Compiling entry function 'tile_snapshot' for 'sm_90a'
ptxas info    : Function properties for tile_snapshot
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 20 registers, used 1 barriers, 16 bytes smem
ptxas info    : Compiling entry function 'gemm_f16_kn_f32' for 'sm_90a'
ptxas info    : Function properties for gemm_f16_kn_f32
ptxas         .     8 bytes stack frame, 4 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 168 registers, used 3 barriers, 8 bytes cumulative stack size
ptxas info    : Compile time = 1089.508 ms
ptxas info    : Function properties for _Z16pipeline_stalledILi0EEvRK10GemmParamsjjj
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function 'gemm_f16_kn_f16' for 'sm_90a'
ptxas info    : Function properties for gemm_f16_kn_f16
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 3 barriers
";

    #[test]
    fn ptxas_log_parses_per_function() {
        let functions = ptxas_functions(GEMM_LOG);
        let names: Vec<&str> = functions.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "tile_snapshot",
                "gemm_f16_kn_f32",
                "_Z16pipeline_stalledILi0EEvRK10GemmParamsjjj",
                "gemm_f16_kn_f16"
            ]
        );
        assert_eq!(
            functions[1],
            FunctionResources {
                name: "gemm_f16_kn_f32".into(),
                entry: true,
                stack_frame_bytes: 8,
                spill_store_bytes: 4,
                spill_load_bytes: 8,
            }
        );
        assert!(!functions[2].entry, "a callee is not an entry point");
        let spilling: Vec<&str> = functions
            .iter()
            .filter(|f| f.spills())
            .map(|f| f.name.as_str())
            .collect();
        // one entry's spill is found although another entry reports " 0 bytes spill stores"
        assert_eq!(spilling, ["gemm_f16_kn_f32"]);
    }

    #[test]
    fn key_covers_version_options_and_included_headers() {
        let plan = kernel("plan.cu").unwrap();
        let dir = tempfile::tempdir().unwrap();
        // common.cuh includes these two; a different copy at the same path must change the key
        std::fs::write(dir.path().join("cuda_bf16.h"), "#include \"cuda_fp16.h\"\n").unwrap();
        std::fs::write(dir.path().join("cuda_fp16.h"), "// fp16 v1\n").unwrap();
        let opts = vec![format!("--include-path={}", dir.path().display())];
        let version = "NVRTC 13.0\n// Cuda compilation tools, release 13.0, V13.0.88";
        let key = key_for(plan, &opts, version);
        assert_eq!(key, key_for(plan, &opts, version));
        assert_ne!(key, key_for(plan, &opts, &version.replace("88", "76")));
        let more = [opts.clone(), vec!["-lineinfo".to_string()]].concat();
        assert_ne!(key, key_for(plan, &more, version));
        std::fs::write(dir.path().join("cuda_fp16.h"), "// fp16 v2\n").unwrap();
        assert_ne!(key, key_for(plan, &opts, version));
        assert_ne!(key, key_for(kernel("gemm.cu").unwrap(), &opts, version));
    }

    #[test]
    fn version_names_the_full_release() {
        if !available() {
            assert!(
                std::env::var_os("COMMFUSE_REQUIRE_NVRTC").is_none(),
                "COMMFUSE_REQUIRE_NVRTC is set but libnvrtc.so.13 cannot be loaded"
            );
            eprintln!("skipped: NVRTC (libnvrtc.so.13) is not on the library path");
            return;
        }
        let version = nvrtc_version().unwrap();
        // e.g. "Cuda compilation tools, release 13.0, V13.0.88" and "Compiler Build ID: CL-…"
        assert!(version.contains("compilation tools"), "{version}");
        assert!(version.contains("Build ID"), "{version}");
    }

    #[test]
    fn ptxas_log_without_figures_yields_nothing() {
        assert!(ptxas_functions("").is_empty());
        let cut = "ptxas info    : Function properties for k\nptxas info    : Used 3 registers\n";
        assert!(ptxas_functions(cut).is_empty());
    }
}
