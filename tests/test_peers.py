"""`ddd-jax peers`: every peer decodes the same weights to the same greedy tokens (tiny random target), the
timing fields are filled, and bad requests are refused."""
from __future__ import annotations

import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import ddd_jax  # noqa: E402
from ddd_jax import DDDConfig, TreeConfig  # noqa: E402
from ddd_jax.bench.peers import build_runners, peers_table, required_capacity, run_peers  # noqa: E402
from ddd_jax.cli import main  # noqa: E402

from spec_helpers import prompts, tiny_target  # noqa: E402


@pytest.mark.slow  # ~6 s
def test_peers_on_the_same_weights_give_the_same_tokens():
    target = tiny_target()
    draft = ddd_jax.init_draft(target, 0)  # untrained: speculative decoding is lossless whatever the head
    names = ["ddd-jax", "ddd-jax-ddd", "transformers", "transformers-pld"]
    tree, ddd = TreeConfig(top_k=2, total_tokens=6, depth=3), DDDConfig(check_steps=(1, 3), threshold=-2.5, max_depth=5)
    ps = prompts(3, seed=5)
    cap = required_capacity(target, draft, [len(p) for p in ps], 12, tree, ddd)
    assert cap % 256 == 0 and cap >= max(len(p) for p in ps) + 12
    runners, skipped = build_runners(target, draft, names, capacity=cap, prompt_lookup=3, tree=tree, ddd=ddd)
    assert not skipped and list(runners) == names
    res = run_peers(runners, ps, 12, progress=False)
    for name in names:
        row = res["peers"][name]
        assert row["identical_to_ddd_jax"] == len(ps), (name, res["tokens"][name], res["tokens"]["ddd-jax"])
        assert row["mean_common_prefix"] == 1.0
        assert row["decode_tokens"] > 0 and row["decode_s"] > 0 and row["tokens_per_s"] > 0
    assert res["peers"]["transformers-pld"]["settings"] == {"prompt_lookup_num_tokens": 3}
    assert "| transformers-pld |" in peers_table(res)


def test_missing_or_unknown_peers(monkeypatch):
    target = tiny_target()
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp -> ModuleNotFoundError
    runners, skipped = build_runners(target, None, ["ddd-jax", "llama.cpp"], capacity=64, gguf_path="x.gguf")
    assert list(runners) == ["ddd-jax"] and "pip install llama-cpp-python" in skipped["llama.cpp"]
    with pytest.raises(ModuleNotFoundError, match="llama-cpp-python"):
        build_runners(target, None, ["llama.cpp"], capacity=64, gguf_path="x.gguf", required=("llama.cpp",))
    with pytest.raises(ValueError, match="unknown peer 'vllm'"):
        build_runners(target, None, ["vllm"], capacity=64)
    with pytest.raises(ValueError, match="needs a draft head"):
        build_runners(target, None, ["ddd-jax-ddd"], capacity=64)
    # the GGUF-blocks peers need a blocks target: skipped unless asked for by name
    runners, skipped = build_runners(target, None, ["ddd-jax", "ddd-jax-blocks"], capacity=64)
    assert list(runners) == ["ddd-jax"] and "gguf_blocks=True" in skipped["ddd-jax-blocks"]
    with pytest.raises(ValueError, match="gguf_blocks=True"):
        build_runners(target, None, ["ddd-jax-blocks"], capacity=64, required=("ddd-jax-blocks",))


@pytest.mark.slow  # time (test-fast budget): test_quant covers decoding over blocks in the fast lane
def test_blocks_peers_decode_the_blocks_target():
    pytest.importorskip("gguf")
    from quant_helpers import SMALL, blocks_target
    from ddd_jax import Target, llama
    from ddd_jax.backends.cpu import quant
    import jax
    tb = blocks_target(Target("small", SMALL, llama.init_params(SMALL, jax.random.PRNGKey(0), std=0.25)))
    tf = Target("small-float", SMALL, quant.dequantize_tree(tb.params))
    draft = ddd_jax.init_draft(tf, 0)
    tree, ddd = TreeConfig(top_k=2, total_tokens=4, depth=2), DDDConfig(check_steps=(1,), threshold=-2.5, max_depth=3)
    names = ["ddd-jax", "ddd-jax-blocks", "ddd-jax-blocks-ddd"]
    ps = prompts(2, seed=6)
    runners, skipped = build_runners(tf, draft, names, capacity=256, tree=tree, ddd=ddd, blocks_target=tb)
    assert not skipped and list(runners) == names
    res = run_peers(runners, ps, 10, progress=False)
    blocks_vanilla = res["tokens"]["ddd-jax-blocks"]
    assert res["tokens"]["ddd-jax-blocks-ddd"] == blocks_vanilla  # lossless against vanilla over the same blocks
    assert blocks_vanilla == [list(generate_tokens) for generate_tokens in
                              ddd_jax.generate(tb, None, ps, max_new_tokens=10).tokens]


