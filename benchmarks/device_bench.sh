#!/usr/bin/env bash
# Plain vs MTP decoding on an NVIDIA GPU with MLX's CUDA backend, on the bundled tiny checkpoint (bf16).
#
#   benchmarks/device_bench.sh            # builds .venv-cuda (needs a package index), then benches
#   WHEELS=dir benchmarks/device_bench.sh # offline: .venv-cuda over the system's packages, plus the wheels in dir
#                                         # (mlx, mlx-cuda-13, mlx-lm, and this project's wheel if there)
#   PYTHON=/path/to/python benchmarks/device_bench.sh   # a Python that already has mlx[cuda], mlx-lm, this package
#   RESULTS=dir ...                       # where dated results go (default benchmarks/results)
#
# Prints and writes: the bench report (tok/s plain, each depth, adaptive; acceptance; cost ratios; efficiency),
# the parked-decoding speed against stock mlx-lm, and the server load benchmark (stock vs plugin server at 1,
# 2, 4, 8 clients). Budget: under 8 minutes in all.
set -euo pipefail
cd "$(dirname "$0")/.."
RESULTS=${RESULTS:-benchmarks/results}

if [[ -z "${PYTHON:-}" ]]; then
    PYTHON=.venv-cuda/bin/python
    if [[ -n "${WHEELS:-}" ]]; then
        python3 -m venv --system-site-packages .venv-cuda
        timeout 150 "$PYTHON" -m pip install -q --no-index --no-deps "$WHEELS"/*.whl
    else
        python3 -m venv .venv-cuda
        timeout 150 "$PYTHON" -m pip install -q "mlx[cuda]" "mlx-lm==0.32.2" "mlx-vlm==0.7.10" pluggy safetensors tqdm
    fi
fi
if ! "$PYTHON" -c "import mtp_plugin" 2>/dev/null; then
    # The checkpoint's own build backend may be unreachable offline: install without build isolation if needed.
    timeout 60 "$PYTHON" -m pip install -q --no-deps --force-reinstall . \
        || timeout 60 "$PYTHON" -m pip install -q --no-deps --no-build-isolation --force-reinstall .
fi
"$PYTHON" -c "import mlx.core as mx; d = mx.default_device(); print('MLX device:', d, mx.device_info()); \
assert d.type == mx.gpu, 'MLX is not using the GPU (install mlx[cuda])'"
mkdir -p "$RESULTS"
timeout 180 "$PYTHON" examples/bench.py --dtype bfloat16 --depths 3 --max-tokens 128 --repeats 3 --out "$RESULTS"
timeout 120 "$PYTHON" benchmarks/parked_speed.py --runs 20 --max-tokens 128
timeout 200 "$PYTHON" benchmarks/server_load.py --requests 2 --repeats 3 --time-cap 180 --out "$RESULTS"
