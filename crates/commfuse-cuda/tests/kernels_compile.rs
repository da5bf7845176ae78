//! Every kernel compiles for sm_90a under NVRTC, and what its report and SASS must show
//! (no spills, the GEMM's HGMMA, system-scope atomics). Needs no GPU, only libnvrtc (and
//! cuobjdump for the SASS): CI installs the PyPI wheels and sets COMMFUSE_REQUIRE_NVRTC=1 and
//! COMMFUSE_REQUIRE_SASS=1 so that a missing tool fails instead of skipping.

use commfuse_cuda::sys::nvrtc;

/// Whether NVRTC can be used; prints the skip (or fails under COMMFUSE_REQUIRE_NVRTC) if not.
fn nvrtc_here() -> bool {
    if nvrtc::available() {
        return true;
    }
    assert!(
        std::env::var_os("COMMFUSE_REQUIRE_NVRTC").is_none(),
        "COMMFUSE_REQUIRE_NVRTC is set but libnvrtc.so.13 cannot be loaded"
    );
    eprintln!("skipped: NVRTC (libnvrtc.so.13) is not on the library path");
    false
}

/// Every kernel file compiled once in this process, as the kernels load it (gemm.cu in parts,
/// side by side), with ptxas's report: the tests of this file read their reports and their SASS
/// from these, so that gemm.cu (minutes of ptxas) compiles once for all of them.
fn compiled() -> &'static [(nvrtc::Source, Vec<nvrtc::Compiled>)] {
    static COMPILED: std::sync::OnceLock<Vec<(nvrtc::Source, Vec<nvrtc::Compiled>)>> =
        std::sync::OnceLock::new();
    COMPILED.get_or_init(|| {
        nvrtc::KERNELS
            .iter()
            .map(|source| {
                let parts = nvrtc::compile_parts(*source, true).unwrap_or_else(|e| panic!("{e}"));
                (*source, parts)
            })
            .collect()
    })
}

/// The SASS of kernel file `kernel` from [`compiled`], or `None` (with the skip printed, a
/// failure under COMMFUSE_REQUIRE_SASS) where cuobjdump or NVRTC is missing.
fn sass_of(kernel: &str) -> Option<String> {
    let cuobjdump = commfuse_cuda::testing::cuobjdump()?;
    let (_, parts) = compiled()
        .iter()
        .find(|(source, _)| source.name == kernel)
        .unwrap_or_else(|| panic!("no kernel {kernel}"));
    Some(commfuse_cuda::testing::sass_of_compiled(&cuobjdump, parts))
}

#[test]
fn every_kernel_compiles_for_sm90a() {
    if !nvrtc_here() {
        return;
    }
    for compiled in compiled().iter().flat_map(|(_, parts)| parts) {
        let source = compiled.name;
        let name = format!("{source} (part {:?})", compiled.part);
        assert!(compiled.cubin.len() > 1000, "{name}: empty cubin");
        check_part_entries(compiled);
        // ptxas reports every function (entry points and out-of-line callees): none may spill
        let functions = nvrtc::ptxas_functions(&compiled.log);
        let entries = compiled.log.matches("Compiling entry function").count();
        assert!(entries > 0, "{}: no entry point in\n{}", name, compiled.log);
        assert_eq!(
            functions.iter().filter(|f| f.entry).count(),
            entries,
            "{}: an entry point without its spill figures in\n{}",
            name,
            compiled.log
        );
        let spilling: Vec<String> = functions
            .iter()
            .filter(|f| f.spills() && !spill_allowed(f))
            .map(|f| {
                format!(
                    "{} ({} bytes spill stores, {} bytes spill loads)",
                    f.name, f.spill_store_bytes, f.spill_load_bytes
                )
            })
            .collect();
        assert!(
            spilling.is_empty(),
            "{}: registers spilled in {}",
            name,
            spilling.join(", ")
        );
        // ptxas serialises a function's wgmma when it cannot prove them warpgroup-uniform
        // (a wgmma under a branch on the thread index, say): performance note C7520
        let serialised: Vec<&str> = compiled
            .log
            .lines()
            .filter(|l| {
                l.contains("C7520") || l.contains("wgmma.mma_async instructions are serialized")
            })
            .collect();
        assert!(
            serialised.is_empty(),
            "{}: ptxas serialised warpgroup MMAs:\n{}",
            name,
            serialised.join("\n")
        );
        eprintln!("{name}:\n{}", compiled.log);
    }
}

