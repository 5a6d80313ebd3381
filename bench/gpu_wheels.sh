#!/usr/bin/env bash
# Download into .whl/ the wheels duplexd's server and clients need that the offline GPU image lacks, for
# bench/gpu_suite.sh to install there with --no-index (that machine has no network). Run it here, from anywhere.
#
# The image (Python 3.12, torch, triton, numpy, safetensors, sentencepiece, tqdm, huggingface_hub,
# prometheus-client, matplotlib, anyio, h11, click, annotated-doc, uvloop, pyyaml, ...) provides the rest.
# typing-extensions is in the image too but travels anyway: pydantic needs a recent one, and a newer copy on
# PYTHONPATH is harmless to the image's own packages. Versions are those the test environment runs.
#
# WHEEL_PYTHON=3.11 WHEEL_DEST=DIR fetch the same set for another Python (to check the set on a machine whose
# Python differs from the image's: bench/gpu_suite.sh's dry run can use it with WHEELS=DIR). WHEEL_CHECK=1 only
# resolves the set against the index (pip's --dry-run: every pin exists as a wheel for the image's platform and
# Python), downloading no wheel; it still asks the index, so the test suite, which runs offline, does not run it.
# The last line is one JSON object.
set -euo pipefail

cd "$(dirname "$0")/.."
DEST=${WHEEL_DEST:-.whl}
PYVER=${WHEEL_PYTHON:-3.12}
LIMIT_MIB=60
WHEELS=(
  fastapi==0.165.0 starlette==1.10.0 opentelemetry-api==1.45.2
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
  pydantic-settings==2.16.3 python-dotenv==1.2.4
  uvicorn==0.55.0 httptools==0.9.0 websockets==17.4
  sphn==0.2.1 soundfile==0.14.0 soxr==1.1.0 cffi==2.1.1 pycparser==3.12
)

PLATFORM=(--no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

if [ "${WHEEL_CHECK:-0}" = 1 ]; then
  report=$(mktemp)
  trap 'rm -f "$report"' EXIT
  python3 -m pip install --quiet --dry-run --ignore-installed --target "$(mktemp -d)" --report "$report" \
    "${PLATFORM[@]}" "${WHEELS[@]}"
  count=$(python3 -c "import json, sys; print(len(json.load(open(sys.argv[1]))['install']))" "$report")
  echo "$count of ${#WHEELS[@]} wheels resolve for Python $PYVER"
  echo "{\"bench\": \"gpu_wheels\", \"checked\": true, \"wheels\": $count, \"expected\": ${#WHEELS[@]}}"
  [ "$count" -eq "${#WHEELS[@]}" ]
  exit
fi

rm -rf "$DEST"
mkdir -p "$DEST"
python3 -m pip download --quiet "${PLATFORM[@]}" -d "$DEST" "${WHEELS[@]}"

count=$(find "$DEST" -type f -name "*.whl" | wc -l)
bytes=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
ls -l "$DEST"
echo "$count wheels, $((bytes / 1048576)) MiB in $DEST"
if [ "$count" -ne "${#WHEELS[@]}" ]; then
  echo "error: expected ${#WHEELS[@]} wheels" >&2
  exit 1
fi
if [ "$bytes" -gt $((LIMIT_MIB * 1048576)) ]; then
  echo "error: over $LIMIT_MIB MiB: too much to carry to the device machine" >&2
  exit 1
fi
echo "{\"bench\": \"gpu_wheels\", \"checked\": false, \"wheels\": $count, \"mib\": $((bytes / 1048576))}"
