"""How often a drafted node is accepted, by its depth and score: the calibration table the expected-gain DDD rule
reads (`config.GainModel`), measured teacher-forced on the target's own greedy replies.

Greedy verification accepts a node exactly when its path from the root spells the target's greedy continuation, and
a lossless decode's context is vanilla's. So the candidate pool a cycle drafts with the root at position L is the
pool drafted from vanilla's first L + 1 tokens, and its nodes' fates are read off vanilla's next tokens, with no
verification run: `pool_records` drafts one full pool (top_k beams to max_depth) at every position of every reply,
batched over positions, and labels each node.

From the records, `acceptance_table` gives, per depth and score bin, the share of nodes accepted (the calibrated
probability that replaces a raw cumulative log-prob), and per depth the share of accepted beam nodes whose path
continues among their children (what one more draft step can add). `reliability` says how well the table predicts
acceptance on other records (held-out prompts): predicted against observed tokens per cycle.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from ddd_jax import gain
from ddd_jax.config import DDDConfig, GainModel, TreeConfig
from ddd_jax.gain import pool_depths  # noqa: F401 (the pools' layout, read here too)
from ddd_jax.decode import drafting, generate, make_plan
from ddd_jax.eagle import vocab_map
from ddd_jax.tree import draft_entropy, expand, first_beam
from ddd_jax.measure.acceptance import histogram

# bin edges of a node's cumulative draft log-prob (ascending); bin i holds scores in [edges[i-1], edges[i])
SCORE_EDGES = (-12.0, -9.0, -7.0, -5.5, -4.5, -3.5, -2.75, -2.0, -1.5, -1.0, -0.7, -0.45, -0.25, -0.1)
PRIOR = 2.0  # pseudo-nodes of the pooled-over-depth rate each (depth, bin) cell starts from


def _bucket(n: int) -> int:
    return max(32, 1 << (int(n) - 1).bit_length())


@partial(jax.jit, static_argnames=("plan", "capacity"))
def _pools(tparams, dparams, plan, tokens, feats, length, *, capacity: int):
    """Every row's full candidate pool with the root at position length[r] (tokens, feats [R, T(, Df)]: one
    sequence and its target features, repeated; the draft prefix holds pairs i < length - 1 and step 0 runs on the
    pair (x_L, f_{L-1}))."""
    dcache, pend_tok, pend_feat = _prefix(tparams, dparams, plan, tokens, feats, length, capacity)
    d = drafting.begin(tparams, dparams, plan, dcache, pend_tok, pend_feat, jnp.ones((tokens.shape[0],), jnp.int32),
                       jnp.float32(0), end_step=plan.max_depth, decide=False)
    return d.beam.pool_tok, d.beam.pool_score, d.beam.pool_parent


def _prefix(tparams, dparams, plan, tokens, feats, length, capacity: int):
    """(the draft cache over each row's pairs i < length - 1, the pending pair (x_L, f_{L-1}) as [R, 1(, Df)])."""
    R, T = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (R, T))
    dcache = drafting.fill_prefix(dparams, plan, tparams, tokens, feats, pos, length, capacity)
    return (dcache, jnp.take_along_axis(tokens, length[:, None], axis=1),
            jnp.take_along_axis(feats, (length - 1)[:, None, None], axis=1))


