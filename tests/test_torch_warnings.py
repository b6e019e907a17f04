"""The PyTorch counterpart (ddd_jax.bench.torch_decoding) calls transformers through its current API: a decode emits no
DeprecationWarning or FutureWarning (transformers 5.24 renamed the forwards' `past_key_values` to `cache` and warns on
the old name), and the cache keyword is read from the forward's signature, so older releases keep working."""
from __future__ import annotations

import functools
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ddd_jax import DDDConfig, TreeConfig, init_draft  # noqa: E402
from ddd_jax.bench import torch_decoding as td  # noqa: E402

from spec_helpers import tiny_target  # noqa: E402


def test_cache_kwarg_follows_the_forward_signature():
    def new(input_ids=None, cache=None, use_cache=None, **kwargs): ...
    def old(input_ids=None, past_key_values=None, use_cache=None, cache_position=None, **kwargs): ...

    @functools.wraps(new)  # transformers' deprecate_kwarg wraps the forward; the signature is the wrapped one's
    def wrapped(*args, **kwargs): ...

    assert td.cache_kwarg(new) == td.cache_kwarg(wrapped) == "cache"
    assert td.cache_kwarg(old) == "past_key_values"


def test_torch_decode_emits_no_deprecation_warning():
    """Vanilla (prefill, one-token steps) and DDD (prefill, tree verification) through the installed transformers:
    every Deprecation/FutureWarning raised meanwhile comes from our calls, and there must be none."""
    target = tiny_target()
    m = td.load_torch(target, init_draft(target, 0))  # an unfitted head: decoding stays lossless
    assert m.cache_kw == td.cache_kwarg(m.model.model.forward)
    p = [5, 17, 42, 8, 3]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        van = td.generate(m, p, 6).tokens
        ddd = td.generate(m, p, 6, method="ddd", sync="host", tree=TreeConfig(top_k=2, total_tokens=4, depth=2),
                          ddd=DDDConfig(check_steps=(1,), threshold=-2.5, max_depth=3)).tokens
    assert ddd == van
    bad = [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught
           if issubclass(w.category, (DeprecationWarning, PendingDeprecationWarning, FutureWarning))]
    assert not [b for b in bad if "past_key_values" in b], bad
    assert not bad
