#!/usr/bin/env bash
# Everything the GPU machine is for, in one call: compile report, the GPU test suite, the
# correctness matrix, and the benchmark sweeps with NCCL beside ours. Results go to $OUT as one
# archive plus a summary (the device tool brings back at most 8 files).
#
# Prepare where Rust is:     bash scripts/gpu-prepare.sh   (release binary + test binaries into .gpu/)
# Run on the GPU machine:    bash scripts/gpu-check.sh [full|check|gemm|bench|gemm,bench|...]
#                            with .gpu/ copied beside the checkout
set -uo pipefail
# the environment, $OUT/results as $R, log(), the kernel cache
. scripts/gpu-env.sh
# check: GPU tests, verify (every mode starts with the compile report)      gemm: our GEMM beside cuBLASLt at four shapes (two GPUs)
# gemm-one: our GEMM beside cuBLASLt on one GPU at twenty shapes, both B layouts, decode sizes included
# bench: the link's ceilings (scripts/link-ceilings.py), the collectives beside NCCL (and graph replay), calibration
# gemm-rs: GEMM + reduce-scatter beside cuBLASLt and cuBLASLt + NCCL at six shapes
# ag-gemm: all-gather + GEMM beside cuBLASLt and NCCL + cuBLASLt at the same six shapes (or AG_SHAPES)
# torch: the Python package from PyTorch (pytest, torch_cuda.py and examples/tp_train.py on every GPU,
#        the host-time bench, examples/tp_mlp.py on two)
# host-time: the host-time bench alone (HOST_TIME_FLAGS="--rounds 9" passes flags)
# tests: the GPU test binaries only (TESTS="gpu_gemm gpu_gemm_rs" picks some)     full: all of them
# small: small all-reduces / reduce-scatters by LL and LL16 beside NCCL, graphs and eager, with and without programmatic launch
# fixed-cost: our GEMM's time per tile beside its k-blocks: 8192x8192xK for K from 256 to 14336
#             (main, direct and `auto` with the next tile's first k-blocks asked of L2 ahead,
#             beside cuBLASLt; time = waves x (fixed + k-blocks x per-k-block)), then Nsight
#             Compute's stall sampling of the direct build at K = 512 and 3584 (FIXED_KS, NEXT_PREFETCH);
#             the mid and the ping-pong build beside them (FIXED_BUILDS): the same split for 128x128 tiles
# builds: the GPU tests of the builds `auto` does not take yet and of the direct build (BUILD_TESTS, name filters of the
#         gpu_gemm suite), then every build's row beside cuBLASLt at decode and large shapes (BUILD_SHAPES)
# decode-ncu: Nsight Compute of the decode builds beside cuBLASLt's kernels at M x 8192 x 3584 (DECODE_NCU)
# rank-ncu: where the fused GEMM + reduce-scatter kernel's time goes as rank 0 of two on one GPU, at
#           RANK_NCU shapes (M×N×K, B [N, K]) on the RANK_NCU_BUILD build (default direct; or
#           ping-pong-wide): Nsight Compute lists every launch of the build's entries in one
#           `bench gemm --rs-ranks 2` process, then samples the warps' stalls of the build alone,
#           of the order row and of the rank row (scripts/ncu-rank-launches.py). Not part of full.
# ab: our GEMM as built (.gpu/commfuse) beside an earlier commit's (.gpu/base/commfuse, from
#     `scripts/gpu-prepare.sh --base REV`) at AB_SHAPES (M×N×K, B [N, K]), the two in turn with
#     the order alternating from shape to shape, one call of each row traced, two passes;
#     AB_FLAGS adds flags (default `--builds none`: `auto`'s build alone). Not part of full.
# (each of check, gemm+bench fits one 10-minute device call)
MODE=${1:-full}
SIZES=${SIZES:-4K,16K,64K,256K,1M,4M,16M,64M,256M,1G}
LAYOUTS=${LAYOUTS:-nk kn}
has() { [ "$MODE" = full ] || [[ ",$MODE," == *",$1,"* ]]; }

