# Sourced by the GPU box's scripts, from the repo root: $OUT made, the wheels in .whl (packages the box lacks)
# installed under /tmp/site ahead of the checkout on PYTHONPATH, output unbuffered.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:.
fi
export PYTHONPATH=${PYTHONPATH:-.}:. PYTHONUNBUFFERED=1
