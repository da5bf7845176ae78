#!/usr/bin/env bash
# One GPU, .gpu/ from scripts/gpu-prepare.sh at 5641460 (its kernel cache compiled beside it, as
# .gpu/kernel-cache.tgz); from the repository root on the GPU machine: the GEMM's GPU test
# suite, then our GEMM (the build `auto` takes) beside cuBLASLt at the fourteen shapes of the
# table (gpu-check.sh gemm-one, no forced builds). Results in $OUT (results.tgz, summary.txt).
[ -f .gpu/kernel-cache.tgz ] && tar xzf .gpu/kernel-cache.tgz -C .gpu
TESTS=gpu_gemm GEMM_FLAGS="--builds none" bash scripts/gpu-check.sh tests,gemm-one
