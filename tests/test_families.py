"""Model families (Qwen2, Qwen3, Mistral; Llama-3 rope scaling) as switches of the one decoder layer: tiny random
transformers models through every loader (HF dirs, sharded, .bin, GGUF, our format) -> logits and greedy decoding
equal transformers', every speculative mode equals vanilla with a head that follows the target's family, official
EAGLE heads for Qwen2 targets (`qkv_bias`), and clear errors for what is not implemented."""
from __future__ import annotations

import json
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import PARITY_TOKENS, assert_same_target, our_logits, torch_logits, write_tiny_hf
from ddd_jax import DDDConfig, Target, TreeConfig, generate, load_draft, load_target, save_draft
from ddd_jax import io as dio
from ddd_jax.checkpoints.ours import save_target
from ddd_jax.config import FAMILIES, DraftConfig, ModelConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOKENS = np.array(PARITY_TOKENS, np.int32)
LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16)
# family -> (model_type, config overrides): Mistral with a 5-token window (shorter than the test sequences, so the
# window changes the logits); Qwen2 with its window on every layer; Llama-3.x rope scaling.
CASES = {
    "qwen2": ("qwen2", {}),
    "qwen2-tied": ("qwen2", {"tie": True}),
    "qwen3": ("qwen3", {}),
    "qwen3-tied": ("qwen3", {"tie": True}),
    "mistral-swa5": ("mistral", {"sliding_window": 5}),
    "qwen2-swa4": ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0}),
    "llama3-rope": ("llama", {"rope_scaling": LLAMA3_ROPE}),
}
LEAVES = {"qwen2": {"bq", "bk", "bv"}, "qwen3": {"q_norm", "k_norm"}, "mistral": set(), "llama": set()}
BASE_LEAVES = {"attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down"}


def make(tmp_path, case, seed=0, **more):
    model_type, kw = CASES[case]
    kw = {**kw, **more}
    tie = kw.pop("tie", False)
    path = tmp_path / f"{case}-{seed}"
    return write_tiny_hf(path, model_type, tie=tie, seed=seed, **kw), path



def no_eos(target: Target) -> Target:
    from dataclasses import replace
    return replace(target, config=replace(target.config, eos_token_id=()))


# ----------------------------------------------------------------------------------------------- parity

@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tmp_path, case):
    model, path = make(tmp_path, case)
    t = load_target(path)
    model_type = CASES[case][0]
    c = t.config
    assert c.model_type == model_type
    assert set(t.params["layers"]) == BASE_LEAVES | LEAVES[model_type]
    assert ("lm_head" in t.params) == (not c.tie_word_embeddings)
    if model_type == "qwen3":
        assert c.head_dim == 24 != c.hidden_size // c.num_attention_heads and c.qk_norm
        assert t.params["layers"]["q_norm"].shape == (2, 24) and t.params["layers"]["wq"].shape == (2, 64, 96)
    ref = torch_logits(model)
    got = our_logits(t)
    diff = float(np.abs(got - ref).max())
    assert diff < 1e-4, f"{case}: max |logit diff| {diff:.3g}"
    if c.sliding_window is not None:  # the window really matters on these 12 tokens, and is what we apply
        from dataclasses import replace
        full = Target(t.name, replace(c, sliding_window=None), t.params)
        assert np.abs(our_logits(full) - ref).max() > 1e-2