/// The spills allowed: the tile loop's counter (one word: 8 bytes of spill stores at its two
/// writes, 16 of loads) in the direct build's general and routed entries of 16-bit outputs,
/// which fold partials through their stages and store the tiles by boxes along routes. It is
/// read and written a few times a tile, outside the k-loop (`GEMM-NOTES.md`, "The direct build
/// with routes"). And the wide ping-pong build's general and routed entries, whose every option
/// beside 192 accumulators a thread spills (up to 1.3 KiB with f32 outputs; the routed ones
/// the routes' stores from registers and, in the k-loop, the pipeline's stage and phase):
/// `auto` sends the general ones only calls with a bias (measured faster than the direct
/// build's all the same), the routed ones only GEMM + reduce-scatter's calls on that build
/// where named, and the plain entries, which serve every other call `auto` sends that build,
/// spill nothing
/// (`GEMM-NOTES.md`, "The wide ping-pong build"); beside that build's producer (40 registers) the
/// out-of-line stall report (`pipeline_stalled`, run once where a pipeline wait gives up, never
/// in a call that completes) reloads one word, and its copy called where the routed entries'
/// first storer waits for a warpgroup's stores (`raise_routed_flags`, in the same warpgroup)
/// spills 32 bytes. Anything else fails.
fn spill_allowed(f: &nvrtc::FunctionResources) -> bool {
    if f.name.contains("pipeline_stalled") {
        return f.spill_store_bytes <= 32 && f.spill_load_bytes <= 32;
    }
    let general = !f.name.contains("_plain");
    if f.name.starts_with("gemm_ping_pong_wide_") {
        return general;
    }
    let name = f.name.strip_suffix("_routed").unwrap_or(&f.name);
    let general_direct_16 = name.starts_with("gemm_direct_")
        && general
        && (name.ends_with("_bf16") || name.ends_with("_f16"));
    general_direct_16 && f.spill_store_bytes <= 8 && f.spill_load_bytes <= 16
}

/// A part of gemm.cu holds the entries the loader looks for in it
/// ([`commfuse_cuda::gemm::gemm_part`]): one build's for one input type, or the helper
/// kernels in the last; the whole file's parts hold every entry once.
fn check_part_entries(compiled: &nvrtc::Compiled) {
    use commfuse_core::DType;
    use commfuse_cuda::gemm::{gemm_part, GemmVariant, GEMM_HELPER_PART};
    let Some(part) = compiled.part else {
        return;
    };
    assert_eq!(compiled.name, "gemm.cu", "only gemm.cu compiles in parts");
    let entries: Vec<String> = nvrtc::ptxas_functions(&compiled.log)
        .into_iter()
        .filter(|f| f.entry)
        .map(|f| f.name)
        .collect();
    let mut expected: Vec<String> = Vec::new();
    for variant in GemmVariant::ALL {
        for input in [DType::BF16, DType::F16] {
            if gemm_part(variant, input) == part {
                expected.extend(variant.entry_names(input));
            }
        }
    }
    if part == GEMM_HELPER_PART {
        expected.extend(["tile_snapshot", "hold_sms", "raise_flags_paced"].map(String::from));
    }
    let mut found = entries;
    found.sort();
    expected.sort();
    assert_eq!(found, expected, "gemm.cu part {part}: its entry points");
}