log "$(date -u) mode=$MODE"
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.mem,memory.used --format=csv >"$R/gpus.txt" 2>&1
nvidia-smi topo -m >"$R/topo.txt" 2>&1
# a fresh machine compiles every kernel under NVRTC (gemm.cu alone takes minutes, one core):
# once here, into the kernel cache, so that no test's or bench's time limit pays for it
# (with ptxas's report of every entry: registers, shared memory, spills)
t0=$SECONDS
timeout 600 $B kernels --report >"$R/kernels.txt" 2>&1
log "kernels compiled rc=$? in $((SECONDS - t0)) s"
run_tests() {
  for t in ${TESTS:-$(ls .gpu/tests)}; do
    t=.gpu/tests/$t
    # the command line's suite: its GPU tests only (the rest is CI's)
    filter=; [ "$(basename "$t")" = cli ] && filter=on_gpus
    timeout 360 "$t" $filter --test-threads 1 >"$R/test-$(basename "$t").txt" 2>&1
    rc=$?
    log "test $(basename "$t") rc=$rc $(grep -E '^test result' "$R/test-$(basename "$t").txt" | tail -1)"
    grep -E "^test .* FAILED|panicked" -A2 "$R/test-$(basename "$t").txt" | head -12 | cut -c1-400 | tee -a "$OUT/summary.txt"
  done
}
has tests && run_tests
# An Nsight Compute report $R/NAME.ncu-rep read out and removed: its details page, its raw
# metrics, its source page (SASS with the warps' stall samples) and their summary by
# instruction (scripts/ncu-stalls.py); the details' lines that match PATTERN into the summary.
ncu_report() {
  local n=$1
  ncu -i "$R/$n.ncu-rep" --page details >"$R/$n-details.txt" 2>&1
  ncu -i "$R/$n.ncu-rep" --page raw --csv >"$R/$n-raw.csv" 2>&1
  ncu -i "$R/$n.ncu-rep" --page source --csv --print-source sass >"$R/$n-sass.csv" 2>&1
  python3 scripts/ncu-stalls.py "$R/$n-sass.csv" >"$R/$n-stalls.txt" 2>&1
  grep -E "$2" "$R/$n-details.txt" | head -8 | cut -c1-140 | tee -a "$OUT/summary.txt"
  rm -f "$R/$n.ncu-rep"
}
install_wheel() {
  # the wheel gpu-prepare.sh built, installed beside the machine's PyTorch
  python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/commfuse-site .gpu/wheels/commfuse-*.whl
  export PYTHONPATH=/tmp/commfuse-site
  # the wheel's C++ dispatcher kernels must load (built for this machine's PyTorch)
  export COMMFUSE_TORCH_NATIVE=1
  GPUS=$(nvidia-smi -L | wc -l)
}
host_time() {
  timeout 300 torchrun --standalone --nproc-per-node "$GPUS" python/benches/torch_host_time.py ${HOST_TIME_FLAGS:-} --json "$R/torch-host-time.json" >"$R/torch_host_time.txt" 2>&1
  log "torch_host_time rc=$?"; grep -v "^W1\|^\*\*\*" "$R/torch_host_time.txt" | tail -24 | cut -c1-300 | tee -a "$OUT/summary.txt"
  # the same with the ops' kernels in Python (the C++ dispatcher kernels unloaded), beside it
  COMMFUSE_TORCH_NATIVE=0 timeout 300 torchrun --standalone --nproc-per-node "$GPUS" python/benches/torch_host_time.py ${HOST_TIME_FLAGS:-} --json "$R/torch-host-time-python.json" >"$R/torch_host_time_python.txt" 2>&1
  log "torch_host_time (kernels in Python) rc=$?"; grep -v "^W1\|^\*\*\*" "$R/torch_host_time_python.txt" | tail -24 | cut -c1-300 | tee -a "$OUT/summary.txt"
}
# host-time: the host-time bench alone (part of torch)
if has host-time && ! has torch; then
  install_wheel
  host_time
