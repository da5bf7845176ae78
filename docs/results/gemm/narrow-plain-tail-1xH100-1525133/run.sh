#!/usr/bin/env bash
# One GPU, from the repository root (`scripts/gpu-prepare.sh` first, where Rust is): the GPU
# tests of the bench's rank rows (the fused GEMM + reduce-scatter's kernel as rank 0 of P on
# one GPU) and of the narrow builds' plain entries with the split tail, the rank rows' test
# once more from a binary whose check leaves the last partial out (it must fail), then bench
# gemm of `auto` beside cuBLASLt and the general entry at decode sizes whose narrow tiles are
# cut along K, two passes.
set -u
. scripts/gpu-env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv >"$R/gpus.txt" 2>&1
for t in rank_rows narrow_builds narrow_deep_build narrow_sliced_build; do
  t0=$SECONDS
  timeout 240 .gpu/tests/gpu_gemm $t --test-threads 1 >"$R/test-gpu_gemm-$t.txt" 2>&1
  log "gpu_gemm $t rc=$? in $((SECONDS - t0)) s $(grep -E '^test result' "$R/test-gpu_gemm-$t.txt")"
  grep -E '^test .*FAILED|panicked' -A2 "$R/test-gpu_gemm-$t.txt" | head -20 | cut -c1-300 | tee -a "$OUT/summary.txt"
done
t0=$SECONDS
timeout 120 .gpu/tests/gpu_gemm_broken rank_rows --test-threads 1 >"$R/test-gpu_gemm-broken.txt" 2>&1
log "gpu_gemm (check without the last partial) rank_rows rc=$? in $((SECONDS - t0)) s"
grep -E 'panicked|left:|right:' -A1 "$R/test-gpu_gemm-broken.txt" | head -8 | cut -c1-300 | tee -a "$OUT/summary.txt"
for pass in 1 2; do
  for s in 16x4096x4096 64x4096x4096 16x2048x8192 32x2048x4096 128x2048x4096; do
    set -- ${s//x/ }
    for layout in nk kn; do
      f=$s-$layout-$pass
      timeout 60 .gpu/commfuse bench gemm --m $1 --n $2 --k $3 --b-layout $layout --sms 0 --peer none \
        --builds none --warmup 10 --iters 30 --json "$R/$f.json" >"$R/$f.txt" 2>&1
      log "$f rc=$?"
      grep -E "^ *(cublas|commfuse)" "$R/$f.txt" | cut -c1-112 | tee -a "$OUT/summary.txt"
    done
  done
done
tar czf "$OUT/results.tgz" -C "$OUT" results && rm -rf "$R"
