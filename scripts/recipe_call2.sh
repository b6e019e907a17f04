#!/usr/bin/env bash
# Remote call 2 of the head-training recipe on a lent GPU machine (written into .device/call2/run.sh by
# `scripts/gpu_recipe.sh prepare`; see docs/training.md, "On a lent GPU machine"):
#
#   bash .device/call2/run.sh          # carry .device/call2; right after call 1, on the same warm machine
#
# 1. The target: joins call 1's stashed piece ($DDD_RECIPE_STAGE, default /tmp/ddd-recipe) with its own, decompresses
#    them with python3's stdlib lzma and checks the GGUF's SHA-256 (a rerun on the same machine reuses a checked
#    $DDD_RECIPE_STAGE/target.gguf and needs no stash).
# 2. Runs `python3 -m ddd_jax.cli train-draft recipe` from the repository root ($(dirname "$0")/../.., on
#    PYTHONPATH with this folder's pylib/) with --export-dir "$OUT": the recipe itself writes each stage's product
#    into $OUT as it ends, within what a remote run hands back (8 files, two folders down). This script writes
#    nothing into $OUT; the recipe's log goes to stdout and to $DDD_RECIPE_STAGE/recipe.log.
# 3. Timing: the remote limit is $LIMIT_S (default 600 s) from the command's start. The recipe gets
#    --deadline-s LIMIT_S - SECONDS - MARGIN_S (SECONDS: this script's own time so far: copies, joins, checks;
#    MARGIN_S 40), its wall time from process start, loading and compiling included, and exits by itself then. The
#    40 s margin: 30 s before the limit to spare, 10 s for the recipe's exit after its deadline. As a safety net,
#    `timeout` sends SIGINT INT_BEFORE_S (15) s before the limit and SIGKILL KILL_AFTER_S (5) s later; then any
#    temporary file of a write the signals cut short (a dotfile: the export folder's own names never start with a
#    dot) is removed from $OUT, so what comes back is whole files only.
#
# Environment: RECIPE_EXTRA (more recipe flags, after those `prepare` baked into settings.sh), LIMIT_S, OUT (default
# $DDD_RECIPE_STAGE/out off a remote machine), PY_RUN (the python that runs the recipe, default python3), PY_TOOL
# (the python that joins and checks, default python3), SKIP_DEP_CHECK=1; MARGIN_S, INT_BEFORE_S, KILL_AFTER_S and
# MIN_RECIPE_S (the least --deadline-s worth starting, 60) for tests with a short LIMIT_S.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
STAGE=${DDD_RECIPE_STAGE:-/tmp/ddd-recipe}
LIMIT_S=${LIMIT_S:-600}
MARGIN_S=${MARGIN_S:-40}
INT_BEFORE_S=${INT_BEFORE_S:-15}
KILL_AFTER_S=${KILL_AFTER_S:-5}
MIN_RECIPE_S=${MIN_RECIPE_S:-60}
PY_RUN=${PY_RUN:-python3}
PY_TOOL=${PY_TOOL:-python3}
BAKED_RECIPE_EXTRA=
# shellcheck source=/dev/null
[ -f "$HERE/settings.sh" ] && . "$HERE/settings.sh"
OUT=${OUT:-$STAGE/out}
mkdir -p "$STAGE" "$OUT"

# 1. the target
"$PY_TOOL" - "$STAGE" "$HERE" <<'EOF'
import hashlib, lzma, os, sys, time
stage, here = sys.argv[1:3]
want = open(os.path.join(here, "gguf.sha256")).read().split()[0]
want0 = open(os.path.join(here, "part0.sha256")).read().split()[0]
target = os.path.join(stage, "target.gguf")
t0 = time.time()

def sha(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 22), b""):
            h.update(b)
    return h.hexdigest()

if os.path.exists(target) and sha(target) == want:
    print(f"call 2: {target} is already there (SHA-256 checked)", flush=True)
    sys.exit(0)
part0 = os.path.join(stage, "gguf.xz.part0")
if not os.path.exists(part0):
    sys.exit(f"call 2: {part0} is missing: run 'bash .device/call1/run.sh' (carry .device/call1) on this machine "
             "first, and this call at once after it, while the machine is still warm")