fi
if has torch; then
  install_wheel
  (cd /tmp && timeout 400 python3 -m pytest -q -rs -s ${PYTEST_ARGS:-} "$OLDPWD/python/tests") >"$R/pytest.txt" 2>&1
  log "pytest rc=$? $(tail -1 "$R/pytest.txt")"
  grep -E "FAILED|Error|^ok " "$R/pytest.txt" | head -40 | cut -c1-400 | tee -a "$OUT/summary.txt"
  (cd python/tests && timeout 400 torchrun --standalone --nproc-per-node "$GPUS" torch_cuda.py) >"$R/torch_cuda.txt" 2>&1
  log "torch_cuda rc=$?"; grep -E "^ok |Error|error" "$R/torch_cuda.txt" | head -20 | cut -c1-300 | tee -a "$OUT/summary.txt"
  timeout 300 torchrun --standalone --nproc-per-node "$GPUS" examples/tp_train.py ${TRAIN_FLAGS:---compile} >"$R/tp_train.txt" 2>&1
  log "tp_train rc=$?"; grep -v "^W1\|^\*\*\*" "$R/tp_train.txt" | tail -16 | cut -c1-300 | tee -a "$OUT/summary.txt"
  host_time
  if [ "$GPUS" -ge 2 ]; then
    timeout 300 torchrun --standalone --nproc-per-node 2 examples/tp_mlp.py ${MLP_FLAGS:-} >"$R/tp_mlp.txt" 2>&1
    log "tp_mlp rc=$?"; grep -v "^W1\|^\*\*\*" "$R/tp_mlp.txt" | tail -40 | cut -c1-300 | tee -a "$OUT/summary.txt"
  fi
fi

if has check; then
  run_tests
  timeout 240 $B verify --devices 0,1 --json "$R/verify.json" >"$R/verify.txt" 2>&1
  log "verify rc=$? $(tail -1 "$R/verify.txt")"
  grep -E "FAIL" "$R/verify.txt" | head -5 | cut -c1-400 | tee -a "$OUT/summary.txt"
fi

if has gemm; then
  # our GEMM beside cuBLASLt at four shapes of tensor-parallel layers: all SMs, 116 SMs, epilogue on the peer
  for shape in "4096 12288 24576" "8192 8192 14336" "8192 8192 3584" "2048 8192 3584"; do
    set -- $shape
    for layout in $LAYOUTS; do
      name=gemm-$1x$2x$3-$layout
      timeout 120 $B bench gemm --m $1 --n $2 --k $3 --b-layout $layout --sms 0,116 --peer 1 --warmup 10 --iters 30 \
        --json "$R/$name.json" >"$R/$name.txt" 2>&1
      log "$name rc=$?"; grep -v "^#" "$R/$name.txt" | tee -a "$OUT/summary.txt"
    done
  done
fi

