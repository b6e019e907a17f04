#!/usr/bin/env bash
# Remote call 1 of the head-training recipe on a lent GPU machine (written into .device/call1/run.sh by
# `scripts/gpu_recipe.sh prepare`; see docs/training.md, "On a lent GPU machine"):
#
#   bash .device/call1/run.sh          # carry .device/call1
#
# It keeps the first piece of the xz-compressed target GGUF outside the work tree, in $DDD_RECIPE_STAGE
# (/tmp/ddd-recipe), where call 2 (`bash .device/call2/run.sh`, at once, while the machine is still warm) finds it.
# It reads nothing outside its own folder and needs no venv; it writes nothing to $OUT.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
STAGE=${DDD_RECIPE_STAGE:-/tmp/ddd-recipe}
PY_TOOL=${PY_TOOL:-python3}

mkdir -p "$STAGE"
rm -f "$STAGE/gguf.xz.part0"
cp "$HERE/gguf.xz.part0" "$STAGE/gguf.xz.part0.tmp"
"$PY_TOOL" - "$STAGE/gguf.xz.part0.tmp" "$(cat "$HERE/part0.sha256")" <<'EOF'
import hashlib, sys
h = hashlib.sha256()
with open(sys.argv[1], "rb") as f:
    for b in iter(lambda: f.read(1 << 20), b""):
        h.update(b)
if h.hexdigest() != sys.argv[2]:
    sys.exit(f"call 1: the stashed piece's SHA-256 is {h.hexdigest()}, prepare recorded {sys.argv[2]}")
EOF
mv "$STAGE/gguf.xz.part0.tmp" "$STAGE/gguf.xz.part0"
echo "call 1: stashed $(stat -c %s "$STAGE/gguf.xz.part0") bytes of the compressed target in $STAGE (SHA-256 checked)"
echo "call 1: now run 'bash .device/call2/run.sh' (carry .device/call2) while this machine is warm"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || true
