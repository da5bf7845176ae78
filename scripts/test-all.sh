#!/usr/bin/env bash
# Every test: the Rust workspace's, then the Python package's (built by maturin into a wheel,
# installed in this checkout's own virtual environment, .venv, with NumPy, pytest and PyTorch,
# tested with pytest; commfuse.torch's suites run on CPU tensors there).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
cargo test --workspace --release
# the Python module's own Rust tests (its C face); a workspace of its own
CARGO_TARGET_DIR="$ROOT/target" cargo test --release --manifest-path python/Cargo.toml

VENV="${COMMFUSE_VENV:-$ROOT/.venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# PyTorch as on the GPU machine (2.11); the PyPI wheel runs on CPUs too
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check numpy pytest maturin \
  torch==2.11.0
# commfuse.torch's suites must run here, not skip, with its C++ dispatcher kernels built into
# the package (scripts/build-torch-native.sh) and loaded
export COMMFUSE_REQUIRE_TORCH=1
bash scripts/build-torch-native.sh "$VENV/bin/python"
export COMMFUSE_TORCH_NATIVE=1
WHEELS="$(mktemp -d)"
# the workspace's target folder: the crates both builds share compile once
CARGO_TARGET_DIR="$ROOT/target" "$VENV/bin/maturin" build --release --quiet \
  -m python/Cargo.toml -o "$WHEELS"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --force-reinstall \
  --no-deps "$WHEELS"/commfuse-*.whl
rm -rf "$WHEELS"
# from outside the source tree, so that the installed package is the one imported
(cd "${TMPDIR:-/tmp}" && "$VENV/bin/python" -m pytest -q "$ROOT/python/tests")
