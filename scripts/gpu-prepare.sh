#!/usr/bin/env bash
# Builds what the GPU machine runs (it has no Rust): the release binary and the test binaries
# that exercise the cuda backend and the Python wheel, copied into .gpu/ (ignored by git; copy it to the GPU machine with the checkout).
# With `--base REV`, also the release binary of commit REV as .gpu/base/commfuse, its kernels
# in the same cache, for `scripts/gpu-check.sh ab` (the two builds side by side).
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=
if [ "${1:-}" = --base ]; then
  BASE=$(git rev-parse --verify "${2:?--base takes a commit}^{commit}")
fi
cargo build --release
rm -rf .gpu && mkdir -p .gpu/tests
cp target/release/commfuse .gpu/
cargo test --release --no-run --message-format=json -p commfuse -p commfuse-cuda --test cli --test collectives --test gpu --test gpu_gemm --test gpu_gemm_rs --test gpu_ag_gemm --test gpu_collective --test gpu_processes 2>/dev/null \
  | python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["executable"])' \
  | while read -r exe; do cp "$exe" ".gpu/tests/$(basename "$exe" | sed 's/-[0-9a-f]*$//')"; done
strip --strip-debug .gpu/commfuse .gpu/tests/*
# Every kernel compiled here by NVRTC from PyPI (13.0, as on the GPU machine; no GPU needed)
# into a kernel cache packed as .gpu/kernel-cache.txz, which scripts/gpu-env.sh unpacks there:
# a fresh GPU machine would otherwise spend minutes of its time compiling gemm.cu
. scripts/nvrtc-wheels.sh
compile_kernels() {  # binary: its kernels into the one cache
  COMMFUSE_KERNEL_CACHE="$PWD/.gpu/kernel-cache" LD_LIBRARY_PATH="$NVRTC_WHEELS/nvidia/cu13/lib" \
    COMMFUSE_CUDA_INCLUDE="$NVRTC_WHEELS/nvidia/cu13/include" "$1" kernels >/dev/null
}
compile_kernels .gpu/commfuse
if [ -n "$BASE" ]; then
  # the earlier commit built from a worktree of its own, its binary beside ours
  WT=$(mktemp -d)
  git worktree add --quiet --detach "$WT/base" "$BASE"
  # (the same target folder: the dependencies are built once; its release/commfuse is the
  # earlier commit's from here on, ours being in .gpu already)
  CARGO_TARGET_DIR="$PWD/target" cargo build --release --quiet --manifest-path "$WT/base/Cargo.toml" -p commfuse
  mkdir -p .gpu/base && cp target/release/commfuse .gpu/base/ && strip --strip-debug .gpu/base/commfuse
  git worktree remove --force "$WT/base" && rm -rf "$WT"
  compile_kernels .gpu/base/commfuse
fi
. scripts/kernel-cache.sh
pack_kernel_cache .gpu
# the Python package as an abi3 wheel (the GPU machine's Python 3.12 installs it without Rust)
VENV="${COMMFUSE_VENV:-$PWD/.venv}"
[ -x "$VENV/bin/maturin" ] || { python3 -m venv "$VENV" && "$VENV/bin/python" -m pip install --quiet maturin; }
# commfuse.torch's C++ dispatcher kernels, against the venv's PyTorch (the GPU machine's version)
bash scripts/build-torch-native.sh "$VENV/bin/python"
CARGO_TARGET_DIR="$PWD/target" "$VENV/bin/maturin" build --release --quiet -m python/Cargo.toml -o .gpu/wheels
ls -la .gpu .gpu/tests .gpu/wheels
