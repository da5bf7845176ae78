#!/usr/bin/env bash
# One GPU (an H200), from the repository root, the release binary, GPU tests and kernel cache of
# commit 5072498 (the wide ping-pong build's producer asking L2 for a folding tile's partials by
# lines, --rs-prefetch k-blocks before the tile's main loop ends). What ran, in order:
#  1. the ring rank rows' GPU test, whose wide rank rows ran again with eight k-blocks of
#     prefetch: stopped by its 150 s limit (77 s on an H100 without the wide prefetch rows);
#  2. `bench gemm` at 8192 x 8192 x 3584 with --rs-ranks 2,4,8 --rs-prefetch 4,16,64: stopped
#     by its 110 s limit, nothing printed (the bench prints its table at the end);
#  3. Nsight Compute's listing of every launch of the wide build's entries in one `bench gemm
#     --rs-ranks 2` process (no prefetch rows) at 8192 x 8192 x 3584: µs, DRAM and L2 bytes and
#     the tensor pipes' share of each launch (the plain entry: the build alone; the general
#     entry: the `commfuse-general` row and the rank's order row; the routed entry: the rank
#     row); then the warps' stall samples of the build alone (`*-plain-*`);
#  4. the benches of step 2 at 16384 x 8192 x 3584 (--rs-prefetch 8,64) and 8192 x 8192 x
#     14336 (8,256): stopped by their 110 s limits.
# Whether the prefetch rows stall in a bounded wait or only outlast the limits is not known; the
# code is not in the tree (GEMM-NOTES.md, "Ideas not tried yet").
set -u
. scripts/gpu-env.sh
pack() { tar czf "$OUT/results.tgz" -C "$OUT" results summary.txt; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit --format=csv >"$R/gpus.txt" 2>&1
t0=$SECONDS
timeout 150 .gpu/tests/gpu_gemm --exact ring_rank_rows_pass_the_check --test-threads 1 >"$R/test-gpu_gemm-ring_rank_rows.txt" 2>&1
log "gpu_gemm ring_rank_rows rc=$? in $((SECONDS - t0)) s $(grep -E '^test result' "$R/test-gpu_gemm-ring_rank_rows.txt")"
pack
run() {  # shape, pass, prefetch k-blocks
  set -- ${1//x/ } $2 $3
  f=$1x$2x$3-nk-$4
  timeout 110 $B bench gemm --m $1 --n $2 --k $3 --b-layout nk --sms 0 --peer none \
    --builds ping-pong-wide --rs-ranks 2,4,8 --rs-prefetch $5 --warmup 10 --iters 30 --json "$R/$f.json" >"$R/$f.txt" 2>&1
  log "$f rc=$? at $SECONDS s"
  pack
}
metrics=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum,sm__cycles_active.avg
metrics=$metrics,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed
args="bench gemm --m 8192 --n 8192 --k 3584 --b-layout nk --sms 0 --peer none --builds ping-pong-wide --rs-ranks 2 --warmup 1 --iters 2"
n=ncu-rank-8192x8192x3584
run 8192x8192x3584 1 4,16,64
timeout 120 ncu --clock-control none -k regex:^gemm_ping_pong_wide --metrics $metrics --csv --log-file "$R/$n-list.csv" \
  $B $args >"$R/$n-list.log" 2>&1
log "$n launches rc=$? at $SECONDS s"
python3 scripts/ncu-rank-launches.py "$R/$n-list.csv" "$R/$n-launches.txt" >"$R/$n-picks.txt"
id=$(awk '$1 == "plain" {print $2}' "$R/$n-picks.txt")
timeout 90 ncu --clock-control none -k regex:^gemm_ping_pong_wide -s "$id" -c 1 --section SpeedOfLight \
  --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section SourceCounters \
  --metrics $metrics -o "$R/$n-plain" $B $args >"$R/$n-plain.log" 2>&1
log "$n-plain (launch $id) rc=$? at $SECONDS s"
ncu -i "$R/$n-plain.ncu-rep" --page details >"$R/$n-plain-details.txt" 2>&1
ncu -i "$R/$n-plain.ncu-rep" --page source --csv --print-source sass >"$R/$n-plain-sass.csv" 2>&1
python3 scripts/ncu-stalls.py "$R/$n-plain-sass.csv" >"$R/$n-plain-stalls.txt" 2>&1
pack
[ $SECONDS -lt 480 ] && run 16384x8192x3584 1 8,64
[ $SECONDS -lt 500 ] && run 8192x8192x14336 1 8,256
