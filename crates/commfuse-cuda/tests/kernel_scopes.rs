//! The kernels' atomics on memory that several GPUs (and the host) share are system scope: in
//! their SASS every compare-and-swap (the error record, claimed by whichever waiter on
//! whichever GPU times out first) is `.SYS`, never `.GPU`, which would order only one GPU's
//! threads. Needs NVRTC and cuobjdump, no GPU; COMMFUSE_REQUIRE_SASS=1 makes a skip a failure.

use commfuse_cuda::testing::sass_of;

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