/// The GEMM's main loop must run on the tensor cores' warpgroup instructions: every GEMM entry
/// point's SASS holds HGMMA with f32 accumulation (transposed B for the [K, N] layout) of its
/// build's tile width: 64x256x16 in the main, the skinny, the pair and the direct build, 64x128x16 in the
/// mid, the mid-direct, the ping-pong and the short build (at least eight a k-block in the
/// ping-pong builds: two 64-row halves), 64x192x16 in the wide ping-pong build, 64x64x16 in
/// the narrow, the narrow-tall, the narrow-deep and the narrow-sliced
/// one, and no HGMMA of another width; the pair build's B reaches both blocks of its cluster by
/// TMA multicast (UTMALDG.2D.MULTICAST); the narrow-sliced build's warpgroups hand their sums
/// over at named barriers that one side arrives at without waiting (BAR.ARV), which no other
/// build uses; the builds that store their tiles themselves decide whether the block gave up
/// by a reduction at each consumer warpgroup's barrier (BAR.RED.OR), which no other build uses;
/// no k-loop (the innermost loop around the HGMMA) reads the clock, which only the trace's
/// stamps do; a plain entry (`_plain`: every option but alpha compiled out; `_plain_tail`: the
/// same with the split tail) has at most half the instructions of its build's general entry. Needs NVRTC and cuobjdump (+ nvdisasm); CI installs both from PyPI and sets
/// COMMFUSE_REQUIRE_SASS=1.
#[test]
fn gemm_sass_uses_hgmma() {
    let Some(sass) = sass_of("gemm.cu") else {
        return;
    };
    let (mut entries, mut skinny, mut narrow, mut tall, mut pair, mut mid) = (0, 0, 0, 0, 0, 0);
    let (mut direct, mut narrow_deep, mut narrow_sliced, mut ping_pong) = (0, 0, 0, 0);
    let (mut short, mut wide) = (0, 0);
    // each entry's instruction count, for the plain entries' beside their general ones
    let mut sizes = std::collections::HashMap::new();
    for section in sass.split("Function : ").skip(1) {
        let name = section.split_whitespace().next().unwrap_or("");
        if !name.starts_with("gemm_") {
            continue;
        }
        entries += 1;
        sizes.insert(name, sass_code(section).len());
        let shape = if name.starts_with("gemm_ping_pong_wide_") {
            wide += 1;
            "HGMMA.64x192x16.F32"
        } else if name.starts_with("gemm_narrow_") {
            narrow += 1;
            tall += usize::from(name.starts_with("gemm_narrow_tall_"));
            narrow_deep += usize::from(name.starts_with("gemm_narrow_deep_"));
            narrow_sliced += usize::from(name.starts_with("gemm_narrow_sliced_"));
            "HGMMA.64x64x16.F32"
        } else if ["gemm_mid_", "gemm_ping_pong_", "gemm_short_"]
            .iter()
            .any(|p| name.starts_with(p))
        {
            mid += usize::from(name.starts_with("gemm_mid_"));
            ping_pong += usize::from(name.starts_with("gemm_ping_pong_"));
            short += usize::from(name.starts_with("gemm_short_"));
            "HGMMA.64x128x16.F32"
        } else {
            skinny += usize::from(name.starts_with("gemm_skinny_"));
            direct += usize::from(name.starts_with("gemm_direct_"));
            if name.starts_with("gemm_pair_") {
                pair += 1;
                assert!(
                    section
                        .lines()
                        .any(|l| l.contains("UTMALDG") && l.contains("MULTICAST")),
                    "{name}: no multicast TMA load in its SASS"
                );
            }
            "HGMMA.64x256x16.F32"
        };
        assert_eq!(
            section.contains("BAR.ARV"),
            name.starts_with("gemm_narrow_sliced_"),
            "{name}: arrivals at a named barrier (the sliced build's hand-over) in its SASS"
        );
        // the builds whose consumers store their own tiles decide once per warpgroup whether
        // the block gave up (group_stopped: a reduction at the warpgroup's barrier), so that
        // no warp goes on into the epilogue's barriers alone; no other build reduces
        let stores_directly = [
            "gemm_direct_",
            "gemm_ping_pong_",
            "gemm_mid_direct_",
            "gemm_narrow_",
            "gemm_short_",
        ]
        .iter()
        .any(|p| name.starts_with(p))
            && !name.starts_with("gemm_narrow_sliced_");
        assert_eq!(
            section.contains("BAR.RED.OR"),
            stores_directly,
            "{name}: the stop decided by a barrier reduction in its SASS"
        );
        let all: Vec<&str> = section.lines().filter(|l| l.contains("HGMMA.")).collect();
        let hgmma: Vec<&str> = all.iter().copied().filter(|l| l.contains(shape)).collect();
        let least = if name.starts_with("gemm_ping_pong_") {
            8
        } else {
            4
        };
        assert!(
            hgmma.len() >= least,
            "{name}: {} {shape} in its SASS",
            hgmma.len()
        );
        assert_eq!(
            hgmma.len(),
            all.len(),
            "{name}: HGMMA of another shape than {shape}"
        );
        if name.contains("_kn_") {
            assert!(
                hgmma.iter().all(|l| l.contains("tnspB")),
                "{name}: B not transposed"
            );
        }
        // nothing of the trace (its clock reads) inside a k-loop: predicated off in untraced
        // calls, it was still issued every k-block, ahead of the wgmmas
        let loops = k_loops(section);
        assert!(!loops.is_empty(), "{name}: no loop around its HGMMA");
        for body in loops {
            assert!(
                !body.iter().any(|l| l.contains("SR_CLOCKLO")),
                "{name}: a clock read inside the k-loop"
            );
        }
    }
    // (the builds that store their tiles themselves have 8 plain entries beside their 12, the
    // direct, narrow, narrow-deep, narrow-tall and short builds 8 more with the split tail, and
    // the direct and the wide ping-pong build 4 routed ones each)
    assert_eq!(entries, 268, "GEMM entry points found in the SASS");
    assert_eq!(
        wide, 24,
        "wide ping-pong GEMM entry points found in the SASS"
    );
    assert_eq!(short, 28, "short GEMM entry points found in the SASS");
    assert_eq!(
        ping_pong, 20,
        "ping-pong GEMM entry points found in the SASS"
    );
    assert_eq!(
        narrow_deep, 28,
        "narrow-deep GEMM entry points found in the SASS"
    );
    assert_eq!(
        narrow_sliced, 12,
        "narrow-sliced GEMM entry points found in the SASS"
    );
    assert_eq!(direct, 32, "direct GEMM entry points found in the SASS");
    // (the mid-direct build's names start as the mid build's)
    assert_eq!(mid, 32, "mid GEMM entry points found in the SASS");
    assert_eq!(pair, 12, "pair GEMM entry points found in the SASS");
    assert_eq!(skinny, 12, "skinny GEMM entry points found in the SASS");
    assert_eq!(narrow, 96, "narrow GEMM entry points found in the SASS");
    assert_eq!(tall, 28, "narrow-tall GEMM entry points found in the SASS");
    let mut plain = 0;
    for (name, &size) in &sizes {
        use commfuse_cuda::gemm::{PLAIN_SUFFIX, PLAIN_TAIL_SUFFIX};
        let Some(general) = name
            .strip_suffix(PLAIN_TAIL_SUFFIX)
            .or_else(|| name.strip_suffix(PLAIN_SUFFIX))
        else {
            continue;
        };
        plain += 1;
        let general_size = sizes[general];
        assert!(
            2 * size <= general_size,
            "{name}: {size} instructions, its general entry {general_size}: the options not compiled out"
        );
    }
    assert_eq!(plain, 104, "plain GEMM entry points found in the SASS");
}

