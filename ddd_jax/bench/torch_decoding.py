"""The same decoding in eager PyTorch -- vanilla, EAGLE-2 and DDD with host or device stop decisions -- structured
as the official EAGLE code, so that `ddd-jax lazy-eval` can compare what host synchronisation costs in each framework.

Importing this module imports torch and transformers (``pip install 'ddd-jax[torch]'``); no JAX decoding code
imports it.

Same weights: the target is transformers' `LlamaForCausalLM` built from our params (`ModelConfig.to_hf_config()`,
the HF key table run backwards by `keytable.export`); the head is the torch reference EAGLE-1/2 head
(`checkpoints.torch_ref.TorchEagleHead`, official key names) sharing the target's embedding, drafting over the
head's reduced vocabulary (`d2t`, the target's output-embedding rows `lm_sub`) when it has one.

Same semantics as `ddd_jax.drafting` / `tree` / `verify`, so that on the same weights both frameworks take the same
depths and emit the same tokens (float32 near-ties aside):
* step 0 runs the head over the newly committed (token, feature) pairs and gives the first beam (top_k); step j >= 1
  runs the head on the depth-j beam (each node sees the prefix and its ancestors; all at position base + j - 1),
  scores its k*k children by cumulative log-prob and keeps the best k;
* the candidate pool is laid out by step (pool[0:k] from step 0, pool[k + (j-1)k^2 + i*k + c] = child c of beam node
  i at step j), reranked by score with a stable sort; the best total_tokens - 1 are kept, in pool order, under the
  root;
* DDD: after check step s, drafting stops if logsumexp(beam scores) < threshold (compared in float32);
* greedy acceptance: the deepest node whose ancestors all equal the target's argmax; bonus = argmax at that node.

Structure of the official code (SafeAILab/EAGLE `cnets.py` `topK_genrate`, `utils.py` `evaluate_posterior`,
`update_inference_inputs`): a Python loop over draft steps with `topk` on the device; the tree mask is built from
host-side parent indices and leaf paths (`retrieve_indices`); acceptance is a cumulative product over the leaf
paths; afterwards only the accepted path's KV is kept (an index-select on every layer's cache tensors).

Host syncs -- every device->host read of the decode loop goes through a `SyncCounter`:
* draft (``draft_syncs``): sync="host" reads the beam confidence with ``.item()`` at each check executed (the
  paper's shape); sync="device" keeps the decision on the device (`torch.where`) and runs the remaining steps
  masked: no read, but never an early exit either (eager PyTorch cannot leave a loop without reading a value);
* tree assembly: one read of the kept nodes' parents and tokens (the official code's ``.tolist()``);
* acceptance: one read of (best leaf path, accepted length, bonus token);
* vanilla: one read per token (the new token, for the EOS test and the output).
Batch size 1, greedy only (as the official code's `eagenerate`).

On CUDA, ``profile=True`` synchronises at phase boundaries (the split is then exact); ``compile=True`` wraps the
target and head forwards in `torch.compile` (dynamic shapes). CUDA graphs are not used: the KV cache grows by a
tree per cycle, and capturing graphs would need a static cache and fixed tree shapes. Neither path was run on a
GPU in this project yet.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np

try:
    import torch
    import transformers
except ModuleNotFoundError as e:  # the extra is missing
    raise ModuleNotFoundError(f"the PyTorch decoding needs torch and transformers ({e.name!r} is not installed): "
                              "pip install 'ddd-jax[torch]'", name=e.name) from e

from ddd_jax.checkpoints.eagle_official import EAGLE1_RULES
from ddd_jax.checkpoints.hf import HF_LLAMA_RULES
from ddd_jax.keytable import export
from ddd_jax.checkpoints.torch_ref import TorchEagleHead, load_official_head
from ddd_jax.config import DDDConfig, TreeConfig
from ddd_jax.decode import GenerateResult, make_plan
from ddd_jax.eagle import Draft
from ddd_jax.backends.cpu.quant import dequantize_tree

METHODS = ("vanilla", "eagle2", "ddd")
SYNCS = ("host", "device")  # DDD's stop decision in torch (JAX also has "callback")


# ----------------------------------------------------------------------------------------------- devices, models
def torch_device(device: str = "cpu") -> "torch.device":
    """'cpu' | 'gpu' | 'cuda' | 'cuda:N' -> torch.device; a GPU asked for where there is none is a ValueError."""
    name = {"gpu": "cuda"}.get(device, device)
    if not (name == "cpu" or name == "cuda" or name.startswith("cuda:")):
        raise ValueError(f"unknown torch device {device!r}; use cpu or gpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: torch sees no CUDA GPU (torch {torch.__version__})")
    return torch.device(name)


def _torch_dtype(dtype) -> "torch.dtype":
    name = np.dtype(dtype).name
    table = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if name not in table:
        raise ValueError(f"parameter dtype {name} has no torch counterpart here (float32, float16, bfloat16)")
    return table[name]


def _tensor(x, dtype, device) -> "torch.Tensor":
    a = np.asarray(x)
    if a.dtype.name == "bfloat16":  # numpy cannot hand bfloat16 to torch: go through float32 (exact)
        a = a.astype(np.float32)
    return torch.from_numpy(np.array(a, copy=True)).to(device=device, dtype=dtype)  # writable, contiguous


def torch_target(target, device="cpu") -> "transformers.LlamaForCausalLM":
    """transformers' `LlamaForCausalLM` holding `target`'s weights (HF weight = our input-major W transposed)."""
    dev = torch_device(device) if not isinstance(device, torch.device) else device
    dtype = _torch_dtype(target.params["embed"].dtype)
    cfg = transformers.LlamaConfig(**target.config.to_hf_config())
    model = transformers.LlamaForCausalLM(cfg)
    named = export(dequantize_tree(target.params), HF_LLAMA_RULES, f"target {target.name}")
    sd = {k: _tensor(v, dtype, "cpu") for k, v in named.items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    allowed = {"lm_head.weight"} if target.config.tie_word_embeddings else set()
    if set(missing) - allowed or unexpected:
        raise ValueError(f"building the torch target: missing {sorted(set(missing) - allowed)}, "
                         f"unexpected {sorted(unexpected)}")
    if target.config.tie_word_embeddings:
        model.tie_weights()
        if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
            model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(device=dev, dtype=dtype).eval()


def torch_head(draft, model) -> TorchEagleHead:
    """The torch reference EAGLE-1/2 head holding `draft`'s weights; its embedding is the torch target's."""
    dcfg = draft.config
    c = {"vocab_size": dcfg.vocab_size, "hidden_size": dcfg.hidden_size, "intermediate_size": dcfg.intermediate_size,
         "num_attention_heads": dcfg.num_attention_heads, "num_key_value_heads": dcfg.num_key_value_heads,
         "head_dim": dcfg.head_dim, "rms_norm_eps": dcfg.rms_norm_eps, "rope_theta": dcfg.rope_theta,
         "bias": dcfg.fc_bias}
    emb = model.model.embed_tokens.weight
    head = TorchEagleHead(c)
    params = {k: v for k, v in dequantize_tree(draft.params).items() if k != "d2t"}
    sd = {k: _tensor(v, emb.dtype, "cpu") for k, v in export(params, EAGLE1_RULES, "draft head").items()}
    sd["embed_tokens.weight"] = head.embed_tokens.weight.detach()  # replaced by the target's below
    head.load_state_dict(sd, strict=True)
    if dcfg.rope_scaling:  # e.g. llama3 scaling: the same inverse frequencies as the JAX head
        from ddd_jax.layers import rope_inv_freq
        inv = torch.from_numpy(np.asarray(rope_inv_freq(dcfg.layer_config()), np.float32))
        head.layers[0].self_attn.inv_freq = inv
    head = head.to(device=emb.device, dtype=emb.dtype).eval()
    head.embed_tokens.weight = emb  # shared, as EAGLE shares the target's embedding at run time
    return head


def cache_kwarg(forward) -> str:
    """The keyword under which `forward` (a transformers model's forward) takes the KV cache: "cache" where its
    signature has that parameter (transformers 5.24 renamed it and deprecated "past_key_values"), else
    "past_key_values" (older releases). Read once per model from the signature, not tried per call."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


@dataclass
class TorchModels:
    """The torch side of one target (+ head): what `generate` runs."""

    target: object  # the ddd_jax Target the weights came from (config, EOS ids, tokenizer)
    draft: object | None  # the ddd_jax Draft, or None
    model: "transformers.LlamaForCausalLM"
    head: TorchEagleHead | None
    draft_out: "torch.Tensor | None"  # [V', D] output-embedding rows the head drafts over (V' = V without d2t)
    d2t: "torch.Tensor | None"  # [V'] target ids of the draft vocabulary (None: full vocabulary)
    device: "torch.device"
    compiled: bool = False
    cache_kw: str = ""  # the keyword the target's forwards take the KV cache by (`cache_kwarg`); "" = read it here

    def __post_init__(self):
        if not self.cache_kw:
            self.cache_kw = cache_kwarg(self.model.forward)

    @property
    def attn_implementation(self) -> str:
        return str(self.model.config._attn_implementation)


def official_head(path, model) -> TorchEagleHead:
    """The EAGLE-1/2 head of official directory `path` (what `save_official` writes, or a released head), read as
    SafeAILab/EAGLE reads it (`torch_ref.load_official_head`: model.safetensors / pytorch_model.bin into the
    official parameter names with `strict=True`; ddd-jax's side file is never opened), in the torch target's dtype
    and device and sharing its embedding (EAGLE's `Model` takes the base model's embedding)."""
    emb = model.model.embed_tokens.weight
    head = load_official_head(path).to(device=emb.device, dtype=emb.dtype).eval()
    head.embed_tokens.weight = emb
    return head


def full_vocabulary(draft):
    """`draft` drafting over the whole target vocabulary (its `d2t` dropped), as EAGLE's own code drafts."""
    if "d2t" not in draft.params:
        return draft
    return Draft(dataclasses.replace(draft.config, draft_vocab_size=None),
                 {k: v for k, v in draft.params.items() if k != "d2t"}, draft.target, draft.name)


def load_torch(target, draft=None, device="cpu", compile: bool = False, official=None) -> TorchModels:
    """Build the torch target (and head) from ddd_jax's `target` (and `draft`) on `device` ('cpu' | 'gpu').

    official: an official EAGLE-1/2 head directory instead of `draft`'s weights: the head is read strictly, as
    SafeAILab/EAGLE reads it (`official_head`), and drafts over the whole vocabulary, as EAGLE's code does; the
    plan's head config is `draft`'s, by default ddd-jax's own load of the same directory over the whole vocabulary.
    compile=True wraps both forwards in `torch.compile(dynamic=True)` (meant for GPUs; untested here)."""
    dev = torch_device(device) if not isinstance(device, torch.device) else device
    model = torch_target(target, dev)
    cache_kw = cache_kwarg(model.forward)  # before torch.compile wraps the forwards
    head = draft_out = d2t = None
    if official is not None:
        from ddd_jax.checkpoints.loading import load_draft
        draft = full_vocabulary(draft if draft is not None else load_draft(official, target))
        draft.config.check_target(target.config)
        head, draft_out = official_head(official, model), model.lm_head.weight
    elif draft is not None:
        draft.config.check_target(target.config)
        head = torch_head(draft, model)
        if "d2t" in draft.params:
            d2t = torch.from_numpy(np.asarray(draft.params["d2t"], np.int64)).to(dev)
            draft_out = _tensor(draft.lm_sub, model.lm_head.weight.dtype, dev)
        else:
            draft_out = model.lm_head.weight
    if compile:
        model.model.forward = torch.compile(model.model.forward, dynamic=True)
        if head is not None:
            head.step = torch.compile(head.step, dynamic=True)
    return TorchModels(target=target, draft=draft, model=model, head=head, draft_out=draft_out, d2t=d2t,
                       device=dev, compiled=compile, cache_kw=cache_kw)


# ----------------------------------------------------------------------------------------------- syncs and clock
class SyncCounter:
    """Every device->host read of the torch decode loop goes through here (counted per phase)."""

    def __init__(self):
        self.by_phase = Counter()

    @property
    def total(self) -> int:
        return sum(self.by_phase.values())

    def item(self, x: "torch.Tensor", phase: str):
        """One scalar read (`.item()`)."""
        self.by_phase[phase] += 1
        return x.item()

    def tolist(self, x: "torch.Tensor", phase: str) -> list:
        """One read of a small tensor (`.tolist()`)."""
        self.by_phase[phase] += 1
        return x.tolist()


class _PhaseClock:
    """Wall time per phase. Eager CPU work is synchronous, so the laps are exact there; on CUDA they are exact only
    with profile=True, which synchronises the stream at each lap."""

    def __init__(self, device, profile: bool):
        self.cuda_sync = profile and device.type == "cuda"
        self.times = {"draft_s": 0.0, "verify_s": 0.0, "commit_s": 0.0}
        self._t = 0.0

    def start(self) -> None:
        self._t = time.perf_counter()

    def lap(self, phase: str) -> None:
        if self.cuda_sync:
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.times[phase + "_s"] += now - self._t
        self._t = now


def _finish(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------- output
class _Output:
    """Emitted tokens with generate's rules: cut at the first EOS (kept) and at max_new_tokens."""

    def __init__(self, eos, max_new_tokens: int):
        self.eos, self.max_new = set(eos), max_new_tokens
        self.tokens: list[int] = []
        self.done = False

    def emit(self, new: list[int]) -> int:
        keep = len(new)
        hit = next((i for i, t in enumerate(new) if t in self.eos), None)
        if hit is not None:
            keep = hit + 1
        keep = min(keep, self.max_new - len(self.tokens))
        self.tokens += new[:keep]
        self.done = (hit is not None and hit < keep) or len(self.tokens) >= self.max_new
        return keep


# ----------------------------------------------------------------------------------------------- the draft phase
@dataclass
class _Drafted:
    prefix_kv: tuple  # head K/V of the committed pairs ([1, K, base, H] each): the next cycle's prefix
    pool_score: "torch.Tensor"  # [P] cumulative log-probs (-inf: masked steps, device mode)
    pool_tok: "torch.Tensor"  # [P] target token ids
    pool_parent: "torch.Tensor"  # [P] pool index of the parent (-1: the root)
    depth: "int | torch.Tensor"  # draft steps taken (a 0-d tensor in device mode: read with the tree)


def _draft_logp(m: TorchModels, h):
    """Draft log-probs over the draft vocabulary, and the map to target ids. h [..., D] -> [..., V']."""
    return torch.log_softmax((h @ m.draft_out.T).float(), dim=-1)


def _to_target_ids(m: TorchModels, tok):
    return tok if m.d2t is None else m.d2t[tok]


def _draft(m: TorchModels, plan, prefix_kv, pend_tok, pend_feat, counter: SyncCounter, threshold: float) -> _Drafted:
    """Step 0 and the beam steps (EAGLE's topK_genrate), with DDD's checks (host: `.item()`; device: masked)."""
    head, dev = m.head, m.device
    k, W = plan.top_k, plan.scratch
    device_mode = plan.method == "ddd" and plan.sync == "device"
    checks = set(plan.check_steps)
    # step 0: the newly committed pairs extend the head's prefix cache
    dlen = 0 if prefix_kv is None else prefix_kv[0].shape[2]
    n = pend_tok.shape[1]
    pos = torch.arange(dlen, dlen + n, device=dev)[None]
    h, prefix_kv = head.step(pend_feat, pend_tok, pos, prefix_kv)
    base = dlen + n
    h0 = h[0, -1]  # [D]
    score, tok = torch.topk(_draft_logp(m, h0), k)  # [k]
    tok = _to_target_ids(m, tok)
    pool_score, pool_tok, pool_parent = [score], [tok], [torch.full((k,), -1, dtype=torch.long, device=dev)]
    feat = h0.expand(k, -1)  # [k, D] each node's feature: its parent's output
    pool_idx = torch.arange(k, device=dev)
    anc = torch.zeros(k, W, dtype=torch.bool, device=dev)  # scratch slots of each node's ancestors (and its own)
    if W:  # depth 0 (EAGLE-2 with no expansion step) has no scratch
        anc[:, :k] = torch.eye(k, dtype=torch.bool, device=dev)
    kv = prefix_kv
    depth = torch.zeros((), dtype=torch.long, device=dev) if device_mode else 0
    active = torch.ones((), dtype=torch.bool, device=dev)
    neg = torch.tensor(-math.inf, device=dev)
    thr = torch.tensor(threshold, dtype=torch.float32, device=dev)
    own = torch.arange(k, device=dev)
    steps = plan.max_depth
    if plan.method == "ddd" and 0 in checks:  # a check at step 0: expand? (a stop keeps the best stop0_nodes)
        conf = torch.logsumexp(score, dim=-1)
        keep = k if plan.stop0_nodes < 0 else min(plan.stop0_nodes, k)
        kept = torch.where(torch.arange(k, device=dev) < keep, score, neg)  # the top-k come best first
        if device_mode:
            active = active & (conf >= thr)
            pool_score[0] = torch.where(active, score, kept)
        elif counter.item(conf, "draft") < threshold:
            steps = 0
            pool_score[0] = kept
    for j in range(1, steps + 1):
        pos = torch.full((1, k), base + j - 1, device=dev)
        mask = torch.cat([torch.ones(k, base, dtype=torch.bool, device=dev), anc[:, : j * k]], 1)[None]
        h, kv = head.step(feat[None], tok[None], pos, kv, mask)  # kv: prefix + every beam so far
        child_lp, child_tok = torch.topk(_draft_logp(m, h[0]), k, dim=-1)  # [k, k]
        child_tok = _to_target_ids(m, child_tok)
        cu = score[:, None] + child_lp
        if device_mode:
            cu = torch.where(active, cu, neg)
        flat_cu, flat_tok = cu.reshape(-1), child_tok.reshape(-1)
        pool_score.append(flat_cu)
        pool_tok.append(flat_tok)
        pool_parent.append(pool_idx.repeat_interleave(k))
        top_score, top_i = torch.topk(flat_cu, k)
        src = top_i // k
        new_anc = anc[src]
        if j < plan.max_depth:
            new_anc[own, j * k + own] = True
        new = (flat_tok[top_i], h[0][src], top_score, k + (j - 1) * k * k + top_i, new_anc)
        if device_mode:  # the analogue of JAX's device mode: keep the old beam where drafting has stopped
            tok, feat, score, pool_idx, anc = (torch.where(active.reshape((1,) * x.ndim), x, old)
                                               for x, old in zip(new, (tok, feat, score, pool_idx, anc)))
            depth = depth + active.long()
        else:
            tok, feat, score, pool_idx, anc = new
            depth += 1
        if plan.method == "ddd" and j in checks:
            conf = torch.logsumexp(score, dim=-1)
            if device_mode:
                active = active & (conf >= thr)
            elif counter.item(conf, "draft") < threshold:  # the paper's host sync: `.item()` on the confidence
                break
    return _Drafted(prefix_kv=prefix_kv, pool_score=torch.cat(pool_score), pool_tok=torch.cat(pool_tok),
                    pool_parent=torch.cat(pool_parent), depth=depth)


# ----------------------------------------------------------------------------------------------- verification
def _tree(plan, root, d: _Drafted, counter: SyncCounter):
    """Rerank the pool (stable sort by score), keep the best total_tokens - 1 under the root, the real (finite)
    ones first, each group in pool order (as `tree.build_tree`), and read their parents, tokens and how many are
    real to the host (one sync); the tree is the root and its real nodes (what JAX's narrowest width verifies).
    Returns (tokens [n] on device, parents, tokens, depth)."""
    P = d.pool_score.shape[0]
    # the kept nodes: total_tokens - 1, or the whole pool when it is shorter (host mode: a stop at a step-0 check
    # leaves the top_k first-beam candidates alone, fewer than total_tokens - 1 when N > k + 1)
    K = min(plan.total_tokens - 1, P)
    order = torch.sort(-d.pool_score, stable=True).indices[:K]
    key = torch.sort(torch.where(torch.isfinite(d.pool_score[order]), 0, P) + order).values
    kept = key % P  # real nodes first, each group in pool order: parents before children
    ppool = d.pool_parent[kept]
    parent = torch.where(ppool < 0, 0, torch.searchsorted(key, ppool.clamp(min=0)) + 1)
    tokens = torch.cat([root.reshape(1), d.pool_tok[kept]])
    depth = d.depth if isinstance(d.depth, torch.Tensor) else torch.tensor(d.depth, device=tokens.device)
    real = torch.isfinite(d.pool_score[kept]).sum()
    host = counter.tolist(torch.cat([parent, tokens, depth.reshape(1), real.reshape(1)]), "verify")
    n = 1 + host[-1]
    return tokens[:n], ([0] + host[:K])[:n], host[K: 2 * K + 1][:n], host[-2]


def _retrieve_indices(parents: list[int]) -> tuple[list[int], list[list[int]]]:
    """Depth of every tree slot and the root-to-leaf paths padded with -1 (EAGLE's retrieve_indices)."""
    N = len(parents)
    depth = [0] * N
    for i in range(1, N):
        depth[i] = depth[parents[i]] + 1
    inner = set(parents[1:])
    width = max(depth) + 1
    paths = []
    for leaf in (i for i in range(N) if i not in inner):
        p = [leaf]
        while p[-1] != 0:
            p.append(parents[p[-1]])
        paths.append(p[::-1] + [-1] * (width - len(p)))
    return depth, paths


def _tree_mask(parents: list[int], device) -> "torch.Tensor":
    """[N, N] ancestor-or-self mask, built row by row from the host-side parent list as EAGLE does."""
    N = len(parents)
    mask = torch.eye(N, dtype=torch.bool, device=device)
    mask[:, 0] = True
    for i in range(1, N):
        mask[i] |= mask[parents[i]]
    return mask


def _verify(m: TorchModels, plan, cache, root, d: _Drafted, counter: SyncCounter):
    """One target forward over the tree (4D mask, explicit positions, the KV cache) and EAGLE's evaluate_posterior.
    Returns (hidden [N, D], path (tree slots, root first), emitted tokens, depth)."""
    model, dev = m.model, m.device
    tokens, parents, tok_host, depth = _tree(plan, root, d, counter)
    node_depth, paths = _retrieve_indices(parents)
    N = len(parents)
    L = cache.get_seq_length()
    dtype = model.model.embed_tokens.weight.dtype
    tree = _tree_mask(parents, dev)
    att = torch.zeros(1, 1, N, L + N, dtype=dtype, device=dev)
    att[0, 0, :, L:] = torch.where(tree, 0.0, torch.finfo(dtype).min)
    pos = torch.tensor([[L + x for x in node_depth]], device=dev)
    out = model.model(input_ids=tokens[None], position_ids=pos, attention_mask=att, use_cache=True,
                      **{m.cache_kw: cache})
    hidden = out.last_hidden_state[0]  # [N, D] (final-normed: the head's features)
    pred = model.lm_head(hidden).argmax(-1)  # [N]
    ridx = torch.tensor(paths, device=dev)  # [leaves, width]
    cand = torch.cat([tokens, tokens.new_full((1,), -1)])[ridx]  # -1 pads never match
    post = (cand[:, 1:] == pred[ridx[:, :-1]]).int()
    acc_len = torch.cumprod(post, dim=1).sum(dim=1)
    best = torch.argmax(acc_len)
    acc = acc_len[best]
    bonus = pred[ridx[best, acc]]
    best_h, acc_h, bonus_h = counter.tolist(torch.stack([best, acc, bonus]), "verify")
    path = paths[best_h][: acc_h + 1]
    return hidden, path, [tok_host[s] for s in path[1:]] + [bonus_h], depth


def _keep_path(cache, L: int, path: list[int], device) -> None:
    """Keep only the accepted path's KV: move slots L + path to L .. L + n - 1 on every layer and drop the rest."""
    sel = torch.tensor([L + s for s in path], device=device)
    n = len(path)
    for layer in cache.layers:
        for name in ("keys", "values"):
            x = getattr(layer, name)
            x[:, :, L: L + n] = x.index_select(2, sel)
            setattr(layer, name, x[:, :, : L + n])


# ----------------------------------------------------------------------------------------------- loops
def _prefill(m: TorchModels, ids: list[int], cache):
    prompt = torch.tensor([ids], device=m.device)
    out = m.model.model(input_ids=prompt, use_cache=True, **{m.cache_kw: cache})
    hidden = out.last_hidden_state  # [1, P, D]
    first = m.model.lm_head(hidden[:, -1]).argmax(-1)  # [1]
    return prompt, hidden, first


def _run_vanilla(m: TorchModels, plan, ids, out: _Output, counter, clock, hist):
    cache = transformers.DynamicCache(config=m.model.config)
    _, _, tok = _prefill(m, ids, cache)
    out.emit([int(tok)])  # the prefill's token (read before decoding starts: not counted)
    _finish(m.device)
    t0 = time.perf_counter()
    while not out.done and len(hist["acc"]) < plan.max_new_tokens:
        clock.start()
        logits = m.model(input_ids=tok.reshape(1, 1), use_cache=True, **{m.cache_kw: cache}).logits
        tok = logits[0, -1].argmax(-1)
        t = counter.item(tok, "verify")
        clock.lap("verify")
        hist["acc"].append(out.emit([t]))
    _finish(m.device)
    return t0


def _run_spec(m: TorchModels, plan, ids, out: _Output, counter, clock, hist, threshold: float):
    cache = transformers.DynamicCache(config=m.model.config)
    prompt, hidden, root = _prefill(m, ids, cache)
    # the head's prefix: pairs (x_{i+1}, f_i) at positions i < P - 1; the last pair is step 0's of the first cycle
    P = len(ids)
    prefix_kv = None
    if P > 1:
        _, prefix_kv = m.head.step(hidden[:, :-1], prompt[:, 1:], torch.arange(P - 1, device=m.device)[None])
    pend_tok, pend_feat = root.reshape(1, 1), hidden[:, -1:]
    out.emit([int(root)])  # the prefill's token (read before decoding starts: not counted)
    root = root[0]
    _finish(m.device)
    t0 = time.perf_counter()
    while not out.done and len(hist["acc"]) < plan.max_new_tokens:
        clock.start()
        d = _draft(m, plan, prefix_kv, pend_tok, pend_feat, counter, threshold)
        clock.lap("draft")
        L = cache.get_seq_length()
        hidden, path, emitted, depth = _verify(m, plan, cache, root, d, counter)
        clock.lap("verify")
        _keep_path(cache, L, path, m.device)
        prefix_kv = d.prefix_kv  # the beams' scratch K/V are dropped (EAGLE's stable_kv)
        pend_tok = torch.tensor([emitted], device=m.device)
        pend_feat = hidden[torch.tensor(path, device=m.device)][None]
        root = pend_tok[0, -1]
        hist["acc"].append(out.emit(emitted))
        hist["depth"].append(depth)
        clock.lap("commit")
    _finish(m.device)
    return t0


def generate(models: TorchModels, prompt_ids, max_new_tokens: int = 128, method: str = "vanilla",
             sync: str = "device", tree: TreeConfig | None = None, ddd: DDDConfig | None = None,
             profile: bool = False) -> GenerateResult:
    """Greedy decoding of one prompt (list[int]) in PyTorch: method "vanilla" | "eagle2" | "ddd", DDD's
    sync "host" (`.item()` at each check) | "device" (`torch.where`, remaining steps masked).

    Returns a `GenerateResult` whose stats use ddd_jax.generate's names: new_tokens, target_calls, draft_steps,
    accepted_per_call, mean_accepted, depth_per_call, mean_depth, ddd_checks, draft_syncs, host_syncs (plus
    verify_syncs), prefill_s, decode_s, tokens_per_s, draft_s, verify_s, commit_s."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method == "ddd" and sync not in SYNCS:
        raise ValueError(f"torch DDD has sync modes {SYNCS} (callback is JAX's io_callback), got {sync!r}")
    if method != "vanilla" and models.head is None:
        raise ValueError(f"method={method!r} needs a draft head: load_torch(target, draft)")
    tree, ddd = tree or TreeConfig(), ddd or DDDConfig()
    if method == "ddd" and ddd.rule != "threshold":
        raise ValueError(f"the torch counterpart runs DDD's threshold rule; rule={ddd.rule!r} is JAX-only")
    if tree.lookup:
        raise ValueError(f"the torch counterpart drafts from the head alone: TreeConfig(lookup={tree.lookup}) "
                         "(context-lookup candidates) is JAX-only; pass lookup=0")
    target = models.target
    plan = make_plan(target, models.draft if method != "vanilla" else None, method=method,
                     sync=sync if method == "ddd" else "device", tree=tree, ddd=ddd, temperature=0.0, top_p=1.0,
                     max_new_tokens=max_new_tokens)
    if len(prompt_ids) == 0 or isinstance(prompt_ids[0], (list, tuple, np.ndarray)):
        raise ValueError("the torch decoding takes one non-empty prompt (list[int]); batches are JAX-only")
    ids = [int(t) for t in prompt_ids]
    V = target.config.vocab_size
    if any(not 0 <= t < V for t in ids):
        raise ValueError(f"prompt token ids must lie in [0, {V})")
    if len(ids) + max_new_tokens + plan.M > target.config.max_position_embeddings:
        raise ValueError(f"prompt of {len(ids)} tokens + max_new_tokens={max_new_tokens} exceeds the model's "
                         f"max_position_embeddings={target.config.max_position_embeddings}")
    counter, clock = SyncCounter(), _PhaseClock(models.device, profile)
    out = _Output(plan.eos, max_new_tokens)
    hist = {"acc": [], "depth": []}
    threshold = float(np.float32(ddd.threshold))  # compared in float32, as JAX does
    t_start = time.perf_counter()
    with torch.inference_mode():
        if method == "vanilla":
            t0 = _run_vanilla(models, plan, ids, out, counter, clock, hist)
        else:
            t0 = _run_spec(models, plan, ids, out, counter, clock, hist, threshold)
    t1 = time.perf_counter()
    calls = [i for i, a in enumerate(hist["acc"]) if a > 0]
    acc = [hist["acc"][i] for i in calls]
    dep = [hist["depth"][i] for i in calls] if method != "vanilla" else []
    checks = sum(sum(1 for c in plan.check_steps if c <= x) for x in dep) if method == "ddd" else 0
    n_new, decode_s = len(out.tokens), t1 - t0
    stats = {
        "framework": "torch", "method": method, "sync": sync if method == "ddd" else None,
        "new_tokens": n_new, "target_calls": len(acc), "draft_steps": int(sum(x + 1 for x in dep)),
        "accepted_per_call": acc, "mean_accepted": float(np.mean(acc)) if acc else 0.0,
        "depth_per_call": dep, "mean_depth": float(np.mean(dep)) if dep else 0.0,
        "ddd_checks": checks, "draft_syncs": counter.by_phase["draft"], "verify_syncs": counter.by_phase["verify"],
        "host_syncs": counter.total, "prefill_s": t0 - t_start, "decode_s": decode_s, "total_s": t1 - t_start,
        "tokens_per_s": (n_new - 1) / decode_s if decode_s > 0 and n_new > 1 else 0.0, **clock.times,
    }
    return GenerateResult(tokens=out.tokens, text=target.decode(out.tokens), stats=stats)
