#!/usr/bin/env bash
# Builds commfuse.torch's dispatcher kernels (python/native/dispatch.cpp) against the PyTorch of
# the Python given (default: python3) into python/commfuse/torch/, beside a file naming that
# PyTorch's version: the package loads the library only under the same version, else it runs
# the same ops from Python. Needs a C++17 compiler; PyTorch's pip wheel carries the headers.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${1:-python3}"
read -r TORCH_DIR TORCH_VERSION ABI < <("$PYTHON" -c '
import os, torch
print(os.path.dirname(torch.__file__), torch.__version__, int(torch._C._GLIBCXX_USE_CXX11_ABI))')
OUT=python/commfuse/torch
"${CXX:-g++}" -O2 -std=c++17 -shared -fPIC -fvisibility=hidden -D_GLIBCXX_USE_CXX11_ABI="$ABI" \
  -Wall -Wextra -Wno-unused-parameter \
  -I"$TORCH_DIR/include" -I"$TORCH_DIR/include/torch/csrc/api/include" \
  python/native/dispatch.cpp -L"$TORCH_DIR/lib" -lc10 -ltorch_cpu -o "$OUT/_dispatch.so"
echo "$TORCH_VERSION" > "$OUT/_dispatch.torch-version"
echo "built $OUT/_dispatch.so for torch $TORCH_VERSION"