@partial(jax.jit, static_argnames=("plan", "capacity"))
def _pools_hidden(tparams, dparams, plan, tokens, feats, length, *, capacity: int):
    """`_pools`, the same steps, and what produced each node's distribution: (pool_tok, pool_score, pool_parent,
    h [R, 1 + max_depth * k, D] float16 the predicted feature of each expanded node (the root's, then each step's
    beam), ent [R, 1 + max_depth * k] the entropy of its children's distribution)."""
    dcache, pend_tok, pend_feat = _prefix(tparams, dparams, plan, tokens, feats, length, capacity)
    dcache, h0, logp0 = drafting.draft_prefix(dparams, plan, tparams, dcache, pend_tok, pend_feat,
                                              jnp.ones((tokens.shape[0],), jnp.int32))
    base = dcache.length
    vmap = vocab_map(dparams, plan.dcfg)
    beam = first_beam(logp0, h0, plan.top_k, plan.max_depth, vmap)
    hs, ents = [h0[:, None]], [draft_entropy(logp0)[:, None]]
    for _ in range(plan.max_depth):
        dcache, h, logp = drafting.step_outputs(dparams, plan, tparams, dcache, base, beam)
        beam = expand(beam, h, logp, plan.top_k, plan.max_depth, vmap)
        hs.append(h)
        ents.append(draft_entropy(logp))
    return (beam.pool_tok, beam.pool_score, beam.pool_parent, jnp.concatenate(hs, 1).astype(jnp.float16),
            jnp.concatenate(ents, 1))


def expanded_of(k: int, max_depth: int) -> np.ndarray:
    """[P] which expanded node (`_pools_hidden`'s h row: 0 the root, 1 + s * k + i step s's beam node i) produced
    each pool slot's distribution."""
    rows = [np.zeros(k, np.int32)]
    for s in range(max_depth):
        rows.append(1 + s * k + np.repeat(np.arange(k, dtype=np.int32), k))
    return np.concatenate(rows)


@partial(jax.jit, static_argnames=("cfg", "aux"))
def _features(tparams, cfg, tokens, *, aux: tuple):
    """The head's target features [1, T, Df] of one sequence: the final hidden state, or EAGLE-3's layer inputs."""
    from ddd_jax import llama
    pos = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    o = llama.forward(tparams, cfg, tokens, pos, return_logits=False, aux_layers=aux)
    return o.aux if aux else o.hidden


def label_pool(pool_tok, pool_parent, depth, cont) -> np.ndarray:
    """[P] bool: the node's path from the root spells `cont` (the target's next tokens; shorter near the end)."""
    acc = np.zeros(len(pool_tok), bool)
    for i in range(len(pool_tok)):  # parents come before their children
        d = depth[i]
        if d > len(cont) or pool_tok[i] != cont[d - 1]:
            continue
        p = pool_parent[i]
        acc[i] = p < 0 or acc[p]
    return acc


