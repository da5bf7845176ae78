# Sourced by .ci/run and scripts/gpu-prepare.sh: NVRTC and the CUDA headers from PyPI, 13.0 as
# on the GPU machine (PTX from a newer NVRTC does not load on that machine's driver), installed
# once into $NVRTC_WHEELS (libnvrtc under nvidia/cu13/lib, headers under nvidia/cu13/include).
NVRTC_WHEELS="${TMPDIR:-/tmp}/commfuse-nvrtc"
if [ ! -e "$NVRTC_WHEELS/nvidia/cu13/lib/libnvrtc.so.13" ]; then
  python3 -m pip install --quiet --disable-pip-version-check --target "$NVRTC_WHEELS" \
    nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-runtime==13.0.96
fi