@pytest.mark.slow  # time (test-fast budget): test_int8_blocks covers decoding over int8 blocks in the fast lane
def test_int8_peers_decode_the_int8_target_and_agree_with_each_other():
    """ddd-jax-int8 / ddd-jax-int8-ddd run the target loaded with gguf_blocks="int8": DDD gives int8 vanilla's
    tokens, which are `generate`'s over that load (not the exact blocks' ones, in general)."""
    pytest.importorskip("gguf")
    import dataclasses
    from quant_helpers import SMALL, blocks_target
    from ddd_jax import Target, llama
    from ddd_jax.backends.cpu import quant
    import jax
    tb = blocks_target(Target("small", SMALL, llama.init_params(SMALL, jax.random.PRNGKey(0), std=0.25)))
    t8 = dataclasses.replace(tb, params=quant.pack_block_params(tb.params, tied=True, int8=True))
    tf = Target("small-float", SMALL, quant.dequantize_tree(tb.params))
    draft = ddd_jax.init_draft(tf, 0)
    tree, ddd = TreeConfig(top_k=2, total_tokens=4, depth=2), DDDConfig(check_steps=(1,), threshold=-2.5, max_depth=3)
    names = ["ddd-jax-int8", "ddd-jax-int8-ddd"]
    ps = prompts(2, seed=6)
    runners, skipped = build_runners(tf, draft, names, capacity=256, tree=tree, ddd=ddd, int8_target=t8)
    assert not skipped and list(runners) == names
    res = run_peers(runners, ps, 10, progress=False)
    int8_vanilla = res["tokens"]["ddd-jax-int8"]
    assert res["tokens"]["ddd-jax-int8-ddd"] == int8_vanilla
    assert int8_vanilla == [list(t) for t in ddd_jax.generate(t8, None, ps, max_new_tokens=10).tokens]
    runners, skipped = build_runners(tf, None, ["ddd-jax-int8"], capacity=64)  # no int8 load: skipped, named
    assert not runners and "gguf_blocks='int8'" in skipped["ddd-jax-int8"]


def test_cli_refuses_unknown_peer_and_missing_gguf(tmp_path):
    with pytest.raises(SystemExit, match="unknown peer"):
        main(["peers", "--peers", "ddd-jax,vllm", "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit, match="does not exist"):
        main(["peers", "--peers", "llama.cpp", "--gguf", str(tmp_path / "none.gguf"), "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()


def _fake_llama_cpp(monkeypatch, fields=("n_gpu_layers", "use_extra_bufts")):
    """A stand-in llama_cpp package: Llama records the model defaults and keywords it was built with."""
    import ctypes
    import types

    class Params(ctypes.Structure):
        _fields_ = [(f, ctypes.c_bool) for f in fields]

    def defaults():
        p = Params()
        for f in fields:
            setattr(p, f, True)
        return p

    low = types.SimpleNamespace(llama_model_default_params=defaults)
    built = []

    class Llama:
        def __init__(self, **kw):
            built.append((kw, low.llama_model_default_params()))

        def token_eos(self):
            return 0

    pkg = types.ModuleType("llama_cpp")
    pkg.__version__, pkg.Llama, pkg.llama = "0.0-fake", Llama, types.ModuleType("llama_cpp.llama")
    pkg.llama.llama_cpp = low
    monkeypatch.setitem(sys.modules, "llama_cpp", pkg)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama", pkg.llama)
    return low, defaults, built


def test_llama_cpp_peers_flash_attention_and_no_repack(monkeypatch):
    target = tiny_target()
    low, defaults, built = _fake_llama_cpp(monkeypatch)
    runners, skipped = build_runners(target, None, ["llama.cpp", "llama.cpp-fa"], capacity=64, gguf_path="x.gguf",
                                     llama_cpp_no_repack=True)
    assert not skipped and list(runners) == ["llama.cpp", "llama.cpp-fa"]
    assert [kw["flash_attn"] for kw, _ in built] == [False, True]
    assert all(not p.use_extra_bufts and p.n_gpu_layers for _, p in built)  # only that one field turned off
    assert low.llama_model_default_params is defaults  # restored after construction
    built.clear()
    build_runners(target, None, ["llama.cpp"], capacity=64, gguf_path="x.gguf")
    assert built[0][1].use_extra_bufts  # llama.cpp's own default unless asked


def test_llama_cpp_no_repack_needs_the_field(monkeypatch):
    target = tiny_target()
    _fake_llama_cpp(monkeypatch, fields=("n_gpu_layers",))
    with pytest.raises(ValueError, match="use_extra_bufts"):
        build_runners(target, None, ["llama.cpp"], capacity=64, gguf_path="x.gguf", llama_cpp_no_repack=True)
