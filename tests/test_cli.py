"""`ddd-jax generate` on the real SmolLM2 target: --json output, and DDD printing exactly vanilla's text."""
from __future__ import annotations

import json

import pytest

from ddd_jax.cli import main


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
