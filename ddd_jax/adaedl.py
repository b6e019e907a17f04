"""AdaEDL's entropy-based stop as a DDD rule (`DDDConfig(rule="adaedl", threshold=lambda, gamma=gamma)`).

AdaEDL (S. Agrawal, W. Jeon, M. Lee, "AdaEDL: Early Draft Stopping for Speculative Decoding of Large Language Models
via an Entropy-based Lower Bound on Token Acceptance Probability", 2024, arXiv:2410.18351) bounds the probability
that the target accepts a drafted token from below by the entropy of the draft distribution q it was drawn from,

    P(accept) >= 1 - sqrt(gamma * H(q)),        H(q) = -sum_v q(v) log q(v)  (nats),

and stops drafting as soon as that bound drops below a threshold lambda.

On our trees: at a check step the token "just drafted" is the beam's best node (highest cumulative log-prob), and
its q is its parent's draft distribution, whose entropy the beam keeps (`tree.Beam.ent`, from the log-probs
`first_beam` / `expand` already receive; at a step-0 check the root's). The signal is that node's bound; every sync
mode compares it with `DDDConfig.threshold` through `decode.drafting.stop_signal` (keep drafting while
bound >= lambda), so host, callback and device take the same decisions and the device mode adds no host sync.

Not implemented: the paper also moves lambda with the acceptance it observes from round to round. That needs state
carried across cycles (and through the host policy), which a DDD rule here does not have, so lambda stays the
fixed `threshold` of the config.
"""
from __future__ import annotations

import jax.numpy as jnp

from .tree import Beam


def lower_bound(ent, gamma: float):
    """[...] float32: AdaEDL's acceptance lower bound 1 - sqrt(gamma * H) of draft entropies `ent` (nats)."""
    return (1.0 - jnp.sqrt(jnp.maximum(gamma * ent, 0.0))).astype(jnp.float32)


def stop_signal(beam: Beam, gamma: float):
    """[B] float32: the bound of each sequence's best beam node (a DDD check keeps drafting while it is at least
    the threshold lambda). Needs a beam that keeps entropies (`tree.first_beam(..., entropy=True)`)."""
    if beam.ent is None:
        raise ValueError("the adaedl rule needs the beam's draft entropies: first_beam(..., entropy=True)")
    best = jnp.argmax(beam.score, axis=1)[:, None]  # ties -> the first (the beam is in top_k order)
    return lower_bound(jnp.take_along_axis(beam.ent, best, axis=1)[:, 0], gamma)