# our GEMM beside cuBLASLt on one GPU at the shapes of tensor-parallel layers, decode sizes
# and products of fewer tiles than SMs included (M×N×K:layouts: the table of
# docs/performance.md), or GEMM_SHAPES="16x8192x3584:nk 8192x8192x3584:nk,kn"; GEMM_FLAGS="--fold 1,3"
# adds flags (here: rows of our GEMM folding one and three partials into every tile); GEMM_SMS
# caps the grids (default 0: every SM; GEMM_SMS=131 GEMM_FLAGS="--fold 1,3 --fold-paced 1"
# leaves an SM for the side kernel of the paced fold rows); GEMM_PASSES=2 runs every shape
# again in a process of its own once all have run (files ...-p2)
GEMM_SHAPES=${GEMM_SHAPES:-16x8192x3584:nk,kn 64x8192x3584:nk,kn 96x8192x3584:nk,kn 128x8192x3584:nk,kn 128x16384x3584:nk,kn 128x28672x8192:nk,kn 192x4096x4096:nk,kn 256x2048x4096:nk,kn 256x4096x4096:nk,kn 384x4096x4096:nk,kn 512x4096x4096:nk,kn 256x4096x14336:nk,kn 1024x2048x4096:nk,kn 1024x8192x3584:nk,kn 2048x8192x3584:nk,kn 8192x8192x3584:nk,kn 16384x8192x3584:nk,kn 8192x8192x14336:nk,kn 4096x12288x24576:nk,kn 4096x28672x8192:nk,kn}
# one GPU's bench gemm rows for each shape (M×N×K:layouts) after the first argument, the
# results' name prefix
gemm_rows() {
  local prefix=$1 pass; shift
  local shapes=("$@")  # (set -- below takes each shape's dimensions)
  for pass in $(seq 1 "${GEMM_PASSES:-1}"); do
    for shape in "${shapes[@]}"; do
      dims=${shape%%:*} layouts=${shape#*:}; set -- ${dims//x/ }
      for l in ${layouts//,/ }; do
        name=$prefix-$1x$2x$3-$l; [ "$pass" = 1 ] || name=$name-p$pass
        timeout 120 $B bench gemm --m $1 --n $2 --k $3 --b-layout $l --sms ${GEMM_SMS:-0} --peer none ${GEMM_FLAGS:-} --warmup 10 --iters 30 \
          --json "$R/$name.json" >"$R/$name.txt" 2>&1
        log "$name rc=$?"; grep -v "^#" "$R/$name.txt" | tee -a "$OUT/summary.txt"
      done
    done
  done
}
if has gemm-one; then
  gemm_rows gemm-one $GEMM_SHAPES
fi

# six shapes of tensor-parallel layers (docs/performance.md), or RS_SHAPES="512x4096x4096 1024x8192x3584" (M×N×K)
RS_SHAPES=${RS_SHAPES:-8192x8192x3584 2048x8192x3584 8192x8192x14336 4096x12288x24576 1024x8192x3584 512x4096x4096}
if has gemm-rs; then
  for shape in $RS_SHAPES; do
    set -- ${shape//x/ }
    name=gemm-rs-$1x$2x$3
    timeout 150 $B bench gemm-rs --m $1 --n $2 --k $3 --devices 0,1 ${RS_FLAGS:-} --warmup 5 --iters 30 \
      --json "$R/$name.json" >"$R/$name.txt" 2>&1
    log "$name rc=$?"; grep -v "^# commfuse" "$R/$name.txt" | tee -a "$OUT/summary.txt"
  done
fi

AG_SHAPES=${AG_SHAPES:-8192x8192x3584 2048x8192x3584 8192x8192x14336 4096x12288x24576 1024x8192x3584 512x4096x4096}
if has ag-gemm; then
  for shape in $AG_SHAPES; do
    set -- ${shape//x/ }
    name=ag-gemm-$1x$2x$3
    timeout 150 $B bench ag-gemm --m $1 --n $2 --k $3 --devices 0,1 ${AG_FLAGS:-} --warmup 5 --iters 30 \
      --json "$R/$name.json" >"$R/$name.txt" 2>&1
    log "$name rc=$?"; grep -v "^# commfuse" "$R/$name.txt" | tee -a "$OUT/summary.txt"
  done
fi

if has bench; then
  # the link's own ceilings under one- and two-way load, beside which the large sizes are read
  if python3 -c "import torch" 2>/dev/null; then
    timeout 120 python3 scripts/link-ceilings.py >"$R/link-ceilings.txt" 2>&1
    log "link ceilings rc=$? $(grep 'both ways  ce ' "$R/link-ceilings.txt" | tr -s ' ' | tr '\n' ';')"
  fi
  for op in reduce-scatter all-gather all-reduce; do
    timeout 200 $B bench $op --devices 0,1 --algo all --dtype bf16 --sizes "$SIZES" --warmup 5 --iters 20 \
      --json "$R/bench-$op.json" --plot "$R/bench-$op.svg" >"$R/bench-$op.txt" 2>&1
    log "bench $op rc=$? $(grep -i error "$R/bench-$op.txt" | head -2)"
    sed -n '/best per size/,$p' "$R/bench-$op.txt" | tee -a "$OUT/summary.txt"
  done
  # small messages with launch overhead left out (graph replay) for us and NCCL alike
  for op in all-reduce reduce-scatter all-gather; do
    timeout 100 $B bench $op --devices 0,1 --algo all --dtype bf16 --sizes 4K..1M --warmup 5 --iters 50 --graph \
      --json "$R/graph-$op.json" >"$R/graph-$op.txt" 2>&1
    log "graph bench $op rc=$? $(grep -i error "$R/graph-$op.txt" | head -2)"
    [ "$op" = all-reduce ] && sed -n '/best per size/,$p' "$R/graph-$op.txt" | tee -a "$OUT/summary.txt"
  done
  $B calibrate "$R"/bench-*.json --json "$R/calibration.json" >"$R/calibration.txt" 2>&1
  log "calibrate rc=$? $(head -1 "$R/calibration.txt") $(tail -1 "$R/calibration.txt")"
fi
# small: small all-reduces and reduce-scatters, LL and LL16 beside NCCL, graph-replayed
# and eager, launched programmatically (default) and the ordinary way (COMMFUSE_PDL=0)
if has small; then
  for pdl in 1 0; do
    for g in --graph ""; do
      for op in all-reduce reduce-scatter; do
        name=small-$op-pdl$pdl${g:+-graph}
        COMMFUSE_PDL=$pdl timeout 100 $B bench $op --devices 0,1 --algo all --dtype bf16 --sizes 4K,16K,64K,256K,1M \
          --warmup 5 --iters 50 $g --json "$R/$name.json" >"$R/$name.txt" 2>&1
        log "$name rc=$? $(grep -E ' (ll|ll16|nccl) ' "$R/$name.txt" | awk '{print $1"/"$4"="$5}' | tr '\n' ' ')"
      done
    done
  done
fi
if has fixed-cost; then
  for k in ${FIXED_KS:-256 512 1024 2048 3584 7168 14336}; do
    name=k-8192x8192x$k
    timeout 120 $B bench gemm --m 8192 --n 8192 --k $k --b-layout nk --sms 0 --builds ${FIXED_BUILDS:-main,direct,mid,ping-pong} \
      --next-prefetch ${NEXT_PREFETCH:-4} --peer none --warmup 10 --iters 30 --json "$R/$name.json" >"$R/$name.txt" 2>&1
    log "$name rc=$?"; grep -v "^#" "$R/$name.txt" | cut -c1-160 | tee -a "$OUT/summary.txt"
  done
  # where the warps of the direct build wait, per SASS instruction: few k-blocks a tile
  # (the per-tile costs weigh most) and the table's K
  for k in 512 3584; do
    n=ncu-direct-8192x8192x$k
    timeout 150 ncu --clock-control none -k regex:^gemm_direct_bf16_nk_bf16\$ -s 2 -c 1 --section SpeedOfLight \
      --section WarpStateStats --section SourceCounters -o "$R/$n" $B bench gemm --m 8192 --n 8192 --k $k \
      --b-layout nk --sms 0 --builds direct --peer none --warmup 2 --iters 3 >"$R/$n.log" 2>&1
    log "$n rc=$?"
    ncu_report "$n" "Duration|Compute \(SM\) Throughput|Warp Cycles Per Issued"
  done
fi
if has builds; then
  for f in ${BUILD_TESTS:-narrow_deep_build narrow_sliced_build ping_pong_build direct_build next_unit_prefetch stream_k_tail_sums bench_rows_pass}; do
    timeout 300 .gpu/tests/gpu_gemm "$f" --test-threads 1 >"$R/test-gpu_gemm-$f.txt" 2>&1
    log "test gpu_gemm $f rc=$? $(grep -E '^test result' "$R/test-gpu_gemm-$f.txt" | tail -1)"
    grep -E "^test .* FAILED|panicked" -A2 "$R/test-gpu_gemm-$f.txt" | head -12 | cut -c1-400 | tee -a "$OUT/summary.txt"
  done
  gemm_rows builds ${BUILD_SHAPES:-16x8192x3584:nk 32x8192x3584:nk 64x8192x3584:nk 128x8192x3584:nk 2048x8192x3584:nk 8192x8192x3584:nk}
fi
# decode-ncu: Nsight Compute of our decode builds beside cuBLASLt's kernels at M x 8192 x 3584
# (DECODE_NCU="rows:build ..."): every cuBLASLt candidate's time, DRAM throughput and SM
# activity, then the sections and stall samples of ours and of cuBLASLt's 64 x 16 tiles
if has decode-ncu; then
  for spec in ${DECODE_NCU:-16:narrow-deep 64:narrow 128:narrow-tall}; do
    m=${spec%%:*}; build=${spec#*:}; entry=gemm_${build//-/_}_bf16_nk_bf16
    args="bench gemm --m $m --n 8192 --k 3584 --b-layout nk --sms 0 --builds $build --peer none --warmup 1 --iters 2"
    n=ncu-decode-$m-candidates
    timeout 150 ncu --clock-control none -k regex:nvjet -c 8 --metrics \
      gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__cycles_active.avg,sm__cycles_elapsed.max,launch__grid_size \
      $B $args >"$R/$n.txt" 2>&1
    log "$n rc=$?"; grep -E "nvjet|duration|dram__" "$R/$n.txt" | head -24 | cut -c1-140 | tee -a "$OUT/summary.txt"
    for k in "regex:^$entry\$" "regex:^nvjet_sm90_tst_64x16"; do
      n=ncu-decode-$m-$([ "${k#regex:^nvjet}" = "$k" ] && echo ours || echo cublas)
      timeout 150 ncu --clock-control none -k "$k" -s 1 -c 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section SourceCounters --section LaunchStats --section Occupancy \
        --metrics sm__cycles_active.avg,sm__cycles_elapsed.max -o "$R/$n" $B $args >"$R/$n.log" 2>&1
      log "$n rc=$?"
      ncu_report "$n" "^  [a-z]|Duration|DRAM Throughput|sm__cycles|Warp Cycles Per Issued"
    done
  done
fi
if [ "$MODE" != full ] && has rank-ncu; then
  metrics=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum,sm__cycles_active.avg
  metrics=$metrics,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed
  build=${RANK_NCU_BUILD:-direct}
  entries=regex:^gemm_${build//-/_}
  for s in ${RANK_NCU:-8192x8192x3584 1024x8192x3584}; do
    set -- ${s//x/ }
    args="bench gemm --m $1 --n $2 --k $3 --b-layout nk --sms 0 --peer none --builds $build --rs-ranks 2 --warmup 1 --iters 2"
    n=ncu-rank-$s
    timeout 300 ncu --clock-control none -k $entries --metrics $metrics --csv --log-file "$R/$n-list.csv" \
      $B $args >"$R/$n-list.log" 2>&1
    log "$n launches rc=$?"
    python3 scripts/ncu-rank-launches.py "$R/$n-list.csv" "$R/$n-launches.txt" >"$R/$n-picks.txt"
    while read -r row id; do
      n=ncu-rank-$s-$row
      timeout 150 ncu --clock-control none -k $entries -s "$id" -c 1 --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section SourceCounters \
        --metrics $metrics -o "$R/$n" $B $args >"$R/$n.log" 2>&1
      log "$n (launch $id) rc=$?"
      ncu_report "$n" "^  [a-z]|Duration|Warp Cycles Per Issued|hmma|dram__bytes_read"
    done <"$R/ncu-rank-$s-picks.txt"
  done
fi
# one traced bench gemm row of one of the two builds: shape, which (new|base), pass
ab_row() {
  local bin=$B; [ "$2" = base ] && bin=.gpu/base/commfuse
  set -- ${1//x/ } "$2" "$3"
  local name=ab-$1x$2x$3-$4-$5
  timeout 90 $bin bench gemm --m $1 --n $2 --k $3 --b-layout nk --sms 0 --peer none ${AB_FLAGS:---builds none} \
    --warmup 10 --iters 30 --trace --json "$R/$name.json" >"$R/$name.txt" 2>&1
  log "$name rc=$?"
  grep -E "^ *(cublas|commfuse)|producer  |first load|first stage|main loop" "$R/$name.txt" | cut -c1-112 | tee -a "$OUT/summary.txt"
}
if [ "$MODE" != full ] && has ab; then
  [ -x .gpu/base/commfuse ] || log "no .gpu/base/commfuse: scripts/gpu-prepare.sh --base REV builds it"
  for pass in 1 2; do
    i=$pass
    for s in ${AB_SHAPES:-16x8192x3584 64x8192x3584 128x8192x3584 512x4096x4096 8192x8192x3584}; do
      if [ $((i % 2)) = 1 ]; then ab_row $s base $pass; ab_row $s new $pass; else ab_row $s new $pass; ab_row $s base $pass; fi
      i=$((i + 1))
    done
  done
fi
tar czf "$OUT/results.tgz" -C "$OUT" results
rm -rf "$R"
