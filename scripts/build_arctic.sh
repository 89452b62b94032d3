#!/usr/bin/env bash
# Suffix decoding for vLLM (`method: "suffix"`) needs Arctic Inference's C++ suffix trees. Recent
# arctic-inference releases are source-only on PyPI (nanobind, a pinned protobuf, grpcio-tools, and a
# setup.py that imports torch), and their build pins clash with vLLM's. So: build the wheel once in a
# venv of its own that sees .venv's torch, cache it under $EYAS_HOME/wheels, install it into .venv
# with --no-deps (vLLM's dependencies untouched). Its vLLM plugin stays off unless
# ARCTIC_INFERENCE_ENABLED=1; eyas only uses vLLM's own suffix proposer, which imports it.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${ARCTIC_VERSION:-0.3.0}
HOME_DIR=${EYAS_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/eyas}
WHEELS="$HOME_DIR/wheels"
if .venv/bin/python -c "import arctic_inference.suffix_decoding" 2>/dev/null; then exit 0; fi
mkdir -p "$WHEELS"
whl=$(ls "$WHEELS"/arctic_inference-"$VERSION"-*.whl 2>/dev/null | head -1 || true)
if [[ -z $whl ]]; then
  echo "setup: building arctic-inference $VERSION (suffix decoding; a minute or two) ..." >&2
  work=$(mktemp -d "${TMPDIR:-/tmp}/eyas-arctic.XXXXXX")
  trap 'rm -rf "$work"' EXIT
  site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  py=$(.venv/bin/python -c "import sys; print(f'{sys.base_prefix}/bin/python3')")
  "$py" -m venv "$work/venv"
  # .venv's packages (torch) after the build venv's own (its protobuf pin wins)
  echo "$site" > "$("$work/venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/zz_eyas.pth"
  "$work/venv/bin/pip" install --quiet --only-binary :all: setuptools wheel ninja "cmake>=3.12" nanobind==2.9.2 protobuf==5.29.6 \
    grpcio-tools 2>&1 | grep -v -e "is ignored" -e "dependency" -e "requires" || true
  # --no-build-isolation: pip prepares the sdist's metadata in the build venv (else it would build
  # every build dependency from source in an isolated env, against the torch pin of the constraints)
  PATH="$work/venv/bin:$PATH" "$work/venv/bin/pip" download --quiet --no-deps --no-build-isolation \
    --no-binary arctic-inference "arctic-inference==$VERSION" -d "$work/src" 2>&1 | grep -v "is ignored" || true
  tar xzf "$work"/src/arctic_inference-"$VERSION".tar.gz -C "$work/src"
  # CMake must find the build venv's python (it has nanobind), not the first python3 on PATH
  (cd "$work/src/arctic_inference-$VERSION" && PATH="$work/venv/bin:$PATH" \
    "$work/venv/bin/pip" wheel --quiet --no-build-isolation --no-deps -w "$work/wheel" . 2>&1 | grep -v "is ignored" || true)
  built=$(ls "$work"/wheel/arctic_inference-*.whl)
  cp "$built" "$WHEELS/"
  whl="$WHEELS/$(basename "$built")"
fi
.venv/bin/python -m pip install --quiet --no-deps "$whl" 2>&1 | grep -v "is ignored" || true
.venv/bin/python -c "import arctic_inference.suffix_decoding"
echo "setup: suffix decoding ready (arctic-inference $VERSION)" >&2
