"""`ddd-jax generate` on the real SmolLM2 target: --json output, and DDD printing exactly vanilla's text."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddd_jax.cli import compile_cache_dir, main


def run_json(capsys, *argv):
    assert main(["generate", *argv, "--json", "--settings", "none"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.slow
def test_generate_json_and_ddd_equals_vanilla(capsys, tmp_path, smollm2_by_name):
    from ddd_jax import init_draft, save_draft
    head = tmp_path / "head"
    save_draft(init_draft(smollm2_by_name, 0), head)  # any head: output must not change
    common = ["--prompt", "What is the capital of France?", "--chat", "--max-new-tokens", "12"]
    van = run_json(capsys, *common)
    assert set(van) >= {"tokens", "text", "stats"} and len(van["tokens"]) <= 12
    assert "Paris" in van["text"]
    ddd = run_json(capsys, *common, "--method", "ddd", "--sync", "device", "--draft", str(head),
                   "--top-k", "2", "--total-tokens", "4", "--depth", "2", "--ddd-checks", "1", "--ddd-max-depth", "3",
                   "--draft-dtype", "float16")
    assert ddd["tokens"] == van["tokens"] and ddd["text"] == van["text"]
    assert ddd["stats"]["settings"]["draft_dtype"] == "float16"
    assert ddd["stats"]["host_syncs"] == 0 and len(ddd["stats"]["depth_per_call"]) == ddd["stats"]["target_calls"]
    # --compare: alternating timed runs of each after a warm-up; every run identical to vanilla
    cmp = run_json(capsys, *common, "--method", "ddd", "--draft", str(head), "--top-k", "2", "--total-tokens", "4",
                   "--depth", "2", "--compare", "--compare-repeat", "2")
    v = cmp["vanilla"]
    assert v["identical"] and v["runs"] == 2 and len(v["speedups"]) == 2 and v["speedup"] > 0
    assert cmp["tokens"] == van["tokens"]


def test_generate_bad_flags(capsys):
    assert main(["generate", "--prompt", "hi", "--max-new-tokens", "0", "--settings", "none"]) == 2
    assert "max-new-tokens" in capsys.readouterr().err
    assert main(["generate", "--prompt", "hi", "--compare", "--compare-repeat", "0", "--settings", "none"]) == 2
    assert "compare-repeat" in capsys.readouterr().err
    assert main(["generate", "--target", "/nonexistent/model", "--prompt", "hi", "--settings", "none"]) == 2
    assert "nonexistent" in capsys.readouterr().err
    assert main(["generate", "--prompt", "hi", "--ddd-checks", "5,x", "--settings", "none"]) == 2


def test_compile_cache_dir_respects_the_user(tmp_path, monkeypatch):
    monkeypatch.setenv("DDD_JAX_CACHE", str(tmp_path / "assets"))
    assert compile_cache_dir({}) == tmp_path / "assets" / "xla"
    assert compile_cache_dir({"DDD_JAX_COMPILE_CACHE": str(tmp_path / "x")}) == tmp_path / "x"
    assert compile_cache_dir({"DDD_JAX_COMPILE_CACHE": "0"}) is None
    assert compile_cache_dir({}, configured=str(tmp_path / "mine")) is None  # JAX_COMPILATION_CACHE_DIR / config


_COMPILE = ("from ddd_jax.cli import enable_compile_cache; print(enable_compile_cache()); "
            "import jax, jax.numpy as jnp; jax.block_until_ready(jax.jit(lambda x: jnp.sin(x) * 3 + 1)(jnp.ones(7)))")


@pytest.mark.parametrize("user_dir", [False, True])
def test_the_cli_caches_compiled_programs_where_it_says(tmp_path, user_dir):
    """A fresh process: the CLI's cache receives the compiled program; a folder the user named wins over it."""
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_PERSISTENT_CACHE")}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env["DDD_JAX_COMPILE_CACHE"] = str(ours)
    if user_dir:
        env["JAX_COMPILATION_CACHE_DIR"], env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = str(theirs), "0"
    out = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).parent.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == ("None" if user_dir else str(ours))
    used, unused = (theirs, ours) if user_dir else (ours, theirs)
    assert used.is_dir() and any(used.iterdir()), f"nothing cached in {used}"
    assert not unused.exists()
