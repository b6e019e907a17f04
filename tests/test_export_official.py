"""`save_official` / `ddd-jax convert export-head`: our heads in SafeAILab/EAGLE's (and SGLang's) layouts. Round trips
back through the importers are bit exact (float16 and bfloat16, reduced draft vocabularies included); the PyTorch
reference modules read the exported files and agree with our forward; the files hold every config field and tensor
the official loaders read; bad input fails clearly and writes nothing."""
from __future__ import annotations

import dataclasses
import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddd_jax import Draft, Target, eagle, head_kinds, init_draft, llama, load_draft, save_draft, save_official
from ddd_jax import io as dio
from ddd_jax.checkpoints.eagle_official import EAGLE1_RULES, EXTENSIONS_FILE
from ddd_jax.checkpoints.ours import save_target
from ddd_jax.checkpoints.safetensors import safetensors_sources
from ddd_jax.cli import main
from ddd_jax.keytable import export, source_name
from spec_helpers import TINY

# ------------------------------------------------------------------------------------------ what the loaders read
# SafeAILab/EAGLE, EAGLE-1/2: `eagle/model/ea_model.py` (`EaModel.__init__`: `EConfig.from_pretrained(config.json)`,
# `con["bias"]` with default true, `Model1(config, bias=...)`, `load_state_dict(state_dict, strict=False)`),
# `eagle/model/configs.py` (`EConfig`: LlamaConfig defaults, rope_scaling only linear / dynamic) and
# `eagle/model/cnets1.py` (`Model`, `LlamaDecoderLayer`, `LlamaAttention`, `LlamaMLP`). The config fields they read;
# `bias` (fc) and `qkv_bias` (`hasattr`) are read when present and written only when they differ from the default.
EAGLE_CONFIG_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_theta",
                       "rope_scaling", "pretraining_tp", "pad_token_id")
