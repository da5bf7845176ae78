# Sourced (from the repository root) by the scripts that run on the GPU machine:
# scripts/gpu-check.sh, and a device script whose results are kept under docs/results/. The
# environment the GPU tests and benches expect, the results
# folder $R under $OUT with log() writing its summary, and the kernel cache that
# scripts/gpu-prepare.sh compiled where Rust is (.gpu/kernel-cache.txz), unpacked so that no
# time limit on this machine pays for compiling gemm.cu (minutes on one core).
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
# never NVLink multicast on these machines
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export COMMFUSE_KERNEL_CACHE="$PWD/.gpu/kernel-cache"
# a GPU test that cannot find its GPUs fails here instead of reporting a skip as a pass
export COMMFUSE_REQUIRE_GPU=1
# the command line's tests run the binary built beside them
export COMMFUSE_BIN="$PWD/.gpu/commfuse"
OUT=${OUT:-/tmp/commfuse-out}
R=$OUT/results
mkdir -p "$R"
B=.gpu/commfuse
log() { echo "== $*" | tee -a "$OUT/summary.txt"; }
. scripts/kernel-cache.sh
unpack_kernel_cache .gpu
