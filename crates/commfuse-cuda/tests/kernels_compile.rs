//! Every kernel compiles for sm_90a under NVRTC. Needs no GPU, only libnvrtc: CI installs the
//! PyPI wheels and sets COMMFUSE_REQUIRE_NVRTC=1 so that a missing NVRTC fails instead of skipping.

use commfuse_cuda::nvrtc;

#[test]
fn every_kernel_compiles_for_sm90a() {
    if !nvrtc::available() {
        assert!(
            std::env::var_os("COMMFUSE_REQUIRE_NVRTC").is_none(),
            "COMMFUSE_REQUIRE_NVRTC is set but libnvrtc.so.13 cannot be loaded"
        );
        eprintln!("skipped: NVRTC (libnvrtc.so.13) is not on the library path");
        return;
    }
    for source in nvrtc::KERNELS {
        let compiled = nvrtc::compile(*source, true).unwrap_or_else(|e| panic!("{e}"));
        assert!(compiled.cubin.len() > 1000, "{}: empty cubin", source.name);
        // ptxas reports every function (entry points and out-of-line callees): none may spill
        let functions = nvrtc::ptxas_functions(&compiled.log);
        let entries = compiled.log.matches("Compiling entry function").count();
        assert!(
            entries > 0,
            "{}: no entry point in\n{}",
            source.name,
            compiled.log
        );
        assert_eq!(
            functions.iter().filter(|f| f.entry).count(),
            entries,
            "{}: an entry point without its spill figures in\n{}",
            source.name,
            compiled.log
        );
        let spilling: Vec<String> = functions
            .iter()
            .filter(|f| f.spills())
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
            source.name,
            spilling.join(", ")
        );
        eprintln!("{}:\n{}", source.name, compiled.log);
    }
}

/// The GEMM's main loop must run on the tensor cores' warpgroup instructions: every GEMM entry
/// point's SASS holds HGMMA 64x256x16 with f32 accumulation (transposed B for the [K, N]
/// layout). Needs NVRTC and cuobjdump (+ nvdisasm); CI installs both from PyPI and sets
/// COMMFUSE_REQUIRE_SASS=1.
#[test]
fn gemm_sass_uses_hgmma() {
    let cuobjdump = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .chain([std::path::PathBuf::from("/usr/local/cuda/bin")])
        .map(|d| d.join("cuobjdump"))
        .find(|p| p.exists());
    let (Some(cuobjdump), true) = (cuobjdump, nvrtc::available()) else {
        assert!(
            std::env::var_os("COMMFUSE_REQUIRE_SASS").is_none(),
            "COMMFUSE_REQUIRE_SASS is set but cuobjdump or NVRTC is missing"
        );
        eprintln!("skipped: needs cuobjdump on PATH and NVRTC");
        return;
    };
    let compiled = nvrtc::compile(nvrtc::kernel("gemm.cu").unwrap(), false).unwrap();
    let path = std::env::temp_dir().join(format!("commfuse-gemm-{}.cubin", std::process::id()));
    std::fs::write(&path, &compiled.cubin).unwrap();
    let out = std::process::Command::new(&cuobjdump)
        .arg("-sass")
        .arg(&path)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&path);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let sass = String::from_utf8_lossy(&out.stdout);
    let mut entries = 0;
    for section in sass.split("Function : ").skip(1) {
        let name = section.split_whitespace().next().unwrap_or("");
        if !name.starts_with("gemm_") {
            continue;
        }
        entries += 1;
        let hgmma = section
            .lines()
            .filter(|l| l.contains("HGMMA.64x256x16.F32"))
            .collect::<Vec<_>>();
        assert!(
            hgmma.len() >= 4,
            "{name}: {} HGMMA in its SASS",
            hgmma.len()
        );
        if name.contains("_kn_") {
            assert!(
                hgmma.iter().all(|l| l.contains("tnspB")),
                "{name}: B not transposed"
            );
        }
    }
    assert_eq!(entries, 12, "GEMM entry points found in the SASS");
}
