//! The plan kernel's atomics on memory that several GPUs (and the host) share are system scope:
//! in its SASS every compare-and-swap (the error record, claimed by whichever waiter on
//! whichever GPU times out first) is `.SYS`, never `.GPU`, which would order only one GPU's
//! threads. Needs NVRTC and cuobjdump, no GPU; COMMFUSE_REQUIRE_SASS=1 makes a skip a failure.

use commfuse_cuda::nvrtc;

fn cuobjdump() -> Option<std::path::PathBuf> {
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .chain([std::path::PathBuf::from("/usr/local/cuda/bin")])
        .map(|d| d.join("cuobjdump"))
        .find(|p| p.exists())
}

#[test]
fn the_plan_kernels_compare_and_swap_is_system_scope() {
    let (Some(cuobjdump), true) = (cuobjdump(), nvrtc::available()) else {
        assert!(
            std::env::var_os("COMMFUSE_REQUIRE_SASS").is_none(),
            "COMMFUSE_REQUIRE_SASS is set but cuobjdump or NVRTC is missing"
        );
        eprintln!("skipped: needs cuobjdump on PATH and NVRTC");
        return;
    };
    let compiled = nvrtc::compile(nvrtc::kernel("plan.cu").unwrap(), false).unwrap();
    let path = std::env::temp_dir().join(format!("commfuse-plan-{}.cubin", std::process::id()));
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
    let cas: Vec<&str> = sass.lines().filter(|l| l.contains(".CAS")).collect();
    assert!(
        !cas.is_empty(),
        "no compare-and-swap in the plan kernel's SASS"
    );
    let narrow: Vec<&str> = cas
        .iter()
        .copied()
        .filter(|l| !l.contains(".SYS"))
        .collect();
    assert!(
        narrow.is_empty(),
        "compare-and-swap below system scope:\n{}",
        narrow.join("\n")
    );
}
