"""Bad inputs to load_target / render_chat fail with clear errors, and failed conversions leave nothing behind."""
from __future__ import annotations

import json

import numpy as np
import pytest

from ddd_jax.checkpoints import loading
from ddd_jax.chat import render_chat
from ddd_jax.checkpoints.loading import load_target
from ddd_jax.checkpoints.ours import save_target

pytest.importorskip("torch")


def _edit_weights(path, fn):
    from safetensors.numpy import load_file, save_file
    f = path / "model.safetensors"
    sd = dict(load_file(str(f)))
    fn(sd)
    save_file(sd, str(f))


def test_nonexistent_path_and_unknown_name(tmp_path):
    with pytest.raises(FileNotFoundError, match="no target at"):
        load_target(tmp_path / "nope")
    with pytest.raises(ValueError, match="unknown target name 'no-such-model'"):
        load_target("no-such-model")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_target(tmp_path)
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(ValueError, match="unsupported file"):
        load_target(tmp_path / "x.txt")


@pytest.mark.parametrize("problem, match", [
    ("missing", r"missing tensors \['layers.w_up\[1\]'\]"),
    ("misshaped", r"misshaped tensors model\.layers\.0\.self_attn\.k_proj\.weight: got \(64, 64\), expected \(32, 64\)"),
    ("unexpected", r"unexpected tensors \['model\.layers\.0\.self_attn\.q_norm\.weight'\]"),
    ("out_of_range", r"unexpected tensors \['model\.layers\.2\.mlp\.up_proj\.weight \(layer 2 >= 2 layers\)'\]"),
    ("no_lm_head", r"missing tensors \['lm_head'\]"),
])
def test_bad_tensors(tiny_hf_llama, problem, match):
    _, path = tiny_hf_llama(seed=0)
    edits = {
        "missing": lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight"),
        "misshaped": lambda sd: sd.__setitem__("model.layers.0.self_attn.k_proj.weight", np.zeros((64, 64), np.float32)),
        "unexpected": lambda sd: sd.__setitem__("model.layers.0.self_attn.q_norm.weight", np.ones(16, np.float32)),
        "out_of_range": lambda sd: sd.__setitem__("model.layers.2.mlp.up_proj.weight", sd["model.layers.1.mlp.up_proj.weight"]),
        "no_lm_head": lambda sd: sd.pop("lm_head.weight"),
    }
    _edit_weights(path, edits[problem])
    with pytest.raises(ValueError, match=match):
        load_target(path)


def test_duplicate_across_shards(tiny_hf_llama):
    from safetensors.numpy import load_file, save_file
    _, path = tiny_hf_llama(seed=0)
    sd = load_file(str(path / "model.safetensors"))
    save_file({"model.norm.weight": sd["model.norm.weight"]}, str(path / "extra.safetensors"))
    with pytest.raises(ValueError, match=r"duplicate tensors \['model\.norm\.weight"):
        load_target(path)


def test_tied_lm_head_is_ignored_and_inv_freq_skipped(tiny_hf_llama):
    _, path = tiny_hf_llama(tie=True, seed=0)
    _edit_weights(path, lambda sd: sd.update({"lm_head.weight": sd["model.embed_tokens.weight"],
                                              "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)}))
    assert "lm_head" not in load_target(path).params


def test_non_llama_and_draft_dirs(tmp_path, tiny_hf_llama):
    _, path = tiny_hf_llama(seed=0)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(cfg, model_type="gpt2", architectures=["GPT2LMHeadModel"])))
    with pytest.raises(ValueError, match=r"model_type 'gpt2' .* not supported \(supported model types: \['llama', "
                                         r"'mistral', 'qwen2', 'qwen3'\]\)"):
        load_target(path)
    (tmp_path / "head").mkdir()
    (tmp_path / "head" / "config.json").write_text(json.dumps({"format": "ddd-jax-eagle-head"}))
    with pytest.raises(ValueError, match="load_draft"):
        load_target(tmp_path / "head")
    _, path2 = tiny_hf_llama(seed=1)
    (path2 / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no weights found"):
        load_target(path2)


def test_corrupt_gguf_and_failed_named_conversion(tmp_path, isolated_cache, monkeypatch):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(200)))
    with pytest.raises(ValueError, match="not a readable GGUF"):
        load_target(bad)
    monkeypatch.setattr(loading, "NAMED_TARGETS", {"broken": ("x", "y")})
    monkeypatch.setattr(loading, "named_source", lambda name: bad)
    with pytest.raises(ValueError, match="not a readable GGUF"):
        load_target("broken")
    assert not (isolated_cache / "broken").exists()


def test_failed_save_leaves_no_directory(tiny_hf_llama, tmp_path):
    _, path = tiny_hf_llama(seed=0)
    t = load_target(path)
    t.params["embed"] = object()  # not an array: fails half way through writing
    with pytest.raises(Exception):
        save_target(t, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_chat_errors(tiny_hf_llama):
    from ddd_jax.chat import ChatTemplateError
    _, path = tiny_hf_llama(seed=0)
    t = load_target(path)
    with pytest.raises(ValueError, match="has no chat template"):
        render_chat(t, [{"role": "user", "content": "hi"}])
    t.chat_template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok"
    assert render_chat(t, [{"role": "user", "content": "hi"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="first must be user"):
        render_chat(t, [{"role": "system", "content": "hi"}])


def test_truncated_or_corrupt_head_file_names_the_file(tiny_hf_llama, tmp_path):
    from ddd_jax import init_draft, load_draft, save_draft
    t = load_target(tiny_hf_llama()[1])
    save_draft(init_draft(t), tmp_path / "head")
    f = tmp_path / "head" / "model.safetensors"
    whole = f.read_bytes()
    f.write_bytes(whole[:len(whole) - 100])
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor .* ends at byte .* truncated file"):
        load_draft(tmp_path / "head", t)
    f.write_bytes(whole[:4])
    with pytest.raises(ValueError, match=r"model\.safetensors: not a safetensors file \(too short\)"):
        load_draft(tmp_path / "head", t)
