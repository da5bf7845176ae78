#!/usr/bin/env bash
# Every test: the Rust workspace's, then the Python package's (built by maturin into a wheel,
# installed in a virtual environment of its own with NumPy and pytest, tested with pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
cargo test --workspace --release

VENV="${COMMFUSE_VENV:-${TMPDIR:-/tmp}/commfuse-venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check numpy pytest maturin
WHEELS="$(mktemp -d)"
# the workspace's target folder: the crates both builds share compile once
CARGO_TARGET_DIR="$ROOT/target" "$VENV/bin/maturin" build --release --quiet \
  -m python/Cargo.toml -o "$WHEELS"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --force-reinstall \
  --no-deps "$WHEELS"/commfuse-*.whl
rm -rf "$WHEELS"
# from outside the source tree, so that the installed package is the one imported
(cd "${TMPDIR:-/tmp}" && "$VENV/bin/python" -m pytest -q "$ROOT/python/tests")
