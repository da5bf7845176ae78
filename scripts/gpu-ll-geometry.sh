#!/usr/bin/env bash
# The LL all-reduce (`auto` up to 1 MiB) under other launch shapes (COMMFUSE_LL_THREADS × COMMFUSE_LL_MAX_BLOCKS),
# graph-replayed beside NCCL, one bench per shape (each shape's rows interleaved with NCCL's).
# Run on the GPU machine after gpu-prepare.sh: bash scripts/gpu-ll-geometry.sh  (results in $OUT)
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 COMMFUSE_KERNEL_CACHE="$PWD/.gpu/kernel-cache"
OUT=${OUT:-/tmp/commfuse-out}
mkdir -p "$OUT"
for shape in ${LL_SHAPES:-512x64 256x128 256x132 128x256 512x128}; do
  t=${shape%x*} b=${shape#*x}
  for g in --graph ""; do
    name=ll-$t-$b${g:+-graph}
    COMMFUSE_LL_THREADS=$t COMMFUSE_LL_MAX_BLOCKS=$b timeout 120 .gpu/commfuse bench all-reduce --devices 0,1 \
      --algo auto --dtype bf16 --sizes ${LL_SIZES:-16K,64K,256K,1M} --warmup 5 --iters 50 $g >"$OUT/$name.txt" 2>&1
    echo "== $name rc=$?" | tee -a "$OUT/summary.txt"
    grep -v "^#" "$OUT/$name.txt" | tail -12 | tee -a "$OUT/summary.txt"
  done
done