@pytest.mark.parametrize("case,layout", [("qwen2", "sharded"), ("qwen3", "bin2"), ("mistral-swa5", "bin1")])
def test_sharded_and_bin_checkpoints(tmp_path, case, layout):
    model, path = make(tmp_path, case, seed=1, save_kw={"max_shard_size": "40KB"} if layout == "sharded" else None)
    if layout == "sharded":
        assert (path / "model.safetensors.index.json").is_file()
    else:
        for f in path.glob("model*.safetensors*"):
            f.unlink()
        sd = {k: v.clone() for k, v in model.state_dict().items()}
        if layout == "bin1":
            torch.save(sd, path / "pytorch_model.bin")
        else:
            names, wm = list(sd), {}
            for i in range(2):
                fname = f"pytorch_model-{i + 1:05d}-of-00002.bin"
                torch.save({k: sd[k] for k in names[i::2]}, path / fname)
                wm.update({k: fname for k in names[i::2]})
            (path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": wm}))
    np.testing.assert_allclose(our_logits(load_target(path)), torch_logits(model), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", ["qwen2-tied", "qwen3", "mistral-swa5", "qwen2-swa4", "llama3-rope"])
def test_config_and_our_format_round_trip(tmp_path, case):
    model, path = make(tmp_path, case, seed=2)
    t = load_target(path)
    hf = t.config.to_hf_config()
    assert hf["model_type"] == CASES[case][0] and hf["architectures"] == [type(model).__name__]
    auto = transformers.AutoConfig.for_model(**hf)  # transformers reads back the same model
    assert type(auto) is type(model.config)
    assert ModelConfig.from_hf_config(auto.to_dict()) == t.config
    assert ModelConfig.from_hf_config(model.config.to_dict()).sliding_window == t.config.sliding_window
    save_target(t, tmp_path / "ours")
    t2 = load_target(tmp_path / "ours")
    assert_same_target(t, t2)
    np.testing.assert_allclose(our_logits(t2), torch_logits(model), atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------------------------- decoding

@pytest.mark.parametrize("case", ["qwen2", "qwen3", "mistral-swa5"])
def test_vanilla_greedy_equals_transformers_generate(tmp_path, case):
    model, path = make(tmp_path, case, seed=3)
    model.generation_config.eos_token_id = None
    target = no_eos(load_target(path))
    rng = np.random.RandomState(1)
    for _ in range(3):
        prompt = rng.randint(3, target.config.vocab_size, rng.randint(2, 12)).tolist()
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, len(prompt):].tolist()
        assert generate(target, None, prompt, max_new_tokens=16).tokens == ref


# make test-fast keeps the on-device mode of one family (qwen2; each family fits a head, ~5 s); make test adds
# EAGLE-2 and the host mode for all three, make test-deep the callback mode (~10 s a family)
MODES = [pytest.param("eagle2", "device", marks=pytest.mark.slow), pytest.param("ddd", "host", marks=pytest.mark.slow),
         pytest.param("ddd", "callback", marks=pytest.mark.deep), ("ddd", "device")]
SMALL_DDD = DDDConfig(check_steps=(2, 3), threshold=-5.0, max_depth=5)


@pytest.fixture(scope="module", params=["qwen2", pytest.param("qwen3", marks=pytest.mark.slow),
                                        pytest.param("mistral-swa5", marks=pytest.mark.slow)])
def family_setup(request, tmp_path_factory):
    """A tiny HF target of the family (larger weights than HF's init so greedy continuations are learnable), a head
    from `init_draft` quickly fitted to it, prompts, and vanilla greedy outputs."""
    from spec_helpers import fit_draft, prompts
    case = request.param
    tmp = tmp_path_factory.mktemp(case)
    _, path = make(tmp, case, seed=4, initializer_range=0.1)
    target = no_eos(load_target(path))
    draft = fit_draft(target, seed=0, steps=150, n_prompts=32, T=32)
    ps = prompts(64, seed=100, lo=2, hi=8)[:6] + prompts(2, seed=7, lo=12, hi=20)
    ref = generate(target, None, ps, max_new_tokens=24)
    return case, target, draft, ps, ref


def test_head_follows_the_target_family(family_setup, tmp_path):
    case, target, draft, _, _ = family_setup
    dc, tc = draft.config, target.config
    assert (dc.head_dim, dc.qkv_bias, dc.qk_norm, dc.attention_bias) == \
        (tc.head_dim, tc.qkv_bias, tc.qk_norm, tc.attention_bias)
    assert dc.layer_config().sliding_window is None  # EAGLE heads attend to everything
    assert set(draft.params["layers"]) == BASE_LEAVES - {"attn_norm"} | LEAVES[tc.model_type]
    save_draft(draft, tmp_path / "head")  # our head format keeps the switches
    back = load_draft(tmp_path / "head", target)
    assert back.config == dc
    for k, v in dio.flatten(draft.params).items():
        np.testing.assert_array_equal(np.asarray(v), np.asarray(dio.flatten(back.params)[k]))


@pytest.mark.parametrize("method,sync", MODES)
def test_speculative_modes_equal_vanilla(family_setup, method, sync):
    from test_spec import check_identical
    case, target, draft, ps, ref = family_setup
    tree = TreeConfig(top_k=4, total_tokens=12, depth=3)
    res = generate(target, draft, ps, max_new_tokens=24, method=method, sync=sync, tree=tree, ddd=SMALL_DDD)
    check_identical(target, ps, ref.tokens, res.tokens, f"{case} {method}/{sync}")
    taus = [s["mean_accepted"] for s in res.stats["per_sequence"]]
    assert np.mean(taus) > 1.5, f"{case}: the fitted head should accept drafts, mean tau {np.mean(taus):.2f}"
    if case.startswith("mistral"):  # prompt + output run past the 5-token window: the cache path applies it
        assert all(len(p) + len(t) > 5 for p, t in zip(ps, res.tokens))


# ----------------------------------------------------------------------------------------------- EAGLE heads

def head_config(target, **kw):
    c = target.config
    return dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta, **kw)


@pytest.mark.slow  # ~4 s
def test_official_qwen2_head_with_qkv_bias(tmp_path):
    from ddd_jax.checkpoints.torch_ref import random_eagle_head, write_official_eagle_head
    _, path = make(tmp_path, "qwen2", seed=5)
    t = load_target(path)
    head = random_eagle_head(head_config(t, qkv_bias=True), seed=1, embed=t.params["embed"])
    src = write_official_eagle_head(head, tmp_path / "eagle", fmt="safetensors",
                                    extra_config={"model_type": "qwen2"})
    draft = load_draft(src, t)
    assert draft.config.qkv_bias and {"bq", "bk", "bv"} <= set(draft.params["layers"])
    np.testing.assert_array_equal(np.asarray(draft.params["layers"]["bq"][0]),
                                  head.layers[0].self_attn.q_proj.bias.detach().numpy())
    toks = TOKENS[:, 1:]
    feats = np.array(t.forward(jnp.asarray(TOKENS), jnp.arange(12)[None]).hidden)[:, :-1]
    with torch.no_grad():
        ref = head(torch.from_numpy(feats), torch.from_numpy(toks).long()).numpy()
    h, _ = draft.forward(toks, feats)
    np.testing.assert_allclose(np.asarray(h), ref, atol=1e-4, rtol=1e-4)
    # and it decodes losslessly with the target
    van = generate(no_eos(t), None, [3, 4, 5], max_new_tokens=12)
    out = generate(no_eos(t), draft, [3, 4, 5], max_new_tokens=12, method="eagle2",
                   tree=TreeConfig(top_k=2, total_tokens=4, depth=2))
    assert out.tokens == van.tokens


def test_official_head_for_qwen3_target_uses_cnets1_head_dim(tmp_path):
    from ddd_jax.checkpoints.torch_ref import random_eagle_head, write_official_eagle_head
    _, path = make(tmp_path, "qwen3", seed=6)
    t = load_target(path)
    assert t.config.head_dim == 24
    head = random_eagle_head(head_config(t), seed=2, embed=t.params["embed"])  # cnets1: head_dim = 64 / 4 = 16
    src = write_official_eagle_head(head, tmp_path / "eagle", extra_config={"head_dim": 24, "model_type": "qwen3"})
    with pytest.warns(UserWarning, match="head_dim=24.*using 16"):
        draft = load_draft(src, t)
    assert draft.config.head_dim == 16 and not draft.config.qk_norm
    toks = TOKENS[:, 1:]
    feats = np.array(t.forward(jnp.asarray(TOKENS), jnp.arange(12)[None]).hidden)[:, :-1]
    with torch.no_grad():
        ref = head(torch.from_numpy(feats), torch.from_numpy(toks).long()).numpy()
    np.testing.assert_allclose(np.asarray(draft.forward(toks, feats)[0]), ref, atol=1e-4, rtol=1e-4)


def test_official_head_errors(tmp_path):
    from ddd_jax.checkpoints.torch_ref import random_eagle_head, write_official_eagle_head
    _, path = make(tmp_path, "qwen2", seed=7)
    t = load_target(path)
    head = random_eagle_head(head_config(t, qkv_bias=True), seed=1, embed=t.params["embed"])
    src = write_official_eagle_head(head, tmp_path / "e1", extra_config={"attention_bias": True})
    with pytest.raises(ValueError, match="attention_bias"):
        load_draft(src, t)
    src = write_official_eagle_head(head, tmp_path / "e2", extra_config={"qkv_bias": False})  # biases present
    with pytest.raises(ValueError, match=r"unexpected tensors \['layers\.0\.self_attn\.q_proj\.bias'"):
        load_draft(src, t)


# ----------------------------------------------------------------------------------------------- GGUF

HF_TO_GGUF = [("model.embed_tokens.weight", "token_embd.weight"), ("model.norm.weight", "output_norm.weight"),
              ("lm_head.weight", "output.weight"), ("input_layernorm.weight", "attn_norm.weight"),
              ("self_attn.q_proj.", "attn_q."), ("self_attn.k_proj.", "attn_k."), ("self_attn.v_proj.", "attn_v."),
              ("self_attn.o_proj.", "attn_output."), ("self_attn.q_norm.", "attn_q_norm."),
              ("self_attn.k_norm.", "attn_k_norm."), ("post_attention_layernorm.", "ffn_norm."),
              ("mlp.gate_proj.", "ffn_gate."), ("mlp.up_proj.", "ffn_up."), ("mlp.down_proj.", "ffn_down.")]


def write_gguf(model, path, arch):
    """A float32 GGUF of a tiny transformers model, named and (for llama) Q/K-permuted as llama.cpp's converter does."""
    pytest.importorskip("gguf")
    from gguf_helpers import finish, gguf_writer, permute
    c = model.config
    w = gguf_writer(path, arch, c, getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    for name, p in model.state_dict().items():
        x = p.detach().numpy().astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            x = permute(x, c.num_attention_heads)
        if arch == "llama" and ".k_proj." in name:
            x = permute(x, c.num_key_value_heads)
        name = name.replace("model.layers.", "blk.")
        for a, b in HF_TO_GGUF:
            name = name.replace(a, b)
        w.add_tensor(name, x)
    return finish(w, path)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_families(tmp_path, arch):
    model = write_tiny_hf(tmp_path / arch, arch, seed=8)
    f = write_gguf(model, tmp_path / f"{arch}.gguf", arch)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*tokenizer")  # a weights-only GGUF
        t = load_target(f)
    assert t.config.model_type == arch
    assert t.config.head_dim == (24 if arch == "qwen3" else 16)
    assert set(t.params["layers"]) == BASE_LEAVES | LEAVES[arch]
    diff = float(np.abs(our_logits(t) - torch_logits(model)).max())
    assert diff < 1e-4, f"GGUF {arch}: max |logit diff| {diff:.3g}"


def test_gguf_unsupported_architecture(tmp_path):
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gemma2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"GGUF architecture 'gemma2' is not supported \(supported: \['llama', "
                                         r"'qwen2', 'qwen3'\]\)"):
        load_target(tmp_path / "g.gguf")


@pytest.mark.parametrize("pre,want", [("qwen2", ["1", "2", "3", "4", "5"]), ("llama-bpe", ["123", "45"])])
def test_gguf_qwen2_pretokenizer_splits_digits_one_by_one(tmp_path, pre, want):
    """Qwen2/Qwen3 GGUFs (`tokenizer.ggml.pre` = "qwen2") split numbers into single digits before BPE; llama3's
    pre-tokenizer takes up to three."""
    gguf = pytest.importorskip("gguf")
    from tokenizers import pre_tokenizers

    from ddd_jax.checkpoints.gguf import gguf_tokenizer, read_gguf
    tokens = list(pre_tokenizers.ByteLevel.alphabet()) + ["12", "123", "45"]
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "qwen2")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges(["1 2", "12 3", "4 5"])
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok, _, _ = gguf_tokenizer(read_gguf(tmp_path / "t.gguf"))
    assert [tokens[i] for i in tok.encode("12345").ids] == want