/// The instructions of an entry's SASS: "/*1a70*/   SYNCS... ;" lines, their address and the
/// line.
fn sass_code(section: &str) -> Vec<(u64, &str)> {
    section
        .lines()
        .filter_map(|l| {
            let rest = l.trim_start().strip_prefix("/*")?;
            let (addr, _) = rest.split_once("*/")?;
            Some((u64::from_str_radix(addr, 16).ok()?, l))
        })
        .collect()
}

/// The innermost loops of an entry's SASS that hold HGMMA: for each HGMMA, the shortest range
/// from a backward branch's target to that branch that contains it (the instructions' lines).
fn k_loops(section: &str) -> Vec<Vec<&str>> {
    let code = sass_code(section);
    let target = |l: &str| {
        let at = l.find("BRA ")? + 4;
        let hex = l[at..].trim_start().strip_prefix("0x")?;
        let end = hex
            .find(|c: char| !c.is_ascii_hexdigit())
            .unwrap_or(hex.len());
        u64::from_str_radix(&hex[..end], 16).ok()
    };
    let back: Vec<(u64, u64)> = code
        .iter()
        .filter_map(|&(a, l)| target(l).filter(|&t| t <= a).map(|t| (t, a)))
        .collect();
    let mut loops: Vec<(u64, u64)> = code
        .iter()
        .filter(|(_, l)| l.contains("HGMMA."))
        .filter_map(|&(a, _)| {
            back.iter()
                .copied()
                .filter(|&(t, b)| t <= a && a <= b)
                .min_by_key(|&(t, b)| b - t)
        })
        .collect();
    loops.sort();
    loops.dedup();
    loops
        .into_iter()
        .map(|(t, b)| {
            code.iter()
                .filter(|&&(a, _)| t <= a && a <= b)
                .map(|&(_, l)| l)
                .collect()
        })
        .collect()
}

