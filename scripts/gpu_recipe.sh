#!/usr/bin/env bash
# The head-training recipe on a lent GPU machine that has no network and takes at most ~64 MiB per call.
#
#   here:            bash scripts/gpu_recipe.sh prepare   # .device/: inputs, the GGUF in two pieces, the gguf reader
#                                                         #   (each call's carry with the work tree within 64 MiB)
#   GPU, call 1:     bash scripts/gpu_recipe.sh stash     # carry .device/gguf.part0: kept outside the work tree
#   GPU, call 2:     bash scripts/gpu_recipe.sh train     # carry .device/gguf.part1 .device/recipe_inputs.npz
#                                                         #       .device/gguf.sha256 .device/pylib
#
# Call 2 must follow call 1 while the machine is still warm (about 30 s). `train` joins the pieces, checks their
# SHA-256, runs `make train-gpu` (the recipe: 9 minutes of wall time by default) with the repository on
# PYTHONPATH, and copies recipe.json, the heads, the fits' metrics and the regenerated replies (gzipped) to $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=${DDD_RECIPE_STAGE:-/tmp/ddd-recipe}
DEV=.device

case "${1:-}" in
prepare)
  PY=${PY:-.venv/bin/python}
  mkdir -p "$DEV"
  "$PY" -m ddd_jax.cli train-draft recipe-inputs --out "$DEV/recipe_inputs.npz" ${INPUTS_EXTRA:-}
  GGUF=$("$PY" -c "from ddd_jax.checkpoints.registry import named_source; print(named_source('smollm2-135m-instruct'))")
  # A call carries at most 64 MiB together with the work tree: call 1 takes as much of the GGUF as fits beside the
  # tree, call 2 the rest with the inputs and the reader; each keeps 1-2 MiB spare for the transfer's own overhead
  # and files added to the tree later. Run `prepare` again after adding files.
  limit=$(( 67108864 - 1048576 ))
  tree=$(git ls-files -co --exclude-standard -z | xargs -0 du -cb | tail -1 | cut -f1)
  size=$(stat -c %s "$GGUF")
  first=$(( limit - tree - 1048576 ))
  [ "$first" -lt "$size" ] || first=$(( (size + 1) / 2 ))
  head -c "$first" "$GGUF" > "$DEV/gguf.part0"
  tail -c +"$(( first + 1 ))" "$GGUF" > "$DEV/gguf.part1"
  sha256sum "$GGUF" | cut -d' ' -f1 > "$DEV/gguf.sha256"
  rm -rf "$DEV/pylib" && mkdir -p "$DEV/pylib"
  cp -r "$("$PY" -c 'import gguf, os; print(os.path.dirname(gguf.__file__))')" "$DEV/pylib/"
  find "$DEV/pylib" -name __pycache__ -prune -exec rm -rf {} +
  du -sh "$DEV"/*
  call1=$(( tree + $(stat -c %s "$DEV/gguf.part0") ))
  rest=$(du -cb "$DEV/gguf.part1" "$DEV/gguf.sha256" "$DEV/recipe_inputs.npz" "$DEV/pylib" | tail -1 | cut -f1)
  call2=$(( tree + rest ))
  echo "with the work tree ($tree bytes), call 1 carries $call1 bytes and call 2 $call2 (64 MiB less 1 MiB: $limit)"
  [ "$call2" -le "$limit" ] || { echo "prepare: call 2 would carry over 64 MiB: make the inputs smaller" \
    "(INPUTS_EXTRA='--max-context-len 384')" >&2; exit 2; } ;;
stash)
  mkdir -p "$STAGE"
  cp "$DEV/gguf.part0" "$STAGE/gguf.part0"
  ls -la "$STAGE"; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true ;;
train)
  [ -f "$STAGE/gguf.part0" ] || { echo "train: $STAGE/gguf.part0 missing: run 'stash' first on this machine" >&2; exit 2; }
  cat "$STAGE/gguf.part0" "$DEV/gguf.part1" > "$STAGE/target.gguf"
  echo "$(cat "$DEV/gguf.sha256")  $STAGE/target.gguf" | sha256sum -c -
  export PYTHONPATH="$PWD:$PWD/$DEV/pylib${PYTHONPATH:+:$PYTHONPATH}" DDD_JAX_NO_KERNELS=1 DDD_JAX_CACHE="$STAGE/cache"
  export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
  RUN="$STAGE/run"
  args="--inputs $DEV/recipe_inputs.npz --target $STAGE/target.gguf ${RECIPE_EXTRA:-}"
  rc=0
  if command -v make >/dev/null; then
    timeout -s INT "${RECIPE_WALL_S:-575}" make --no-print-directory train-gpu DDD_JAX="python3 -m ddd_jax.cli" RECIPE_OUT="$RUN" RECIPE_ARGS="$args" || rc=$?
  else
    timeout -s INT "${RECIPE_WALL_S:-575}" python3 -m ddd_jax.cli train-draft recipe --out "$RUN" $args || rc=$?
  fi
  if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT/recipe"
    cp "$RUN/recipe.json" "$OUT/recipe/" 2>/dev/null || true
    [ -d "$RUN/heads" ] && cp -r "$RUN/heads" "$OUT/recipe/"
    for f in eagle3 eagle1; do
      [ -f "$RUN/$f/metrics.jsonl" ] && cp "$RUN/$f/metrics.jsonl" "$OUT/recipe/$f.metrics.jsonl"
      [ -f "$RUN/$f/fit.json" ] && cp "$RUN/$f/fit.json" "$OUT/recipe/$f.fit.json"
    done
    for f in "$RUN"/regen/*.jsonl; do [ -f "$f" ] && gzip -c "$f" > "$OUT/recipe/$(basename "$f").gz"; done
  fi
  exit $rc ;;
*)
  echo "usage: $0 prepare | stash | train" >&2; exit 2 ;;
esac
