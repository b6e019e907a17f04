"""A draft head as one `<name>.tar` (save_draft / load_draft): the same params and tokens as the head directory,
and clear errors naming the file for truncated, incomplete or foreign tars."""
from __future__ import annotations

import gzip
import json
import tarfile

import jax
import numpy as np
import pytest

from ddd_jax import TreeConfig, eagle, generate, init_draft, llama, load_draft, save_draft
from ddd_jax import io as dio
from ddd_jax.checkpoints.ours import save_target
from ddd_jax.config import ModelConfig
from ddd_jax.target import Target


def tiny_target(vocab: int = 96) -> Target:
    cfg = ModelConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                      eos_token_id=(1,))
    params = llama.init_params(cfg, jax.random.PRNGKey(0), std=0.2)
    params["embed"] = params["embed"] * 4.0
    return Target(f"tiny-v{vocab}", cfg, params)


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    """(target, directory head, tar head) of one random head with a reduced draft vocabulary (d2t)."""
    d = tmp_path_factory.mktemp("heads")
    t = tiny_target()
    draft = eagle.with_draft_vocab(init_draft(t, 3), np.arange(48))
    save_draft(draft, d / "head", extra={"step": 7})
    save_draft(draft, d / "head.tar", extra={"step": 7})
    return t, d / "head", d / "head.tar"


def test_tar_round_trip_equals_the_directory(heads):
    t, dir_path, tar_path = heads
    assert tar_path.is_file() and not list(tar_path.parent.glob(".head.tar*"))  # atomic: no temp files left
    with tarfile.open(tar_path) as tar:
        assert sorted(tar.getnames()) == ["config.json", "model.safetensors"]
        assert json.loads(tar.extractfile("config.json").read()) == json.loads((dir_path / "config.json").read_text())
    a, b = load_draft(tar_path, t), load_draft(dir_path, t)
    assert a.name == str(tar_path) and a.config == b.config
    flat_a, flat_b = dio.flatten(a.params), dio.flatten(b.params)
    assert sorted(flat_a) == sorted(flat_b) and "d2t" in flat_a
    for k in flat_a:
        assert flat_a[k].dtype == flat_b[k].dtype
        np.testing.assert_array_equal(np.asarray(flat_a[k]), np.asarray(flat_b[k]), err_msg=k)
    # float16 on disk, like the recipe's exports
    save_draft(a, tar_path.with_name("h16.tar"), dtype=np.float16)
    h16 = load_draft(tar_path.with_name("h16.tar"), t, dtype=np.float16)
    assert h16.params["fc_w"].dtype == np.float16 and h16.params["d2t"].dtype == np.int32