#[test]
fn k_loops_are_found_in_sass() {
    let sass = "\
        /*0100*/                   MOV R1, R2 ;
        /*0110*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R57+URZ], R20 ;
        /*0120*/               @P0 BRA 0x110 ;
        /*0130*/                   CS2R R22, SR_CLOCKLO ;
        /*0140*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0150*/              @!P1 BRA 0x100 ;
        /*0160*/                   CS2R R22, SR_CLOCKLO ;
        /*0170*/                   BRA 0x100 ;
";
    let loops = k_loops(sass);
    assert_eq!(loops.len(), 1);
    assert_eq!(loops[0].len(), 6);
    assert!(loops[0].iter().any(|l| l.contains("SR_CLOCKLO")));
    assert!(k_loops("        /*0100*/   HGMMA.64x64x16.F32.BF16 R24 ;\n").is_empty());
}

/// The small kernel file the cache tests compile.
fn plan_source() -> nvrtc::Source {
    nvrtc::kernel("plan.cu").unwrap()
}

/// A truncated entry, then one whose cubin has a flipped bit, are both recompiled and
/// overwritten; the rewritten entry is then used.
#[test]
fn disk_cache_recompiles_a_bad_entry() {
    if !nvrtc_here() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let disk = nvrtc::DiskCache::new(dir.path());
    let key = nvrtc::cache_key(plan_source()).unwrap();
    let path = disk.path(&key);
    std::fs::write(&path, b"CFCUBIN\x01 cut short by a crash").unwrap();
    let first = nvrtc::compile_with_cache(plan_source(), &disk).unwrap();
    assert!(!first.from_cache, "a truncated entry was used");
    assert_eq!(
        disk.load_verified(&key).unwrap(),
        first.cubin,
        "not overwritten"
    );

    let mut bytes = std::fs::read(&path).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
    let second = nvrtc::compile_with_cache(plan_source(), &disk).unwrap();
    assert!(!second.from_cache, "an entry with a wrong hash was used");
    assert_eq!(disk.load_verified(&key).unwrap(), second.cubin);

    let third = nvrtc::compile_with_cache(plan_source(), &disk).unwrap();
    assert!(third.from_cache, "a valid entry was not used");
    assert_eq!(third.cubin, second.cubin);
}

/// Set by `two_processes_compile_into_one_fresh_cache` for the copies of this test binary it
/// starts: the folder they compile plan.cu into.
const RACE_DIR: &str = "COMMFUSE_TEST_CACHE_RACE_DIR";

/// Two processes find the same fresh cache folder empty, both compile and both store: both must
/// succeed and leave one valid entry and no temporary file.
#[test]
fn two_processes_compile_into_one_fresh_cache() {
    if std::env::var_os(RACE_DIR).is_some() || !nvrtc_here() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..2)
        .map(|_| {
            std::process::Command::new(&exe)
                .args(["--exact", "race_child_compiles_into_the_shared_cache"])
                .env(RACE_DIR, dir.path())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for child in children {
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "a compiling process failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("1 passed"),
            "the child ran no test"
        );
    }
    let disk = nvrtc::DiskCache::new(dir.path());
    let key = nvrtc::cache_key(plan_source()).unwrap();
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(names, [key.file_name()], "one entry and no temporary file");
    assert!(disk.load_verified(&key).unwrap().len() > 1000);
}