EAGLE_OPTIONAL_FIELDS = ("bias", "qkv_bias")
# cnets1 `Model(config)` with num_hidden_layers=1: its state dict (layer 0 has no input_layernorm; fc.bias with bias)
EAGLE_TENSORS = ("embed_tokens.weight", "fc.weight", "fc.bias",
                 *(f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"),
                 *(f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
                 "layers.0.post_attention_layernorm.weight")
# EAGLE-3: `eagle/model/cnets.py` (`Model`: `config.draft_vocab_size` for lm_head and d2t, `hasattr(config,
# "target_hidden_size")` for fc's width -- and then no embedding read from the target: it must be in the file)
# and `ea_model.py` (`config.vocab_size == config.draft_vocab_size` drops d2t / t2d).
EAGLE3_CONFIG_FIELDS = EAGLE_CONFIG_FIELDS + ("draft_vocab_size", "target_hidden_size")
EAGLE3_TENSORS = ("embed_tokens.weight", "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
                  *(f"midlayer.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")),
                  *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
                  *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")))
# SGLang `python/sglang/srt/models/llama_eagle3.py` (`LlamaForCausalLMEagle3`, `LlamaModel`, `LlamaDecoderLayer`) and
# the layer it extends in `python/sglang/srt/models/llama.py` (`LlamaDecoderLayer`, `LlamaAttention`): the model
# class by `architectures`; `tie_word_embeddings` true would make lm_head the embedding, `draft_vocab_size` absent
# would take the target's lm_head; `bias` / `attention_bias` (getattr, false) give attention biases; `head_dim`
# (getattr, hidden / heads). `load_weights` maps d2t to `hot_token_id` (d2t + arange), skips t2d, and prefixes
# "model." to midlayer.*, fc.*, norm.*, embed_tokens.* (the eagle worker then shares the target's embedding when
# target_hidden_size == hidden_size).
SGLANG_EAGLE3_CONFIG_FIELDS = ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
                               "hidden_act", "rms_norm_eps", "num_hidden_layers", "num_attention_heads",
                               "num_key_value_heads", "head_dim", "rope_theta", "rope_scaling",
                               "max_position_embeddings", "tie_word_embeddings", "draft_vocab_size",
                               "target_hidden_size", "attention_bias")
SGLANG_EAGLE3_TENSORS = ("fc.weight", "norm.weight", "lm_head.weight", "d2t",
                         *(f"midlayer.{n}.weight" for n in ("input_layernorm", "hidden_norm",
                                                            "post_attention_layernorm")),
                         *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
                         *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")))


# ------------------------------------------------------------------------------------------------- tiny heads
@functools.lru_cache(maxsize=None)
def target(vocab: int = 96) -> Target:
    """A tiny random target with 4 layers (EAGLE-3 reads layers 2, 2, 1)."""
    cfg = dataclasses.replace(TINY, num_hidden_layers=4, vocab_size=vocab)
    return Target(f"tiny4-v{vocab}", cfg, llama.init_params(cfg, jax.random.PRNGKey(0), std=0.25))


def randomized(d: Draft, seed: int) -> Draft:
    """`d` with every float weight random (norms near 1, biases non-zero), so a mixed-up tensor shows."""
    flat = dio.flatten(d.params)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(flat))
    out = {}
    for (k, v), key in zip(sorted(flat.items()), keys):
        if k == "d2t":
            out[k] = v
            continue
        noise = jax.random.normal(key, v.shape, jnp.float32)
        out[k] = (1.0 + 0.1 * noise) if "norm" in k else 0.05 * noise
    return Draft(d.config, dio.unflatten(out), d.target)


HEADS = ("eagle1", "eagle1-vocab", "eagle1-no-fc-bias", "eagle3", "eagle3-narrow")


@functools.lru_cache(maxsize=None)
def head(name: str) -> Draft:
    t = target()
    if name == "eagle1":
        return randomized(init_draft(t, seed=1), 1)
    if name == "eagle1-vocab":  # a reduced draft vocabulary, not in id order
        return eagle.with_draft_vocab(randomized(init_draft(t, seed=2), 2), [95, 3, 40, 7, 12, 60, 2, 33, 81, 0])
    if name == "eagle1-no-fc-bias":
        return randomized(init_draft(t, seed=3, fc_bias=False), 3)
    if name == "eagle3":
        d = randomized(init_draft(t, seed=4, head_type="eagle3", draft_vocab_size=40), 4)
        ids = np.sort(np.random.default_rng(4).choice(96, 40, replace=False))  # d2t offsets far from zero
        return Draft(d.config, {**d.params, "d2t": jnp.asarray(ids, jnp.int32)}, t)
    if name == "eagle3-narrow":  # narrower than its target: its own embedding
        return randomized(init_draft(t, seed=5, head_type="eagle3", draft_vocab_size=24, hidden_size=32, head_dim=8,
                                     intermediate_size=64, target_hidden_size=48), 5)
    raise KeyError(name)


def assert_same_params(a: Draft, b: Draft):
    fa, fb = dio.flatten(a.params), dio.flatten(b.params)
    assert sorted(fa) == sorted(fb)
    for k in fa:
        x, y = np.asarray(fa[k]), np.asarray(fb[k])
        assert x.dtype == y.dtype and x.shape == y.shape, k
        np.testing.assert_array_equal(x.view(np.uint16) if x.dtype.itemsize == 2 else x,
                                      y.view(np.uint16) if y.dtype.itemsize == 2 else y, err_msg=k)  # bit for bit


def tensors(path) -> dict:
    return {s.name: s for s in safetensors_sources(path / "model.safetensors")}


# ------------------------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", HEADS)
def test_round_trip_is_bit_exact(tmp_path, name, dtype):
    d = head(name)
    out = save_official(d, tmp_path / "official", dtype=dtype)
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == sorted(
        ["README.md", "config.json", "model.safetensors"] + ([EXTENSIONS_FILE] if name == "eagle1-vocab" else []))
    back = load_draft(out, d.target, dtype=dtype)  # the official importer, as for any official head
    # (fc_bias means nothing to an EAGLE-3 head, whose fc never has a bias: the importer says False)
    assert back.config == (dataclasses.replace(d.config, fc_bias=False) if name.startswith("eagle3") else d.config)
    assert_same_params(back, d.astype(jnp.dtype(dtype)))
    src = tensors(out)
    floats = {s.dtype for s in src.values() if s.dtype.kind == "f" or s.dtype.name == "bfloat16"}
    assert floats == {np.dtype(jnp.dtype(dtype))}


def test_round_trip_through_the_command_line(tmp_path, capsys):
    d = head("eagle1-vocab")
    tdir = tmp_path / "target"
    save_target(d.target, tdir)
    ours = tmp_path / "ours.tar"  # our format, one tar; its config names the target's directory
    save_draft(Draft(dataclasses.replace(d.config, target_name=str(tdir)), d.params, d.target), ours)
    out, again = tmp_path / "official", tmp_path / "again"
    assert main(["convert", "export-head", str(ours), "--out", str(out), "--dtype", "bfloat16"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main(["convert", "eagle", str(out), str(again), "--target", str(tdir), "--dtype", "bfloat16"]) == 0
    assert_same_params(load_draft(again, d.target, dtype="bfloat16"), d.astype(jnp.bfloat16))


# ------------------------------------------------------------------------------------- the PyTorch reference
@pytest.mark.parametrize("name", ["eagle1-vocab", "eagle1-no-fc-bias", "eagle3", "eagle3-narrow"])
def test_torch_reference_reads_the_export(tmp_path, name):
    pytest.importorskip("torch")
    from ddd_jax.checkpoints.torch_ref import check_head
    d = head(name)
    out = save_official(d, tmp_path / "official", dtype="float32")
    diffs = check_head(out, d)  # torch modules with the official state-dict names, loaded strictly
    assert diffs["max_feature_diff"] < 1e-4 and diffs["max_logit_diff"] < 1e-4, diffs


def test_torch_reference_state_dicts_are_the_exported_names(tmp_path):
    torch = pytest.importorskip("torch")
    from ddd_jax.checkpoints.torch_ref import TorchEagle3Head, TorchEagleHead
    for name, module in (("eagle1-vocab", TorchEagleHead), ("eagle3", TorchEagle3Head)):
        out = save_official(head(name), tmp_path / name)
        cfg = json.loads((out / "config.json").read_text())
        with torch.device("meta"):
            sd = module(cfg).state_dict()
        assert set(tensors(out)) == set(sd), name  # nothing of ours where their strict loader reads
        for k, s in tensors(out).items():
            if k in sd:
                assert tuple(s.shape) == tuple(sd[k].shape), k


# -------------------------------------------------------------------------------- what official loaders read
def test_export_holds_what_official_loaders_read(tmp_path):
    e1 = save_official(head("eagle1"), tmp_path / "e1")
    cfg = json.loads((e1 / "config.json").read_text())
    assert set(EAGLE_CONFIG_FIELDS) <= set(cfg) and cfg["num_hidden_layers"] == 1
    assert cfg["rope_scaling"] is None and cfg["pretraining_tp"] == 1 and cfg["hidden_act"] == "silu"
    assert not set(EAGLE_OPTIONAL_FIELDS) & set(cfg)  # an fc bias and no q/k/v biases: the defaults
    assert set(tensors(e1)) == set(EAGLE_TENSORS)  # embed_tokens.weight too: strict=False would not miss it

    nb = save_official(head("eagle1-no-fc-bias"), tmp_path / "nb")
    assert json.loads((nb / "config.json").read_text())["bias"] is False
    assert set(tensors(nb)) == set(EAGLE_TENSORS) - {"fc.bias"}

    v = save_official(head("eagle1-vocab"), tmp_path / "v")
    assert set(tensors(v)) == set(EAGLE_TENSORS)  # EAGLE-2's ea_model.py: load_state_dict(strict=True)
    side = {s.name: s for s in safetensors_sources(v / EXTENSIONS_FILE)}  # ours, in a file they never open
    assert set(side) == {"draft_token_ids"} and side["draft_token_ids"].dtype == np.int64
    np.testing.assert_array_equal(side["draft_token_ids"].load(), [95, 3, 40, 7, 12, 60, 2, 33, 81, 0])
    card = (v / "README.md").read_text()  # the model card names the side file and what each program drafts from
    assert EXTENSIONS_FILE in card and "whole vocabulary" in card and "lossless" in card

    d3 = head("eagle3")
    e3 = save_official(d3, tmp_path / "e3")
    cfg = json.loads((e3 / "config.json").read_text())
    assert set(EAGLE3_CONFIG_FIELDS) <= set(cfg) and set(SGLANG_EAGLE3_CONFIG_FIELDS) <= set(cfg)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["tie_word_embeddings"] is False
    assert cfg["draft_vocab_size"] == 40 and cfg["target_hidden_size"] == 48 and not cfg["attention_bias"]
    assert cfg["head_dim"] == cfg["hidden_size"] // cfg["num_attention_heads"]
    src = tensors(e3)
    assert set(src) == set(EAGLE3_TENSORS) and set(SGLANG_EAGLE3_TENSORS) <= set(src)
    ids = np.asarray(d3.params["d2t"])
    off, t2d = np.asarray(src["d2t"].load()), np.asarray(src["t2d"].load())
    assert off.dtype == np.int64 and t2d.dtype == bool and t2d.shape == (96,)
    np.testing.assert_array_equal(np.arange(40) + off, ids)  # EAGLE: topk_index + d2t[topk_index]; SGLang hot ids
    np.testing.assert_array_equal(np.flatnonzero(t2d), np.sort(ids))
    assert "base_model: tiny4-v96" in (e3 / "README.md").read_text()


@pytest.mark.parametrize("name", [h for h in HEADS if h.startswith("eagle1")])
def test_model_file_holds_only_official_tensors(tmp_path, name):
    """model.safetensors of an EAGLE-1/2 export holds the official cnets1 `Model`'s tensors and nothing else (a
    strict load fails on any other key); the torch mirror, which defines exactly those names, loads it strictly."""
    torch = pytest.importorskip("torch")
    from ddd_jax.checkpoints.torch_ref import TorchEagleHead, load_official_head
    out = save_official(head(name), tmp_path / name, dtype="float32")
    assert set(tensors(out)) <= set(EAGLE_TENSORS), set(tensors(out)) - set(EAGLE_TENSORS)
    cfg = json.loads((out / "config.json").read_text())
    with torch.device("meta"):
        assert set(TorchEagleHead(cfg).state_dict()) == set(tensors(out))
    load_official_head(out)  # strict=True inside


def test_an_extension_in_the_model_file_fails_the_strict_mirror(tmp_path):
    """The mirror is as strict as EAGLE's loader: a model.safetensors with `draft_token_ids` in it (what exports
    wrote before the side file) fails its load -- and still loads in ddd-jax, bit for bit."""
    pytest.importorskip("torch")
    from ddd_jax.checkpoints.safetensors import write_safetensors
    from ddd_jax.checkpoints.torch_ref import load_official_head
    d = head("eagle1-vocab")
    out = save_official(d, tmp_path / "new", dtype="float16")
    old = tmp_path / "old"
    old.mkdir()
    for f in ("config.json", "README.md"):
        (old / f).write_bytes((out / f).read_bytes())
    merged = {k: np.asarray(s.load()) for k, s in tensors(out).items()}
    merged["draft_token_ids"] = np.asarray(safetensors_sources(out / EXTENSIONS_FILE)[0].load())
    write_safetensors(merged, old / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(RuntimeError, match="draft_token_ids"):
        load_official_head(old)
    assert_same_params(load_draft(old, d.target, dtype="float16"), d.astype(jnp.float16))
    (out / EXTENSIONS_FILE).unlink()  # no side file: the whole vocabulary, as EAGLE's code drafts
    assert "d2t" not in load_draft(out, d.target).params


def test_key_table_inversion_and_unmapped_params():
    assert source_name(r"(?:midlayer|layers\.(0))\.mlp\.up_proj\.weight") == "midlayer.mlp.up_proj.weight"
    assert source_name(r"model\.layers\.(\d+)\.input_layernorm\.weight") == "model.layers.{}.input_layernorm.weight"
    with pytest.raises(ValueError, match="cannot invert"):
        source_name(r".*rotary_emb\.inv_freq")
    params = dio.flatten(head("eagle1").params)
    params["extra_w"] = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match=r"no rule exports \['extra_w'\]"):
        export(dio.unflatten(params), EAGLE1_RULES, "test head")


# ------------------------------------------------------------------------------------------------ bad input
def _left(tmp_path) -> list:
    return sorted(p.name for p in tmp_path.iterdir())


@pytest.mark.parametrize("layout, name, match", [
    ("eagle4", "eagle1", r"unknown layout 'eagle4'; the official layouts are 'eagle' \(EAGLE-1/2\), 'eagle3'"),
    ("eagle3", "eagle1", r"layout 'eagle3' holds EAGLE-3 heads, but this is an EAGLE-1/2 head.*its layout is 'eagle'"),
    ("eagle", "eagle3", r"layout 'eagle' holds EAGLE-1/2 heads, but this is an EAGLE-3 head"),
])
def test_bad_layouts_fail_and_write_nothing(tmp_path, layout, name, match):
    with pytest.raises(ValueError, match=match):
        save_official(head(name), tmp_path / "out", layout=layout)
    assert _left(tmp_path) == []


def test_a_kind_without_an_official_layout(tmp_path):
    kind = head_kinds.register(dataclasses.replace(head_kinds.get("eagle1"), name="no-layout", title="test"))
    try:
        d = eagle.init_draft(target(), 0, head_type="no-layout")
        with pytest.raises(ValueError, match=r"test heads \(head_type 'no-layout'\) have no official layout"):
            save_official(d, tmp_path / "out")
    finally:
        head_kinds._KINDS.pop(kind.name)
    assert _left(tmp_path) == []


def test_heads_the_layouts_cannot_hold(tmp_path):
    t = target()
    with pytest.raises(ValueError, match=r"head_dim=16 with hidden_size=48 and 4 heads"):
        save_official(init_draft(t, head_dim=16), tmp_path / "out")
    with pytest.raises(ValueError, match=r"q/k/v biases \(qkv_bias; EAGLE-3's layer has none\)"):
        save_official(init_draft(t, head_type="eagle3", draft_vocab_size=8, qkv_bias=True), tmp_path / "out")
    with pytest.raises(ValueError, match="dtype must be one of"):
        save_official(head("eagle1"), tmp_path / "out", dtype="int8")
    assert _left(tmp_path) == []


def test_existing_output_and_failures_while_writing_leave_things_as_they_were(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="not an empty directory"):
        save_official(head("eagle1"), out)
    assert _left(out) == ["mine.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    save_official(head("eagle1"), empty)  # an empty directory is fine
    from ddd_jax.checkpoints import safetensors as st

    def broken(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(st, "write_safetensors", broken)
    with pytest.raises(OSError, match="disk full"):
        save_official(head("eagle3"), tmp_path / "new")
    assert _left(tmp_path) == ["empty", "out"]  # no half-written directory, no temp directory


def test_command_line_errors_write_nothing(tmp_path, capsys):
    d = head("eagle1")
    tdir, other = tmp_path / "target", tmp_path / "other"
    save_target(d.target, tdir)
    save_target(target(128), other)
    ours = tmp_path / "ours"
    save_draft(d, ours)  # names its target "tiny4-v96": not a name that loads
    out = tmp_path / "out"
    cases = [
        (["--target", str(other)], r"draft head was built for vocab_size=96, hidden_size=48 but the target has "
                                   r"vocab_size=128"),
        ([], r"the head names its target 'tiny4-v96', which does not load .*pass --target"),
        (["--target", str(tdir), "--layout", "eagle4"], "unknown layout 'eagle4'"),
        (["--target", str(tdir), "--layout", "eagle3"], "layout 'eagle3' holds EAGLE-3 heads"),
    ]
    for extra, match in cases:
        assert main(["convert", "export-head", str(ours), "--out", str(out), *extra]) == 2, extra
        assert re.search(match, capsys.readouterr().err), extra
        assert not out.exists()
    out.mkdir()
    (out / "x").write_text("x")
    assert main(["convert", "export-head", str(ours), "--out", str(out), "--target", str(tdir)]) == 2
    assert "not an empty directory" in capsys.readouterr().err and _left(out) == ["x"]


# ------------------------------------------------------------------------------------------- the shipped head
@pytest.mark.slow
def test_shipped_head_exports_and_the_reference_agrees(smollm2_by_name, smollm2_head, tmp_path, capsys):
    pytest.importorskip("torch")
    from ddd_jax.checkpoints.torch_ref import check_head
    out = tmp_path / "smollm2-eagle"
    assert main(["convert", "export-head", "smollm2-135m-instruct-eagle", "--out", str(out)]) == 0
    card = (out / "README.md").read_text()
    assert card.startswith("---\nbase_model: HuggingFaceTB/SmolLM2-135M-Instruct\nlibrary_name: ddd-jax\n"
                           "license: apache-2.0\n")
    assert "## Training" in card and "held-out top-1 | 0.627" in card and "## Acceptance (τ)" in card
    assert f"| `draft_token_ids` | {EXTENSIONS_FILE} | [8192] | int64 |" in card
    assert set(tensors(out)) == set(EAGLE_TENSORS)
    back = load_draft(out, smollm2_by_name, dtype="float16")
    assert_same_params(back, smollm2_head.astype(jnp.float16))  # the shipped weights are float16
    diffs = check_head(out, smollm2_head)  # the torch reference modules reading the exported files
    assert diffs["max_feature_diff"] < 1e-3 and diffs["max_logit_diff"] < 1e-3, diffs