def test_compressed_tar_holds_the_same_bfloat16_weights(heads, tmp_path):
    """`compress=True`: one xz stream (what the recipe exports when a head's plain tar would pass a size limit),
    smaller than the plain tar of the same dtype, with the same weights bit for bit, and a cut copy named."""
    import ml_dtypes
    t, dir_path, _ = heads
    d = load_draft(dir_path, t)
    plain, xz = tmp_path / "plain.tar", tmp_path / "xz.tar"
    save_draft(d, plain, dtype=ml_dtypes.bfloat16)
    save_draft(d, xz, dtype=ml_dtypes.bfloat16, compress=True)
    assert xz.read_bytes()[:6] == b"\xfd7zXZ\x00" and xz.stat().st_size < plain.stat().st_size
    a, b = load_draft(xz, t, dtype=ml_dtypes.bfloat16), load_draft(plain, t, dtype=ml_dtypes.bfloat16)
    flat_a, flat_b = dio.flatten(a.params), dio.flatten(b.params)
    assert sorted(flat_a) == sorted(flat_b)
    for k in flat_a:
        assert flat_a[k].dtype == flat_b[k].dtype
        np.testing.assert_array_equal(np.asarray(flat_a[k]).view(np.uint8), np.asarray(flat_b[k]).view(np.uint8), k)
    np.testing.assert_array_equal(np.asarray(a.params["fc_w"], np.float32),
                                  np.asarray(d.params["fc_w"]).astype(ml_dtypes.bfloat16).astype(np.float32))
    whole = xz.read_bytes()
    for cut in (len(whole) - 40, len(whole) // 2, 64):
        xz.write_bytes(whole[:cut])
        with pytest.raises(ValueError, match=rf"{xz}: cannot read this draft head tar .*truncated or damaged copy of a "
                                             "xz-compressed tar"):
            load_draft(xz, t)
    with pytest.raises(ValueError, match="compress=True needs a path ending in .tar"):
        save_draft(d, tmp_path / "dir", compress=True)


def test_tar_head_decodes_the_directory_heads_tokens(heads):
    t, dir_path, tar_path = heads
    prompt = [5, 9, 33, 2, 71]
    tree = TreeConfig(top_k=2, total_tokens=4, depth=2)
    a = generate(t, load_draft(tar_path, t), prompt, max_new_tokens=10, method="eagle2", tree=tree)
    b = generate(t, load_draft(dir_path, t), prompt, max_new_tokens=10, method="eagle2", tree=tree)
    assert a.tokens == b.tokens and a.stats["accepted_per_call"] == b.stats["accepted_per_call"]


def test_truncated_tar_names_the_file(heads, tmp_path):
    t, _, tar_path = heads
    whole = tar_path.read_bytes()
    bad = tmp_path / "cut.tar"
    for cut in (len(whole) // 2, 700, 100, 0):
        bad.write_bytes(whole[:cut])
        with pytest.raises(ValueError, match=rf"{bad}: cannot read this draft head tar .*truncated"):
            load_draft(bad, t)


def test_tar_without_a_member_names_it(heads, tmp_path):
    t, dir_path, _ = heads
    for present, missing in (("config.json", "model.safetensors"), ("model.safetensors", "config.json")):
        bad = tmp_path / f"no-{missing}.tar"
        with tarfile.open(bad, "w") as tar:
            tar.add(dir_path / present, arcname=present)
        with pytest.raises(ValueError, match=rf"{bad}: no {missing} in this tar"):
            load_draft(bad, t)
    # `tar cf head.tar head/`: the members in one folder load as well
    nested = tmp_path / "nested.tar"
    with tarfile.open(nested, "w") as tar:
        tar.add(dir_path, arcname="head")
    assert load_draft(nested, t).config == load_draft(dir_path, t).config


def test_foreign_tars_and_other_targets(heads, tmp_path):
    t, dir_path, tar_path = heads
    gz = tmp_path / "gz.tar"  # a gzipped head tar loads; a gzipped file that is no tar names the file
    gz.write_bytes(gzip.compress(tar_path.read_bytes()))
    assert load_draft(gz, t).config == load_draft(tar_path, t).config
    gz.write_bytes(gzip.compress(b"not a tar at all" * 100))
    with pytest.raises(ValueError, match=rf"{gz}: cannot read this draft head tar .*gzip-compressed tar"):
        load_draft(gz, t)
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"not a tar at all" * 100)
    with pytest.raises(ValueError, match=rf"{junk}: cannot read this draft head tar .*not a tar file"):
        load_draft(junk, t)
    save_target(t, tmp_path / "target")  # a target checkpoint packed as a tar is no head
    tgt = tmp_path / "target.tar"
    with tarfile.open(tgt, "w") as tar:
        for name in ("config.json", "model.safetensors"):
            tar.add(tmp_path / "target" / name, arcname=name)
    with pytest.raises(ValueError, match=r"target\.tar \(its config\.json\) is not a ddd-jax-eagle-head head "
                                         r"\(format='ddd-jax-target'\)"):
        load_draft(tgt, t)
    with pytest.raises(ValueError, match=rf"{tar_path}: draft head was built for vocab_size=96, hidden_size=32 but "
                                         r"the target has vocab_size=128"):
        load_draft(tar_path, tiny_target(vocab=128))
    other = tmp_path / "other.bin"
    other.write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="a draft head is a directory with a config.json, or a .tar"):
        load_draft(other, t)
