#!/usr/bin/env bash
# The device side of the GPU run (#32): run in the repo root on the device machine by the second call of
# docs/gpu-run.md, after the first call left .gpu/a and .gpu/whl there. Joins the GGUF, checks it,
# installs the carried wheels, runs scripts/gpu_scale.py inside BUDGET seconds and leaves the packed
# results and the log in $OUT. DEVICE=cpu rehearses it on a CPU.
set -uo pipefail
OUT=${OUT:?set OUT to the folder the results go to}
BUDGET=${BUDGET:-400}
DEVICE=${DEVICE:-cuda}
PY=${PY:-python3}
mkdir -p "$OUT" runs
exec > >(tee "$OUT/gpu_run.log") 2>&1
t0=$(date +%s)
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/eyas_site .gpu/whl/*.whl \
  || { echo "gpu_device_run: the carried wheels did not install"; exit 1; }
export PYTHONPATH="$PWD/src:/tmp/eyas_site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
cat .gpu/a/smollm2.gguf.part0 .gpu/b/smollm2.gguf.part1 > runs/smollm2.gguf
(cd runs && sha256sum -c ../.gpu/b/SHA256 | sed 's/^/gpu_device_run: /') || { echo "gpu_device_run: the joined GGUF is not the one sent"; exit 1; }
[[ $DEVICE == cpu ]] || "$PY" -c "import torch; print('gpu_device_run:', torch.__version__, torch.cuda.get_device_name(0))"
"$PY" scripts/gpu_scale.py --gguf runs/smollm2.gguf --prompts .gpu/b/prompts.jsonl.gz --out runs/gpu \
  --device "$DEVICE" --budget-s "$BUDGET" --pack "$OUT" ${GPU_SCALE_ARGS:-}
rc=$?
cp runs/gpu/timings.json "$OUT/" 2>/dev/null
echo "gpu_device_run: exit $rc after $(( $(date +%s) - t0 )) s"
exit $rc