# ----------------------------------------------------------------------------------------------- bad input

def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("case,changes,match", [
    ("qwen2", {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]},
     r"model_type 'gpt2'.*supported model types: \['llama', 'mistral', 'qwen2', 'qwen3'\]"),
    ("qwen2", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "rope_parameters": None},
     r"rope_scaling type 'yarn' is not supported"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1, "layer_types": None},
     r"sliding-window attention on 1 of 2 layers.*max_window_layers=1"),
    ("qwen3", {"hidden_act": "gelu"}, r"hidden_act='gelu'"),
    ("mistral-swa5", {"attention_bias": True}, r"attention_bias=true is not used by model_type 'mistral'"),
    ("qwen2", {"qkv_bias": False}, r"qkv_bias=False contradicts model_type 'qwen2'"),
    ("llama3-rope", {"mlp_bias": True}, r"mlp_bias"),
    ("llama3-rope", {"sliding_window": 4}, r"sliding_window=4 is set but model_type 'llama'"),
])
def test_unsupported_config_fields_fail_naming_them(tmp_path, case, changes, match):
    _, path = make(tmp_path, case)
    _edit_config(path, **changes)
    with pytest.raises(ValueError, match=match):
        load_target(path)


def _edit_weights(path, fn):
    from safetensors.numpy import load_file, save_file
    sd = dict(load_file(str(path / "model.safetensors")))
    fn(sd)
    save_file(sd, str(path / "model.safetensors"))


