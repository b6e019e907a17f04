"""`ddd-jax plan`: per-device bytes from shapes only, checked against hand arithmetic for real-size configs."""
from __future__ import annotations

import json

import pytest

from ddd_jax.cli import main
from ddd_jax.plan_cli import memory_plan, read_config

P7 = 6_738_415_616  # LLaMA-2-7B parameters (tests/test_eval_shape.py)


def test_llama2_7b_on_1x8_matches_hand_arithmetic():
    r = memory_plan(read_config("llama-2-7b"), (1, 8), batch=4, capacity=4096, dtype="bfloat16", total_tokens=60)
    D, F, V, L, N, H = 4096, 11008, 32000, 32, 32, 128
    replicated = D + 2 * L * D  # final norm + two norms per layer
    assert r["target_weights"] == 2 * (replicated + (P7 - replicated) // 8)
    head = 2 * D * D + D + 4 * D * D + 3 * D * F + D  # fc (+bias), one layer (no input norm)
    assert r["draft_weights"] == 2 * (D + D + (head - 2 * D - 2 * D * D) // 8 + 2 * D * D)  # fc_w, fc_b, norm whole
    assert r["target_kv_cache"] == 2 * L * 4 * 4096 * (N // 8) * H * 2  # k and v, bf16, heads over 8
    assert r["draft_kv_cache"] == 2 * 1 * 4 * 4096 * (N // 8) * H * 2
    assert r["tree_logits"] == 4 * 60 * (V // 8) * 4
    assert r["tree_scores"] == 4 * (N // 8) * 60 * 4096 * 4
    assert r["total"] == r["weights"] + r["kv_cache"] + r["tree_buffers"]


def test_70b_and_llama31_8b_data_axis_and_gqa():
    r = memory_plan(read_config("llama-2-70b"), (2, 8), batch=3, capacity=2048, dtype="bfloat16")
    assert r["padded_batch"] == 4  # 3 prompts on data=2: one padding row
    assert r["target_kv_cache"] == 2 * 80 * (4 // 2) * 2048 * (8 // 8) * 128 * 2
    r8 = memory_plan(read_config("llama-3.1-8b"), (1, 8), batch=1, capacity=8192, dtype="float32", draft=False)
    assert r8["draft_weights"] == 0 and r8["target_kv_cache"] == 2 * 32 * 8192 * 1 * 128 * 4
    assert r8["target_weights"] == 4 * (2 * 128256 * 4096 // 8 + 32 * (4096 * 4096 * 2 // 8 + 4096 * 1024 * 2 // 8
                                                                      + 3 * 4096 * 14336 // 8 + 2 * 4096) + 4096)


def test_plan_cli(capsys, tmp_path):
    assert main(["plan", "--target", "llama-2-7b", "--mesh", "1x8", "--batch", "4", "--capacity", "4096"]) == 0
    text = capsys.readouterr().out
    assert "weights" in text and "kv_cache" in text and "tree_buffers" in text and "1,685,069,824" in text
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                               "num_hidden_layers": 2, "vocab_size": 100, "rms_norm_eps": 1e-5}))
    assert main(["plan", "--target", str(cfg), "--mesh", "1x4", "--capacity", "64", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_cache"] > 0
    assert main(["plan", "--target", "llama-2-70b", "--mesh", "1x16", "--capacity", "64"]) == 2  # 8 KV heads
    err = capsys.readouterr().err
    assert "num_key_value_heads=8" in err and "[1, 2, 4, 8]" in err


def test_bad_mesh_text():
    from ddd_jax.sharding import parse_mesh
    with pytest.raises(ValueError, match="DATAxMODEL"):
        parse_mesh("8")