d, out, h, h0 = lzma.LZMADecompressor(), target + ".tmp", hashlib.sha256(), hashlib.sha256()
with open(out, "wb") as w:
    for i, piece in enumerate((part0, os.path.join(here, "gguf.xz.part1"))):
        with open(piece, "rb") as f:
            for b in iter(lambda: f.read(1 << 22), b""):
                if i == 0:
                    h0.update(b)
                x = d.decompress(b)
                h.update(x)
                w.write(x)
        if i == 0 and h0.hexdigest() != want0:
            os.unlink(out)
            sys.exit(f"call 2: the stashed piece {part0} is not the one this call belongs to (SHA-256 "
                     f"{h0.hexdigest()}, prepare recorded {want0}): run this prepare's call 1 again first")
if not d.eof or d.unused_data or h.hexdigest() != want:
    os.unlink(out)
    sys.exit(f"call 2: the joined target's SHA-256 is {h.hexdigest()}, prepare recorded {want} (stream complete: "
             f"{d.eof})")
os.replace(out, target)
print(f"call 2: joined and decompressed {os.path.getsize(target)} bytes to {target} in {time.time() - t0:.1f} s "
      "(SHA-256 checked)", flush=True)
EOF

# 2. the recipe
export PYTHONPATH="$ROOT:$HERE/pylib${PYTHONPATH:+:$PYTHONPATH}" DDD_JAX_NO_KERNELS=1 DDD_JAX_CACHE="$STAGE/cache"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
if [ "${SKIP_DEP_CHECK:-}" != 1 ]; then
  "$PY_TOOL" -c '
import importlib.util, sys
need = "jax flax optax orbax numpy ml_dtypes gguf yaml tokenizers jinja2 tqdm ddd_jax train_draft".split()
missing = [m for m in need if importlib.util.find_spec(m) is None]
sys.exit(f"call 2: python3 here lacks {missing} (SKIP_DEP_CHECK=1 runs the recipe anyway)" if missing else 0)'
fi
init=()
for f in "$HERE"/init/*; do
  if [ -f "$f" ]; then init=(--init "$f"); fi
done
S=$(( LIMIT_S - SECONDS - MARGIN_S ))
[ "$S" -ge "$MIN_RECIPE_S" ] || { echo "call 2: only $S s would be left for the recipe (LIMIT_S=$LIMIT_S, $SECONDS s spent)" >&2; exit 2; }
echo "call 2: $SECONDS s spent; the recipe gets --deadline-s $S (limit $LIMIT_S s, $MARGIN_S s margin)," \
  "products to $OUT, log also in $STAGE/recipe.log"
set +e
# shellcheck disable=SC2086  # the extra flags are words
timeout -s INT -k "$KILL_AFTER_S" $(( LIMIT_S - INT_BEFORE_S - SECONDS )) "$PY_RUN" -m ddd_jax.cli train-draft recipe --out "$STAGE/run" \
  --inputs "$HERE/recipe_inputs.npz" --target "$STAGE/target.gguf" --export-dir "$OUT" --deadline-s "$S" \
  ${init[@]+"${init[@]}"} $BAKED_RECIPE_EXTRA ${RECIPE_EXTRA:-} 2>&1 | tee "$STAGE/recipe.log"
rc=${PIPESTATUS[0]}
set -e
case "$rc" in
124) echo "call 2: the recipe ran past its deadline and was interrupted (SIGINT) at $SECONDS s" ;;
137) echo "call 2: the recipe ignored SIGINT and was killed (SIGKILL) at $SECONDS s" ;;
esac
find "$OUT" -mindepth 1 -maxdepth 3 -type f -name '.*' -print -delete | sed 's/^/call 2: removed a cut-short write: /'
echo "call 2: exit $rc after $SECONDS s; \$OUT holds $(find "$OUT" -type f | wc -l) files:"
(cd "$OUT" && find . -type f -printf '%s\t%p\n' | sort -k2)
exit "$rc"