def test_tensors_must_match_the_family(tmp_path):
    _, path = make(tmp_path, "qwen3", seed=9)
    _edit_weights(path, lambda sd: sd.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(ValueError, match=r"missing tensors \['layers\.k_norm\[1\]'\]"):
        load_target(path)
    _, path = make(tmp_path, "qwen2", seed=9)  # a Qwen2 checkpoint whose config says llama: its biases are unexpected
    _edit_config(path, model_type="llama", architectures=["LlamaForCausalLM"])
    with pytest.raises(ValueError, match=r"unexpected tensors \['model\.layers\.0\.self_attn\.k_proj\.bias'"):
        load_target(path)


def test_tied_and_untied_mismatches(tmp_path):
    _, path = make(tmp_path, "qwen2-tied", seed=10)
    _edit_weights(path, lambda sd: sd.__setitem__("lm_head.weight", sd["model.embed_tokens.weight"] + 1.0))
    with pytest.raises(ValueError, match="tie_word_embeddings=true but lm_head.weight differs"):
        load_target(path)
    _edit_weights(path, lambda sd: sd.__setitem__("lm_head.weight", sd["model.embed_tokens.weight"].copy()))
    assert "lm_head" not in load_target(path).params  # an identical copy is dropped
    _edit_config(path, tie_word_embeddings=False)
    _edit_weights(path, lambda sd: sd.pop("lm_head.weight"))
    with pytest.raises(ValueError, match=r"missing tensors \['lm_head'\] \(config.json has tie_word_embeddings=false"):
        load_target(path)


def test_configs_without_an_hf_equivalent():
    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=4)
    with pytest.raises(ValueError, match=r"model_type='llama' and qk_norm=True has no HF equivalent"):
        ModelConfig(**base, qk_norm=True).to_hf_config()
    with pytest.raises(ValueError, match=r"model_type='qwen2' and qkv_bias=False has no HF equivalent"):
        ModelConfig(**base, model_type="qwen2").to_hf_config()
    with pytest.raises(ValueError, match=r"model_type 'gemma' is not supported"):
        ModelConfig(**base, model_type="gemma")
    assert set(FAMILIES) == {"llama", "mistral", "qwen2", "qwen3"}
    # a head config from an older ddd-jax (no family fields) still loads as a plain LLaMA layer
    d = DraftConfig.from_target(ModelConfig(**base)).to_dict()
    for k in ("qkv_bias", "qk_norm", "attention_bias"):
        d.pop(k)
    assert DraftConfig.from_dict(d).layer_config().model_type == "llama"