def pool_records(target, draft, prompt_ids: list, *, top_k: int = 4, max_depth: int = 6, max_new_tokens: int = 64,
                 rows: int = 32, progress: bool = False, hidden: bool = False) -> dict:
    """The full pool (top_k beams, max_depth steps) drafted at each position of the target's greedy reply to each
    prompt (a "cycle" each), every node labelled accepted or not. Returns "score" [C, P] (cumulative draft log-prob,
    -inf: not drafted), "accepted" [C, P] bool, "prompt" [C] (which prompt; a prompt's cycles are consecutive, one
    per position of its reply), "depth" [P] (`pool_depths`), "prompts", "top_k", "max_depth".

    hidden=True also keeps what produced each node's distribution (the inputs of a learned acceptance output):
    "h" [C, X, D] float16 the predicted features of the X = 1 + max_depth * top_k expanded nodes, "ent" [C, X] the
    entropy of their children's distributions, "parent" [C, P] each slot's parent slot (-1: the root), "tok" [C, P]
    each slot's token, "expanded" [P] (`expanded_of`): the row that drafted each slot."""
    from ddd_jax import eagle
    plan = make_plan(target, draft, method="eagle2", sync="device",
                     tree=TreeConfig(top_k=top_k, total_tokens=2, depth=max_depth), ddd=DDDConfig(),
                     temperature=0.0, top_p=1.0, max_new_tokens=1)
    aux = eagle.feature_layers(draft.config, target.config)
    replies = generate(target, None, [list(map(int, p)) for p in prompt_ids], max_new_tokens=max_new_tokens).tokens
    depth = pool_depths(top_k, max_depth)
    dparams = draft.decode_params()
    scores, accepted, prompt_of, parents, pool_toks, hs, ents = [], [], [], [], [], [], []
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(prompt_ids), desc="node acceptance", unit="prompt")
    for pi, (prompt, reply) in enumerate(zip(prompt_ids, replies)):
        seq = list(map(int, prompt)) + list(map(int, reply))
        plen = len(prompt)
        roots = list(range(plen, len(seq) - 1))  # the root at L, at least one token after it
        if not roots:
            continue
        T = _bucket(len(seq))
        tok = np.zeros((1, T), np.int32)
        tok[0, :len(seq)] = seq
        feats = _features(target.params, target.config, jnp.asarray(tok), aux=aux)
        capacity = -(-(T + plan.scratch + 8) // 256) * 256
        toks, feats = jnp.repeat(jnp.asarray(tok), rows, axis=0), jnp.repeat(feats, rows, axis=0)  # one row a root
        for i in range(0, len(roots), rows):
            part = roots[i:i + rows]
            L = np.array(part + [part[-1]] * (rows - len(part)), np.int32)
            fn = _pools_hidden if hidden else _pools
            out = jax.device_get(fn(target.params, dparams, plan, toks, feats, jnp.asarray(L), capacity=capacity))
            ptok, pscore, ppar = out[:3]
            for r, root in enumerate(part):
                prompt_of.append(pi)
                if hidden:
                    parents.append(ppar[r])
                    pool_toks.append(ptok[r])
                    hs.append(out[3][r])
                    ents.append(out[4][r])
                scores.append(pscore[r])
                accepted.append(label_pool(ptok[r], ppar[r], depth, seq[root + 1: root + 2 + max_depth]))
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    P = len(depth)
    out = {"score": np.array(scores, np.float32).reshape(-1, P), "accepted": np.array(accepted, bool).reshape(-1, P),
           "prompt": np.array(prompt_of, np.int32), "depth": depth, "prompts": len(prompt_ids), "top_k": top_k,
           "max_depth": max_depth}
    if hidden:
        X, D = 1 + max_depth * top_k, draft.config.hidden_size
        out.update(h=np.array(hs, np.float16).reshape(-1, X, D), ent=np.array(ents, np.float32).reshape(-1, X),
                   parent=np.array(parents, np.int32).reshape(-1, P), tok=np.array(pool_toks, np.int32).reshape(-1, P),
                   expanded=expanded_of(top_k, max_depth))
    return out


def _flat(records: dict):
    """(depth, score, accepted) of every drafted (finite) node, and the cycle count."""
    score, acc = records["score"], records["accepted"]
    ok = np.isfinite(score)
    depth = np.broadcast_to(records["depth"], score.shape)
    return depth[ok], score[ok], acc[ok], score.shape[0]


def acceptance_table(records: dict, edges=SCORE_EDGES, prior: float = PRIOR) -> dict:
    """{"edges", "accept" [D][len(edges) + 1]: P(accepted | depth d + 1, score bin), "cont" [D]: P(an accepted beam
    node at depth d + 1 has an accepted child), "nodes" [D][bins]: the counts}. Each cell is shrunk toward its bin's
    rate pooled over depths (`prior` pseudo-nodes), then made non-decreasing in score within its depth (a higher
    cumulative log-prob is never less likely to be accepted)."""
    depth, score, acc, cycles = _flat(records)
    D = int(records["max_depth"]) + 1
    nb = len(edges) + 1
    b = np.searchsorted(np.asarray(edges), score, side="right")
    pooled_n = np.bincount(b, minlength=nb).astype(float)
    pooled_a = np.bincount(b, weights=acc, minlength=nb)
    pooled = (pooled_a + 0.5) / (pooled_n + 1.0)
    table, counts, cont = [], [], []
    for d in range(1, D + 1):
        m = depth == d
        n = np.bincount(b[m], minlength=nb).astype(float)
        a = np.bincount(b[m], weights=acc[m], minlength=nb)
        p = (a + prior * pooled) / (n + prior)
        table.append([float(x) for x in np.maximum.accumulate(p)])
        counts.append([int(x) for x in n])
        # an accepted depth-(d + 1) node's parent is an accepted beam node at depth d: of those, the share with one
        cont.append(float((((depth == d + 1) & acc).sum() + 0.5) / (beam_accepted(records, d) + 1.0)) if d < D else 0.0)
    return {"edges": [float(e) for e in edges], "accept": table, "cont": cont, "nodes": counts,
            "cycles": int(cycles), "top_k": int(records["top_k"]),
            "max_depth": int(records["max_depth"])}


def beam_accepted(records: dict, d: int) -> int:
    """Accepted beam nodes at depth d (the top_k of depth d by score, expanded by the next step) over all cycles."""
    k = int(records["top_k"])
    m = records["depth"] == d
    sc, acc = records["score"][:, m], records["accepted"][:, m]
    top = np.argsort(-sc, axis=1, kind="stable")[:, :k]
    return int(np.take_along_axis(acc, top, axis=1).sum())


def lookup_accept(table: dict, depth, score) -> np.ndarray:
    """The table's P(accepted) for nodes of `depth` (>= 1; deeper than the table: its last row) and `score`."""
    acc = np.asarray(table["accept"])
    d = np.clip(np.asarray(depth) - 1, 0, len(acc) - 1)
    b = np.searchsorted(np.asarray(table["edges"]), np.asarray(score), side="right")
    return acc[d, b]


def reliability(table: dict, records: dict, bins: int = 10) -> dict:
    """How well `table` predicts acceptance on `records` (other prompts): expected against observed accepted nodes
    per cycle, and per decile of predicted probability (a reliability diagram's points)."""
    depth, score, acc, n = _flat(records)
    p = lookup_accept(table, depth, score)
    acc = acc.astype(float)
    n = max(n, 1)
    order = np.argsort(p)
    parts = np.array_split(order, bins)
    return {"predicted_per_cycle": float(p.sum() / n), "observed_per_cycle": float(acc.sum() / n),
            "brier": float(np.mean((p - acc) ** 2)),
            "deciles": [{"predicted": float(p[i].mean()), "observed": float(acc[i].mean()), "nodes": int(len(i))}
                        for i in parts if len(i)]}


# ----------------------------------------------------------------------------------------------- offline replay
def _interp(ms: dict):
    pts = sorted((int(k), float(v)) for k, v in ms.items())
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    return lambda n: float(np.interp(n, xs, ys))


class Replay:
    """Stop rules replayed over recorded pools: what each cycle would draft, verify and accept under a rule, and
    what it would cost at `costs` = {"target_ms": {rows: ms}, "draft_ms": ms of one step over the beam,
    "fixed_ms": ms per cycle}. Greedy acceptance of a tree is the number of accepted nodes it keeps (they form
    its accepted path), so a replay is exact for the recorded pools; what it cannot see is that a real decode's
    cycles start only where the previous one ended. The gain rule's arithmetic is `ddd_jax.gain`'s own, called on
    the pools as [cycles, pool] arrays: the replay decides exactly as the decode does.

    probs [C, P]: each node's P(accepted) from a learned acceptance output (`measure.learned_acceptance`); trees
    then keep the nodes it ranks best and the gain rule reads it in place of the table."""

    def __init__(self, records: dict, table: dict, costs: dict, widths, probs=None):
        self.rec, self.k = records, int(records["top_k"])
        self.table = table
        self.probs = None if probs is None else np.asarray(probs, np.float32)
        self.widths = tuple(int(w) for w in widths)
        t = _interp(costs["target_ms"])
        self.t = np.array([t(w) for w in self.widths])
        self.t1, self.d, self.fixed = t(1), float(costs["draft_ms"]), float(costs.get("fixed_ms", 0.0))
        score, depth = records["score"], records["depth"]
        self.steps = []  # per step j: (cum accepted [C, P + 1] best first, drafted nodes [C], pool [C, P]) after j
        for j in range(int(records["max_depth"]) + 1):
            vis = np.where(depth[None] <= j + 1, score, -np.inf)
            rank_key = vis if self.probs is None else np.where(np.isfinite(vis), self.probs, -1.0)
            order = np.argsort(-rank_key, axis=1, kind="stable")
            acc = np.take_along_axis(records["accepted"] & np.isfinite(vis), order, axis=1)
            zero = np.zeros((len(score), 1))
            self.steps.append((np.concatenate([zero, np.cumsum(acc, 1)], 1), np.isfinite(vis).sum(1),
                               vis.astype(np.float32)))

    def model(self, lam=None) -> GainModel:
        """The `GainModel` of this replay's table and costs (rate `lam`: tokens per ms; None: each cycle's own)."""
        tab = self.table
        return GainModel(tab["edges"], tab["accept"], tab["cont"], self.widths, tuple(self.t), self.d, self.fixed,
                         lam or 0.0)

    def width_of(self, rows):
        """The narrowest compiled width holding `rows` [C]."""
        idx = np.searchsorted(np.asarray(self.widths), rows)
        return np.minimum(idx, len(self.widths) - 1)

    def cycles(self, acc) -> np.ndarray:
        """The rows a decode visits: from each prompt's first position, the next cycle's root is acc + 1 tokens on
        (every row where records carry no "prompt")."""
        if "prompt" not in self.rec:
            return np.arange(len(acc))
        rows, prompt = [], self.rec["prompt"]
        starts = np.flatnonzero(np.r_[True, prompt[1:] != prompt[:-1]])
        ends = np.r_[starts[1:], len(prompt)]
        for s, e in zip(starts, ends):
            r = s
            while r < e:
                rows.append(r)
                r += int(acc[r]) + 1
        return np.asarray(rows, int)

    def _result(self, depth, kept):
        C = len(depth)
        acc = np.array([self.steps[depth[c]][0][c, kept[c]] for c in range(C)]).astype(int)
        rows = self.cycles(acc)
        depth, kept, acc = depth[rows], kept[rows], acc[rows]
        need = 1 + kept
        wi = self.width_of(need)
        cost = self.t[wi] + self.d * (1 + depth) + self.fixed
        tau = 1 + acc
        return {"tau": float(tau.mean()), "mean_depth": float(depth.mean()),
                "depth_hist": histogram(depth), "need_hist": histogram(need),
                "mean_width": float(np.mean(np.asarray(self.widths)[wi])),
                "cycle_ms": float(cost.mean()), "speedup": float(tau.mean() * self.t1 / cost.mean())}

    def static(self, total_tokens: int, depth: int):
        C = self.rec["score"].shape[0]
        dep = np.full(C, depth)
        kept = np.minimum(total_tokens - 1, self.steps[depth][1])
        return self._result(dep, kept)

    def threshold(self, total_tokens: int, check_steps, threshold: float, max_depth: int, stop0_nodes: int = -1):
        C = self.rec["score"].shape[0]
        dep = np.full(C, max_depth)
        live = np.ones(C, bool)
        kept0 = np.zeros(C, bool)
        for j in range(max_depth):
            if j not in check_steps:
                continue
            vis = self.rec["score"][:, self.rec["depth"] == j + 1]
            beam = -np.sort(-vis, axis=1)[:, :self.k]
            conf = np.logaddexp.reduce(beam, axis=1)
            stop = live & (conf < np.float32(threshold))
            dep[stop] = j
            kept0 |= stop & (j == 0)
            live &= ~stop
        kept = np.array([min(total_tokens - 1, self.steps[dep[c]][1][c]) for c in range(C)])
        if stop0_nodes >= 0:
            kept = np.where(kept0, np.minimum(kept, stop0_nodes), kept)
        return self._result(dep, kept)

    def best_width(self, j: int, N: int, lam=None, rows=None):
        """Per cycle (or the cycles `rows`): (index into widths, E, C, nodes kept) of the width maximising
        (1 + expected accepted) - lam * cost after j steps (lam: tokens per ms the decode reaches; None: this cycle's
        own E / C) -- `gain.best_width` on the pools."""
        gm, vis = self.model(lam), self.steps[j][2]
        vis = vis if rows is None else vis[rows]
        _, cum, drafted = gain.ranked(gm, jnp.asarray(vis), self.k, int(self.rec["max_depth"]), self._p(rows))
        out = gain.best_width(gm, cum, drafted, jnp.full((len(vis),), j, jnp.int32), N)
        return tuple(np.asarray(x) for x in out)

    def _p(self, rows=None):
        """The learned probabilities as `gain` reads them (None: the table's)."""
        if self.probs is None:
            return None
        return jnp.asarray(self.probs if rows is None else self.probs[rows])

    def _beam(self, j: int):
        """(scores [C, k], learned probabilities [C, k] or None) of the beam a decode expands after step j: the k
        best-scored nodes at depth j + 1."""
        at = np.where(self.rec["depth"][None] == j + 1, self.steps[j][2], -np.inf)
        top = np.argsort(-at, axis=1, kind="stable")[:, :self.k]
        score = np.take_along_axis(at, top, axis=1)
        return score, None if self.probs is None else np.take_along_axis(self.probs, top, axis=1)

    def gain(self, total_tokens: int, max_depth: int, margin: float = 0.0, lam=None):
        """The gain rule (`DDDConfig(rule="gain", threshold=margin)`, checks at every step below max_depth): each
        cycle's depth where `gain.signal` first falls below the margin, then the nodes `gain.kept_nodes` keeps."""
        C, N, R = self.rec["score"].shape[0], total_tokens, int(self.rec["max_depth"])
        gm = self.model(lam)
        dep = np.full(C, max_depth)
        live = np.ones(C, bool)
        for j in range(max_depth):
            vis = self.steps[j][2]
            beam, beam_p = self._beam(j)
            sig = np.asarray(gain.signal(gm, jnp.asarray(vis), jnp.asarray(beam, jnp.float32), j,
                                         jnp.full((C,), j, jnp.int32), N, R, self._p(),
                                         None if beam_p is None else jnp.asarray(beam_p)))
            stop = live & ~(sig >= np.float32(margin))  # the decode drafts on while signal >= threshold
            dep[stop] = j
            live &= ~stop
        kept = np.zeros(C, int)
        for j in range(max_depth + 1):
            sel = dep == j
            if sel.any():
                _, m = gain.kept_nodes(gm, jnp.asarray(self.steps[j][2][sel]), jnp.full((int(sel.sum()),), j,
                                                                                       jnp.int32), self.k, N, R,
                                       self._p(sel))
                kept[sel] = np.asarray(m)
        return self._result(dep, kept)

    def specdec(self, total_tokens: int, max_depth: int, h: float):
        """SpecDec++'s stop rule over the learned probabilities: stop after the first step j where the chance that
        the best drafted path holds a rejection, 1 - max p over the beam, passes h; keep the total_tokens - 1 nodes
        ranked best."""
        if self.probs is None:
            raise ValueError("Replay.specdec reads learned probabilities: pass probs=")
        C = self.rec["score"].shape[0]
        dep = np.full(C, max_depth)
        live = np.ones(C, bool)
        for j in range(max_depth):
            _, beam_p = self._beam(j)
            stop = live & (1.0 - beam_p.max(axis=1) > h)
            dep[stop] = j
            live &= ~stop
        kept = np.array([min(total_tokens - 1, self.steps[dep[c]][1][c]) for c in range(C)])
        return self._result(dep, kept)

    def oracle(self):
        """Each cycle drafts and verifies exactly its accepted chain (the best any rule could do with this head)."""
        a = self.steps[-1][0][:, -1].astype(int)
        t = _interp({w: v for w, v in zip(self.widths, self.t)} | {1: self.t1})
        cost = np.array([t(1 + x) for x in a]) + self.d * np.maximum(a, 1) + self.fixed
        return {"tau": float((1 + a).mean()), "speedup": float((1 + a).mean() * self.t1 / cost.mean())}

