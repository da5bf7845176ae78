#!/usr/bin/env bash
# One GPU, from the repository root (`scripts/gpu-prepare.sh` first, where Rust is): GEMMs with
# a bias, whose calls on the direct build run its routed entry, beside the same build through
# its general entry (`commfuse-general`), the main build and cuBLASLt's bias epilogue; three
# shapes, two passes each, passes in turns.
set -u
# the kernel cache comes xz-packed
python3 -c "import tarfile; tarfile.open('.gpu/kernel-cache.txz').extractall('.gpu')"
. scripts/gpu-env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv >"$R/gpus.txt" 2>&1
for pass in 1 2; do
  for s in 8192x8192x3584:nk 8192x8192x3584:kn 2048x8192x3584:nk; do
    l=${s#*:}
    s=${s%:*}
    set -- ${s//x/ }
    f=bias-$s-$l-$pass
    timeout 60 .gpu/commfuse bench gemm --m $1 --n $2 --k $3 --b-layout $l --sms 0 --builds main,direct \
      --peer none --bias --warmup 10 --iters 30 --json "$R/$f.json" >"$R/$f.txt" 2>&1
    log "$f rc=$? at $SECONDS s"
    grep -E "^ *(cublas|commfuse)" "$R/$f.txt" | cut -c1-100 | tee -a "$OUT/summary.txt"
  done
done
tar czf "$OUT/results.tgz" -C "$OUT" results && rm -rf "$R"
