"""generate() without tree/DDD arguments: the backend's tuned settings for this target/head pair, else the paper's
defaults, and stats["settings"] says which and why."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from ddd_jax import DDDConfig, TreeConfig, generate
from ddd_jax.checkpoints.registry import NAMED_DRAFTS, NAMED_TARGETS
from ddd_jax.settings import SETTINGS_DIR, load_settings, save_settings, settings_path, to_configs
from spec_helpers import fitted_draft, prompts, tiny_target

TUNED = {"tree": {"top_k": 2, "total_tokens": 5, "depth": 2},
         "ddd": {"check_steps": [2], "threshold": -2.0, "max_depth": 4}}


@pytest.fixture
def named(monkeypatch, tmp_path):
    monkeypatch.setenv("DDD_JAX_SETTINGS_DIR", str(tmp_path))
    target = tiny_target()
    return target, dataclasses.replace(fitted_draft(), name="tiny-head")


def _save(target_name, draft_name):
    save_settings({**TUNED, "meta": {"target": target_name, "draft": draft_name}}, backend=jax.default_backend())


@pytest.mark.slow  # a tuning run (~10 s)
def test_tuned_settings_for_this_pair_are_used(named):
    target, draft = named
    _save(target.name, draft.name)
    p = prompts(1, seed=5)[0]
    r = generate(target, draft, p, max_new_tokens=12, method="ddd")
    st = r.stats["settings"]
    assert st["tree"] == TUNED["tree"] and st["ddd"]["check_steps"] == (2,) and st["ddd"]["max_depth"] == 4
    assert st["source"].startswith(f"tuned for {target.name} + tiny-head")
    assert max(r.stats["depth_per_call"]) <= 4
    assert r.tokens == generate(target, None, p, max_new_tokens=12).tokens
    ex = generate(target, draft, p, max_new_tokens=12, method="eagle2", tree=TreeConfig(top_k=3, total_tokens=6,
                                                                                        depth=2), ddd=DDDConfig())
    assert ex.stats["settings"]["source"] == "explicit" and ex.stats["settings"]["tree"]["top_k"] == 3
    assert st["draft_dtype"] == "float32"
    assert generate(target, draft.astype(jnp.float16), p, max_new_tokens=4,
                    method="ddd").stats["settings"]["draft_dtype"] == "float16"


@pytest.mark.slow  # ~4 s each
@pytest.mark.parametrize("other", ["target", "draft"])
def test_settings_for_another_pair_fall_back_to_paper_defaults(named, other):
    target, draft = named
    _save("someone-else" if other == "target" else target.name, "someone-else" if other == "draft" else draft.name)
    r = generate(target, draft, prompts(1, seed=5)[0], max_new_tokens=8, method="eagle2")
    st = r.stats["settings"]
    assert st["tree"] == TreeConfig().to_dict()
    assert st["source"].startswith("paper defaults") and f"{other} 'someone-else'" in st["source"]


@pytest.mark.slow  # ~4 s
def test_no_settings_file_means_paper_defaults(named):
    target, draft = named
    r = generate(target, draft, prompts(1, seed=5)[0], max_new_tokens=8, method="ddd")
    assert r.stats["settings"]["ddd"] == dataclasses.asdict(DDDConfig())
    assert "no tuned settings" in r.stats["settings"]["source"]
    assert generate(target, None, [1, 2, 3], max_new_tokens=4).stats["settings"] is None


@pytest.mark.parametrize("speeds", [(0.81, 0.92), (0.95, 1.05)])
@pytest.mark.slow  # ~4 s each
def test_source_warns_when_the_tuner_found_speculation_slower_than_vanilla(named, speeds):
    """Settings whose tuning runs measured every speculative method below vanilla (GGUF blocks on this CPU) say so in
    stats["settings"]["source"]; one method at or above vanilla, and the source carries no warning."""
    from ddd_jax.settings import tuned_for
    target, draft = named
    e2, dd = speeds
    save_settings({**TUNED, "meta": {"target": target.name, "draft": draft.name, "eagle2": {"speedup": e2, "tau": 1.4},
                                     "ddd": {"speedup": dd, "tau": 1.4}}}, backend=jax.default_backend())
    source = tuned_for(target.name, draft.name, jax.default_backend())[1]
    slower = max(speeds) < 1.0
    assert ("vanilla decoding is faster here" in source) == slower
    if slower:
        assert "EAGLE-2 0.81x, DDD 0.92x of vanilla" in source
        r = generate(target, draft, prompts(1, seed=5)[0], max_new_tokens=4, method="ddd")
        assert r.stats["settings"]["source"] == source
        # such settings' defaults decode as vanilla does (the method asked for stays in the stats), and say why
        assert r.stats["settings"]["decoded_as"] == "vanilla" and r.stats["method"] == "ddd"
        assert r.stats["settings"]["why"].startswith("the tuner measured EAGLE-2 0.81x, DDD 0.92x of vanilla")
        assert r.tokens == generate(target, None, prompts(1, seed=5)[0], max_new_tokens=4).tokens
        ex = generate(target, draft, prompts(1, seed=5)[0], max_new_tokens=4, method="ddd",
                      tree=TreeConfig(**TUNED["tree"]))
        assert ex.stats["settings"]["decoded_as"] == "ddd"  # an explicit tree decodes speculatively
    else:  # DDD measured above vanilla decodes speculatively; EAGLE-2, measured below it, as vanilla does
        r = generate(target, draft, prompts(1, seed=5)[0], max_new_tokens=4, method="ddd")
        assert r.stats["settings"]["decoded_as"] == "ddd" and "why" not in r.stats["settings"]
        r = generate(target, draft, prompts(1, seed=5)[0], max_new_tokens=4, method="eagle2")
        assert r.stats["settings"]["decoded_as"] == "vanilla" and r.stats["method"] == "eagle2"
        assert r.stats["settings"]["why"].startswith("the tuner measured EAGLE-2 0.95x, DDD 1.05x of vanilla")


@pytest.mark.parametrize("path", sorted(SETTINGS_DIR.glob("*.json")), ids=lambda p: p.name)
def test_shipped_settings_files_are_valid_and_name_their_backend_and_pair(path):
    """Each file under ddd_jax/settings/ loads, is for the backend (and storage) its name says, and names the shipped
    target/head pair, so a renamed head cannot silently turn the tuned defaults off."""
    backend, _, storage = path.stem.partition("-")
    s = load_settings(path=path)
    assert path == settings_path(backend, storage or None)
    assert s["meta"]["backend"] == backend
    assert s["meta"].get("weight_storage", "float") == ("float" if not storage else storage)
    assert s["meta"]["target"] in NAMED_TARGETS and s["meta"]["draft"] in NAMED_DRAFTS
    tree, ddd = to_configs(s)
    assert tree.total_tokens >= 1 and max(ddd.check_steps) < ddd.max_depth


def test_settings_tuned_on_another_device_say_so(named):
    """A settings file for this backend tuned on another kind of device (meta.device) is still used, and the source
    says where it was tuned and that `ddd-jax tune` re-tunes; on the device it names, nothing is added."""
    target, draft = named
    here = jax.devices()[0].device_kind
    for device, said in (("NVIDIA H200", True), (here, False)):
        save_settings({**TUNED, "meta": {"target": target.name, "draft": draft.name, "device": device}},
                      backend=jax.default_backend())
        r = generate(target, draft, prompts(1, seed=6)[0], max_new_tokens=4, method="ddd")
        source = r.stats["settings"]["source"]
        assert source.startswith(f"tuned for {target.name} + tiny-head")
        assert (f"tuned on NVIDIA H200, this is {here}: `ddd-jax tune` re-tunes for it" in source) == said, source
        assert (r.stats["settings"]["tree"]["total_tokens"], r.stats["settings"]["ddd"]["threshold"]) == (5, -2.0)


@pytest.mark.slow  # ~7 s
def test_settings_compose_with_an_explicit_tree_or_rule(named):
    """An explicit tree never meets the tuned DDD rule under EAGLE-2; under DDD it takes the tuned rule when that
    fits, else the paper's; an explicit rule takes a tree that fits it; what fits nothing is an error naming both."""
    from ddd_jax.settings import resolve
    target, draft = named
    save_settings({"tree": {"top_k": 2, "total_tokens": 3, "depth": 2},
                   "ddd": {"check_steps": [0], "threshold": -2.0, "max_depth": 1},
                   "meta": {"target": target.name, "draft": draft.name}}, backend=jax.default_backend())
    # 23 drafted nodes: more than the tuned rule can draft by its max depth 1 (4 + 16), fewer than the paper's
    big = TreeConfig(top_k=4, total_tokens=24, depth=3)
    p = prompts(1, seed=5)[0]
    ref = generate(target, None, p, max_new_tokens=10).tokens
    r = generate(target, draft, p, max_new_tokens=10, method="eagle2", tree=big)
    assert r.tokens == ref and "uses no DDD rule" in r.stats["settings"]["source"]
    r = generate(target, draft, p, max_new_tokens=10, method="ddd", tree=big)
    assert r.tokens == ref and r.stats["settings"]["ddd"]["check_steps"] == (5, 7, 9)
    assert "the DDD rule from paper defaults" in r.stats["settings"]["source"]
    small = TreeConfig(top_k=2, total_tokens=3, depth=1)  # fits the tuned rule's pool
    t, d, src = resolve(target, draft, tree=small, method="ddd")
    assert d.check_steps == (0,) and "the DDD rule from tuned for" in src
    t, d, src = resolve(target, draft, ddd=DDDConfig(check_steps=(1,), threshold=-1.0, max_depth=3), method="ddd")
    assert t == TreeConfig(top_k=2, total_tokens=3, depth=2) and "the tree from tuned for" in src
    with pytest.raises(ValueError, match="explicit tree fits neither the DDD rule from tuned for .* nor the paper.s"):
        resolve(target, draft, tree=TreeConfig(top_k=1, total_tokens=40, depth=50), method="ddd")
