#!/usr/bin/env bash
# One GPU, from the repository root (`scripts/gpu-prepare.sh` first, where Rust is; here the
# release binary, the GPU tests, a broken test binary and the kernel cache): the wide ping-pong
# build's fold by the fold map (TMA boxes into its warpgroups' box buffers). First the rank
# rows' GPU test (every element of every row against float64, flags checked; the wide rows at
# P = 2, 3 and 5 fold by the map); then the same test from a binary whose boxes of a tile's
# second half load the first half's rows (`.gpu/tests/gpu_gemm_broken`: it must fail); then
# the fused kernel as rank 0 of 2, 4 and 8 on the wide build beside the main and the direct
# build's rank rows at the K = 3584 shapes and 4096 x 12288 x 24576; then where the rank row's
# time goes by Nsight Compute's counters (scripts/gpu-check.sh rank-ncu on the wide build);
# last, the rank rows at 8192 x 8192 x 14336.
set -u
. scripts/gpu-env.sh
pack() { tar czf "$OUT/results.tgz" -C "$OUT" results summary.txt; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit --format=csv >"$R/gpus.txt" 2>&1
t0=$SECONDS
timeout 200 .gpu/tests/gpu_gemm --exact rank_rows_pass_the_check --test-threads 1 >"$R/test-gpu_gemm-rank_rows.txt" 2>&1
log "gpu_gemm rank_rows rc=$? in $((SECONDS - t0)) s $(grep -E '^test result' "$R/test-gpu_gemm-rank_rows.txt")"
grep -E '^test .*FAILED|panicked' -A2 "$R/test-gpu_gemm-rank_rows.txt" | head -20 | cut -c1-400 | tee -a "$OUT/summary.txt"
pack
t0=$SECONDS
timeout 200 .gpu/tests/gpu_gemm_broken --exact rank_rows_pass_the_check --test-threads 1 >"$R/test-gpu_gemm-broken.txt" 2>&1
log "gpu_gemm (second half's boxes from the first half's rows) rank_rows rc=$? in $((SECONDS - t0)) s"
grep -E 'panicked|left:|right:' -A1 "$R/test-gpu_gemm-broken.txt" | head -8 | cut -c1-400 | tee -a "$OUT/summary.txt"
pack
run() {  # shape
  set -- ${1//x/ }
  f=$1x$2x$3-nk
  timeout 200 $B bench gemm --m $1 --n $2 --k $3 --b-layout nk --sms 0 --peer none \
    --builds ping-pong-wide --rs-ranks 2,4,8 --warmup 10 --iters 30 --json "$R/$f.json" >"$R/$f.txt" 2>&1
  log "$f rc=$? at $SECONDS s"
  grep -E "^ *(cublas|commfuse)|WRONG" "$R/$f.txt" | grep -E "cublas|commfuse  |commfuse-ping|wide|rs. " | cut -c1-112 | tee -a "$OUT/summary.txt"
  pack
}
for s in 8192x8192x3584 16384x8192x3584 4096x12288x24576; do
  run $s
done
OUT=$OUT/ncu RANK_NCU=8192x8192x3584 RANK_NCU_BUILD=ping-pong-wide timeout 200 bash scripts/gpu-check.sh rank-ncu >/dev/null 2>&1
log "rank-ncu rc=$? at $SECONDS s"
pack() { tar czf "$OUT/results.tgz" -C "$OUT" results summary.txt ncu; }
pack
run 8192x8192x14336
