#!/usr/bin/env bash
# One GPU, from the repository root (`scripts/gpu-prepare.sh` first, where Rust is): the ring
# rows' GPU test (with rows whose partials are asked of L2 eight k-blocks ahead); then the rank
# rows of 2, 4 and 8 ranks, the fused path's and the ring's, on the main and the direct build,
# each again with its partials asked of L2 4, 8 and 16 k-blocks before a tile's end: a second
# pass at the three shapes of the first, a first at the other three GEMM + reduce-scatter
# shapes.
set -u
# the kernel cache comes xz-packed
python3 -c "import tarfile; tarfile.open('.gpu/kernel-cache.txz').extractall('.gpu')"
. scripts/gpu-env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv >"$R/gpus.txt" 2>&1
t0=$SECONDS
timeout 150 .gpu/tests/gpu_gemm ring_rank_rows --test-threads 1 >"$R/test-gpu_gemm-ring.txt" 2>&1
log "gpu_gemm ring_rank_rows rc=$? in $((SECONDS - t0)) s $(grep -E '^test result' "$R/test-gpu_gemm-ring.txt")"
grep -E '^test .*FAILED|panicked' -A2 "$R/test-gpu_gemm-ring.txt" | head -10 | cut -c1-300 | tee -a "$OUT/summary.txt"
for s in 1024x8192x3584:2 2048x8192x3584:2 8192x8192x3584:2 512x4096x4096:1 8192x8192x14336:1 4096x12288x24576:1; do
  pass=${s#*:}
  s=${s%:*}
  set -- ${s//x/ }
  f=$s-nk-$pass
  timeout 120 .gpu/commfuse bench gemm --m $1 --n $2 --k $3 --b-layout nk --sms 0 --peer none \
    --builds main,direct --rs-ranks 2,4,8 --rs-ring --rs-prefetch 4,8,16 --warmup 10 --iters 30 --json "$R/$f.json" >"$R/$f.txt" 2>&1
  log "$f rc=$? at $SECONDS s"
  grep -E "^ *(cublas|commfuse)" "$R/$f.txt" | grep -v -- "-general" | cut -c1-100 | tee -a "$OUT/summary.txt"
done
tar czf "$OUT/results.tgz" -C "$OUT" results && rm -rf "$R"
