#!/usr/bin/env bash
# One GPU, from the repository root, after run.sh (the release binary and the kernel cache
# only): a second pass of the rank rows at 8192 x 8192 x 3584, and the shapes run.sh's time
# left out, 8192 x 8192 x 14336 and 2048 x 8192 x 3584; the wide build beside the main
# build's rank rows, every element of every row checked.
set -u
. scripts/gpu-env.sh
R=$OUT/results-2
mkdir -p "$R"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit --format=csv >"$R/gpus.txt" 2>&1
for s in 8192x8192x3584 8192x8192x14336 2048x8192x3584; do
  set -- ${s//x/ }
  f=$1x$2x$3-nk
  timeout 150 $B bench gemm --m $1 --n $2 --k $3 --b-layout nk --sms 0 --peer none \
    --builds ping-pong-wide --rs-ranks 2,4,8 --warmup 10 --iters 30 --json "$R/$f.json" >"$R/$f.txt" 2>&1
  log "$f rc=$? at $SECONDS s"
  grep -E "^ *(cublas|commfuse)|WRONG" "$R/$f.txt" | cut -c1-112 | tee -a "$OUT/summary.txt"
  tar czf "$OUT/results.tgz" -C "$OUT" results-2 summary.txt
done
