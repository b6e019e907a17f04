"""Shared test fixtures for speculative decoding: a tiny random target and a draft head quickly fitted to it."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ddd_jax import ModelConfig, Target, generate, init_draft, llama
from ddd_jax.eagle import Draft, head_forward

TINY = ModelConfig(vocab_size=96, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=12, max_position_embeddings=1024, eos_token_id=(95,))


@functools.lru_cache(maxsize=None)
def tiny_target(seed: int = 0, std: float = 0.25, attn_scale: float = 0.15) -> Target:
    """Random tiny target; attention output is scaled down so the next token depends mostly (not only) on the
    current one -- learnable by a quickly fitted head, while long-range context still matters."""
    params = llama.init_params(TINY, jax.random.PRNGKey(seed), std=std)
    params["layers"]["wo"] = params["layers"]["wo"] * attn_scale
    return Target(f"tiny{seed}", TINY, params)


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 24, vocab: int = 90) -> list[list[int]]:
    rng = np.random.RandomState(seed)
    return [list(rng.randint(0, vocab, rng.randint(lo, hi))) for _ in range(n)]


@functools.lru_cache(maxsize=None)
def fitted_draft(seed: int = 0, steps: int = 300) -> Draft:
    """A head fitted for a few hundred Adam steps on the tiny target's own greedy continuations (EAGLE loss), so that
    acceptance lengths are well above 1 and every accept path is exercised."""
    return fit_draft(tiny_target(seed), seed, steps)


# Fitted heads are kept on disk between test runs (each fit is ~10 s on a CPU, paid once per pytest worker), keyed
# by everything the fit reads: the target's config and bits, the fit's arguments, and the source of this file and
# of the modules the head's forward and its initialisation live in. DDD_JAX_TEST_HEADS names the folder ("0": off).
_FIT_SOURCES = ("eagle.py", "layers.py", "config.py", "llama.py", "head_kinds.py")


def _fit_key(target: Target, *args) -> str:
    import hashlib
    from pathlib import Path

    import ddd_jax
    h = hashlib.sha256(repr((target.config, args, jax.__version__)).encode())
    for leaf in jax.tree.leaves(target.params):
        h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    root = Path(ddd_jax.__file__).parent
    for f in (Path(__file__),) + tuple(root / n for n in _FIT_SOURCES):
        h.update(f.read_bytes())
    return h.hexdigest()[:20]


def fit_draft(target: Target, seed: int = 0, steps: int = 300, n_prompts: int = 64, T: int = 48) -> Draft:
    """`init_draft(target)` fitted to `target`'s greedy continuations of `prompts(n_prompts, seed=100 + seed, lo=2,
    hi=8)` (any family: the head's layer follows `DraftConfig.from_target`); read back from the folder of fitted
    heads when the same fit ran before (see `_fit_key`)."""
    import os
    from pathlib import Path

    from ddd_jax import load_draft, save_draft
    where = os.environ.get("DDD_JAX_TEST_HEADS", str(Path.home() / ".cache" / "ddd_jax" / "test-heads"))
    path = None if where == "0" else Path(where) / _fit_key(target, seed, steps, n_prompts, T)
    if path is not None and path.is_dir():
        return load_draft(path, target)
    draft = _fit(target, seed, steps, n_prompts, T)
    if path is not None:
        save_draft(draft, path)  # atomic (one rename), so a worker reading it meanwhile sees all of it or none
    return draft


def _fit(target: Target, seed: int, steps: int, n_prompts: int, T: int) -> Draft:
    ps = prompts(n_prompts, seed=100 + seed, lo=2, hi=8, vocab=min(90, target.config.vocab_size))
    no_eos = Target(target.name, dataclasses.replace(target.config, eos_token_id=()), target.params)
    res = generate(no_eos, None, ps, max_new_tokens=T)
    seqs = np.zeros((len(ps), T), np.int32)
    for i, (p, r) in enumerate(zip(ps, res.tokens)):
        s = (p + r)[:T]
        seqs[i, : len(s)] = s
    feats = llama.forward(target.params, target.config, seqs, np.broadcast_to(np.arange(T), seqs.shape)).hidden
    draft = init_draft(target, seed)
    tp, tcfg, dcfg = target.params, target.config, draft.config
    tok_in, feat_in, feat_out = seqs[:, 1:], feats[:, :-1], feats[:, 1:]
    pos = jnp.broadcast_to(jnp.arange(T - 1), tok_in.shape)
    p_target = jax.nn.softmax(llama.lm_head(tp, tcfg, feat_out), -1)

    def loss_fn(dp):
        h, _ = head_forward(dp, dcfg, tp["embed"], tok_in, feat_in, pos)
        reg = optax.huber_loss(h, feat_out, delta=1.0).mean()
        lp = jax.nn.log_softmax(llama.lm_head(tp, tcfg, h), -1)
        return reg + 1.0 * -(p_target * lp).sum(-1).mean()

    opt = optax.adam(1e-2)

    @jax.jit
    def step(dp, st):
        l, g = jax.value_and_grad(loss_fn)(dp)
        u, st = opt.update(g, st, dp)
        return optax.apply_updates(dp, u), st, l

    dp, st = draft.params, opt.init(draft.params)
    for _ in range(steps):
        dp, st, _ = step(dp, st)
    return Draft(dcfg, dp, target)


def first_mismatch_margin(target: Target, prompt: list[int], ref: list[int], got: list[int]):
    """If `got` differs from the vanilla `ref`, return (index, top-2 logit margin of vanilla at that step)."""
    i = next((j for j, (a, b) in enumerate(zip(ref, got)) if a != b), None)
    if i is None:
        if len(ref) == len(got):
            return None
        i = min(len(ref), len(got))
    seq = np.asarray(prompt + ref[:i], np.int32)[None]
    lg = np.asarray(llama.forward(target.params, target.config, seq, np.arange(seq.shape[1])[None]).logits[0, -1])
    top = np.sort(lg)[-2:]
    return i, float(top[1] - top[0])


def jaxpr_eqns(fn, *args) -> list:
    """Every equation of fn's traced program, sub-programs (loops, branches, jit) included, in order."""
    found = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            found.append(e)
            for p in e.params.values():
                for v in p if isinstance(p, (tuple, list)) else (p,):
                    sub = v if hasattr(v, "eqns") else getattr(v, "jaxpr", None)
                    if sub is not None and hasattr(sub, "eqns"):
                        walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found
