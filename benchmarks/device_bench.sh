#!/usr/bin/env bash
# Plain vs MTP decoding on an NVIDIA GPU with MLX's CUDA backend, on the bundled tiny checkpoint (bf16).
#
#   benchmarks/device_bench.sh            # builds .venv-cuda (needs a package index), then benches
#   PYTHON=/path/to/python benchmarks/device_bench.sh   # a Python that already has mlx[cuda], mlx-lm, mlx-vlm
#
# Prints the bench report (tok/s plain, each depth, adaptive; acceptance; cost ratios; efficiency) and
# writes it to benchmarks/results/; then the server load benchmark (stock vs plugin server at 1, 2, 4, 8
# clients). Budget: under 5 minutes in all.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -z "${PYTHON:-}" ]]; then
    python3 -m venv .venv-cuda
    PYTHON=.venv-cuda/bin/python
    timeout 150 "$PYTHON" -m pip install -q "mlx[cuda]" "mlx-lm==0.32.2" "mlx-vlm==0.7.10" pluggy safetensors tqdm
fi
# The checkpoint's own build backend may be unreachable offline: install without build isolation if needed.
timeout 60 "$PYTHON" -m pip install -q --no-deps --force-reinstall . \
    || timeout 60 "$PYTHON" -m pip install -q --no-deps --no-build-isolation --force-reinstall .
"$PYTHON" -c "import mlx.core as mx; d = mx.default_device(); print('MLX device:', d, mx.device_info()); \
assert d.type == mx.gpu, 'MLX is not using the GPU (install mlx[cuda])'"
timeout 180 "$PYTHON" examples/bench.py --dtype bfloat16 --depths 3 --max-tokens 128 --repeats 3 --out benchmarks/results
timeout 150 "$PYTHON" benchmarks/server_load.py --requests 2 --repeats 1 --time-cap 120 --out benchmarks/results
