"""Training-time test, shared by every head kind's fit: a head unrolled over K draft steps of a packed batch, each
step reading the head's own output of the step before (what drafting feeds it), and the per-step losses summed
with weights step_decay**k.

Step 0 runs the head over the pairs (tokens[c], h0[c]) at rope position positions[c]; step k >= 1 over
(tokens[c + k], h_{k-1}[c]) at positions[c] + k: the k-th token after the root, and the head's own prediction of
the feature before it. Step k's queries attend step 0's keys as `mask0` allows (causal within the packed sequence)
and, from each step 1..k, the key at their own position (`layers.ttt_attention`): exactly the keys a draft path
of depth k sees in decoding (the prefix, then its own ancestors).

A head kind supplies its step (`eagle.head_forward`, which takes `attend`); each fit supplies `step_loss(k, h_k)`,
the loss of step k's outputs against its own targets (EAGLE-1/2: the target's feature and soft labels at c+1+k;
EAGLE-3: the target's soft labels over the draft vocabulary).
"""
from __future__ import annotations

from functools import partial

import jax.numpy as jnp

from ddd_jax import eagle, layers
from ddd_jax.cache import init_cache, with_length


def shift(x, k: int, fill=0):
    """x[:, c + k] at position c, `fill` past the end: [B, L, ...] -> [B, L, ...]."""
    if k == 0:
        return x
    pad = jnp.full(x.shape[:1] + (k,) + x.shape[2:], fill, x.dtype)
    return jnp.concatenate([x[:, k:], pad], axis=1)


def packed_causal(segments):
    """[B, L] packed sequence numbers (1-based, 0 = padding) -> [B, L, L] bool: causal within each sequence."""
    L = segments.shape[-1]
    same = segments[:, :, None] == segments[:, None, :]
    return jnp.tril(jnp.ones((L, L), bool))[None] & same & (segments > 0)[:, :, None]


def _attend(q, k, v, i, *, mask0, steps: int):
    """Layer i of the unrolled head's caches k, v [layers, B, Hkv, K*L, Dh] through `layers.ttt_attention`."""
    return layers.ttt_attention(q, k[i], v[i], mask0, steps)


def unroll(dparams, dcfg, embed, tokens, h0, positions, mask0, steps: int, step_loss, step_decay: float):
    """Run the head `steps` draft steps (module docstring) and sum `step_loss`'s weighted terms.

    tokens [B, L] int (step 0's input tokens), h0 [B, L, D] (step 0's hidden input: projected target features),
    positions [B, L] int, mask0 [B, L, L] bool. step_loss(k, h_k [B, L, D]) -> (term, metrics dict).
    Returns (sum_k step_decay**k * term_k, {name + str(k): metric of step k}).
    """
    B, L = tokens.shape
    cache = init_cache(1, B, steps * L, dcfg.num_key_value_heads, dcfg.head_dim, h0.dtype)
    h, total, metrics = h0, 0.0, {}
    for k in range(steps):
        h, cache = eagle.head_forward(dparams, dcfg, embed, shift(tokens, k), h, positions + k,
                                      with_length(cache, jnp.full((B,), k * L, jnp.int32)),
                                      attend=partial(_attend, mask0=mask0, steps=k))
        term, m = step_loss(k, h)
        total = total + step_decay ** k * term
        metrics.update({f"{name}{k}": val for name, val in m.items()})
    return total, metrics
