"""`train-draft accept`: τ of every head in a folder (directories and .tar files) beside a reference, written to
accept.json / accept.md after each result, and a rerun that keeps what was measured."""
from __future__ import annotations

import json

import jax
import pytest

import ddd_jax.measure.acceptance
from ddd_jax import init_draft, llama, save_draft
from ddd_jax.checkpoints.ours import save_target
from ddd_jax.config import ModelConfig
from ddd_jax.target import Target
from train_draft import accept
from train_draft.accept import accept_heads, acceptance_result, find_heads

LABELS = ("eagle2-default", "ddd-paper")
PROMPTS = [[5, 9, 33, 2], [7, 8, 40, 41, 42, 3]]


def tiny_target() -> Target:
    cfg = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=256, eos_token_id=(1,))
    params = llama.init_params(cfg, jax.random.PRNGKey(0), std=0.2)
    params["embed"] = params["embed"] * 4.0
    return Target("tiny-accept", cfg, params)


def test_acceptance_result_reads_the_share_past_the_first_check():
    from ddd_jax import DDDConfig, TreeConfig
    run = {"method": "ddd", "tree": TreeConfig(), "ddd": DDDConfig(check_steps=(2, 4), max_depth=5)}
    res = {"tau": 1.5, "depth_hist": {1: 2, 2: 1, 3: 1, 5: 4}, "prompts": 2, "identical": 2, "per_prompt": []}
    r = acceptance_result(run, res)
    assert r["past_first_check"] == 5 / 8 and "per_prompt" not in r and r["settings"]["ddd"]["check_steps"] == (2, 4)
    assert "past_first_check" not in acceptance_result(dict(run, method="eagle2"), res)


@pytest.mark.slow  # ~10 s
def test_accept_heads_measures_every_head_and_resumes(tmp_path, monkeypatch):
    t = tiny_target()
    heads = tmp_path / "heads"
    save_draft(init_draft(t, 1), heads / "a")
    save_draft(init_draft(t, 2), heads / "b.tar")
    (heads / "notes.txt").write_text("not a head")
    (heads / "misc").mkdir()
    ref = tmp_path / "ref.tar"
    save_draft(init_draft(t, 3), ref)
    assert list(find_heads(heads)) == ["a", "b"]
    monkeypatch.setattr(accept, "mtbench_prompts", lambda target, limit: PROMPTS[:limit])
    out = tmp_path / "out"
    kw = dict(reference=str(ref), limit=2, max_new_tokens=8, batch_size=2, labels=LABELS, progress=False)

    r = accept_heads(t, heads, out, **kw)
    keys = [f"{h}/{lab}" for h in ("a", "b", "reference-ref") for lab in LABELS]
    saved = json.loads((out / "accept.json").read_text())
    assert sorted(saved["results"]) == sorted(keys) == sorted(r["measured_now"]) and not saved["not_measured"]
    assert saved["reference"]["head"] == str(ref) and not saved["errors"]
    for k in keys:
        res = saved["results"][k]
        assert res["tau"] >= 1.0 and res["prompts"] == 2 and res["identical"] == 2
        assert ("past_first_check" in res) == k.endswith("ddd-paper")
    md = (out / "accept.md").read_text()
    for k in keys:
        head, label = k.split("/")
        assert sum(line.startswith(f"| {head} | {label} | ") for line in md.splitlines()) == 1

    # a rerun through the command line (the target from our format) measures nothing new
    save_target(t, tmp_path / "target")

    def no_measuring(*a, **k):
        raise AssertionError("a rerun measured again")

    monkeypatch.setattr(ddd_jax.measure.acceptance, "measure_runs", no_measuring)
    from ddd_jax.cli import main
    assert main(["train-draft", "accept", "--heads", str(heads), "--out", str(out), "--target",
                 str(tmp_path / "target"), "--reference", str(ref), "--limit", "2", "--max-new-tokens", "8",
                 "--batch", "2", "--labels", ",".join(LABELS)]) == 0
    again = json.loads((out / "accept.json").read_text())
    assert again["measured_now"] == [] and again["results"] == saved["results"]

    # a head written again at the same path is measured again, and only it
    monkeypatch.undo()
    monkeypatch.setattr(accept, "mtbench_prompts", lambda target, limit: PROMPTS[:limit])
    save_draft(init_draft(t, 4), heads / "b.tar")
    r3 = accept_heads(t, heads, out, **kw)
    assert r3["measured_now"] == [f"b/{lab}" for lab in LABELS] and sorted(r3["results"]) == sorted(keys)


def test_accept_heads_errors(tmp_path):
    t = tiny_target()
    with pytest.raises(FileNotFoundError, match="no such directory"):
        find_heads(tmp_path / "none")
    heads = tmp_path / "heads"
    heads.mkdir()
    (heads / "broken.tar").write_bytes(b"no tar")
    r = accept_heads(t, heads, tmp_path / "out", reference="", prompts=PROMPTS, max_new_tokens=8, progress=False)
    assert r["results"] == {} and "broken" in r["errors"] and "cannot read this draft head tar" in r["errors"]["broken"]
    assert r["reference"]["head"] is None
    assert "Heads that did not load" in (tmp_path / "out" / "accept.md").read_text()


def test_accept_measures_at_the_runs_of_the_recipe():
    from train_draft import recipe
    for heads, ref, labels in [({"e3": "d3", "e1": "d1"}, {"ref": "dr"}, 0), ({"e3": "d3"}, None, 2)]:
        assert recipe.acceptance_runs is accept.acceptance_runs  # one implementation, the recipe's stage (f) too
        runs = accept.acceptance_runs(heads, ref, labels)
        assert list(runs)[:3 if ref else 1] == ["e3/eagle2-default"] + (["e1/eagle2-default", "ref/eagle2-default"]
                                                                         if ref else [])
    info = accept.device_info()
    assert {"backend", "device", "device_count", "host_cpu", "jax"} <= set(info)