/// One of the processes of `two_processes_compile_into_one_fresh_cache` (does nothing when run
/// on its own).
#[test]
fn race_child_compiles_into_the_shared_cache() {
    let Some(dir) = std::env::var_os(RACE_DIR) else {
        return;
    };
    let disk = nvrtc::DiskCache::new(dir);
    let compiled = nvrtc::compile_with_cache(plan_source(), &disk).unwrap();
    assert!(compiled.cubin.len() > 1000);
}

/// Set in the child processes of `threads_finding_nvrtc_in_a_python_environment_agree_on_its_headers`.
const WHEEL_CHILD: &str = "COMMFUSE_TEST_WHEEL_THREADS";

/// Processes that find NVRTC only in a Python environment (no library path), each with 32
/// threads asking for a kernel's cache key at once, as the parts of gemm.cu do when they
/// compile side by side: every thread must get the key whose options name the wheel's headers.
/// None may see NVRTC, once another thread has loaded it from the wheel, before that thread has
/// recorded the wheel's folder (then it compiled without the headers: 4 processes of 40 did,
/// before `nvrtc::available` was decided once per process).
#[test]
fn threads_finding_nvrtc_in_a_python_environment_agree_on_its_headers() {
    if std::env::var_os(WHEEL_CHILD).is_some() {
        return;
    }
    let Some(venv) = commfuse_cuda::testing::venv_with_nvrtc_wheels() else {
        return;
    };
    let exe = std::env::current_exe().unwrap();
    for process in 0..40 {
        let out = std::process::Command::new(&exe)
            .args(["--exact", "wheel_child_threads_get_one_cache_key"])
            .env(WHEEL_CHILD, "1")
            .env_remove("LD_LIBRARY_PATH")
            .env_remove("COMMFUSE_CUDA_INCLUDE")
            .env_remove("CONDA_PREFIX")
            .env("PATH", "/nonexistent")
            .env("HOME", "/nonexistent")
            .env("VIRTUAL_ENV", venv.path())
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("1 passed"),
            "process {process}:\n{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// One process of `threads_finding_nvrtc_in_a_python_environment_agree_on_its_headers` (does
/// nothing when run on its own).
#[test]
fn wheel_child_threads_get_one_cache_key() {
    if std::env::var_os(WHEEL_CHILD).is_none() {
        return;
    }
    let start = std::sync::Barrier::new(32);
    let keys: Vec<String> = std::thread::scope(|scope| {
        let threads: Vec<_> = (0..32)
            .map(|_| {
                scope.spawn(|| {
                    start.wait();
                    nvrtc::cache_key(plan_source())
                        .map(|k| k.file_name().to_string())
                        .unwrap_or_else(|e| format!("no key: {e}"))
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    });
    assert!(keys.iter().all(|k| *k == keys[0]), "{keys:?}");
}

/// The kernels' atomics on memory that several GPUs (and the host) share are system scope: in
/// their SASS every compare-and-swap (the error record, claimed by whichever waiter on
/// whichever GPU times out first) is `.SYS`, never `.GPU`, which would order only one GPU's
/// threads. Needs NVRTC and cuobjdump, no GPU; COMMFUSE_REQUIRE_SASS=1 makes a skip a failure.
#[test]
fn every_compare_and_swap_on_shared_records_is_system_scope() {
    // plan.cu claims the error record in its waits; gemm.cu in its stalled pipelines and fold
    // waits; gemm_rs.cu, ll.cu and ce.cu in their waits (gemm_rs.cu and ce.cu through common.cuh)
    for kernel in ["plan.cu", "gemm.cu", "gemm_rs.cu", "ll.cu", "ce.cu"] {
        let Some(sass) = sass_of(kernel) else { return };
        check_cas(kernel, &sass);
    }
}

fn check_cas(kernel: &str, sass: &str) {
    let cas: Vec<&str> = sass.lines().filter(|l| l.contains(".CAS")).collect();
    assert!(!cas.is_empty(), "{kernel}: no compare-and-swap in its SASS");
    let narrow: Vec<&str> = cas
        .iter()
        .copied()
        .filter(|l| !l.contains(".SYS"))
        .collect();
    assert!(
        narrow.is_empty(),
        "{kernel}: compare-and-swap below system scope:\n{}",
        narrow.join("\n")
    );
}
