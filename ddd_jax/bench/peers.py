"""`ddd-jax peers`: vanilla ddd-jax beside the decoders a user would otherwise pick for the same model.

Every speed-up of the target forward helps vanilla decoding too, so a speculative speed-up means little without the
plain decoders a user could run instead. On the same prompts, interleaved per prompt after one warm-up, greedy:

* ``ddd-jax``           -- ``generate(method="vanilla")`` (this library's plain decoding);
* ``ddd-jax-ddd``       -- ``generate(method="ddd", sync="device")`` with the backend's tuned settings and the head;
* ``ddd-jax-blocks``, ``ddd-jax-blocks-ddd`` -- the same two on the target loaded with ``gguf_blocks=True`` (its
                           Q4_1 / Q8_0 / Q4_0 matrices kept as blocks: the same float32 values, ~1/6 of the bytes);
* ``ddd-jax-int8``, ``ddd-jax-int8-ddd`` -- the same two on the target loaded with ``gguf_blocks="int8"`` (the
                           blocks multiplied by integer products over int8 activations, llama.cpp's arithmetic: its
                           own tokens, which the two share);
* ``transformers``      -- ``LlamaForCausalLM.generate(do_sample=False)`` in eager PyTorch, float32, on the very
                           weights ddd-jax holds (``torch_decoding.torch_target``);
* ``transformers-pld``  -- the same with assisted decoding by prompt lookup (``prompt_lookup_num_tokens``);
* ``llama.cpp``         -- ``llama-cpp-python`` on the GGUF file the default target is read from (its own Q4_1
                           kernels and quantised activations: its tokens may differ from ours at near-ties);
* ``llama.cpp-fa``      -- the same with flash attention (``flash_attn=True``; llama-cpp-python's default is off).

``no_repack=True`` (``ddd-jax peers --llama-cpp-no-repack``) loads the GGUF without llama.cpp's extra CPU buffer
types (its weight repacking, AMX included), as llama.cpp's own ``--no-repack`` does: on a host where a repacked
path crashes (llama-cpp-python 0.3.36 segfaults there on a 2-core AVX-512/AMX Xeon VM when it evaluates more than
one token) it is the way to run llama.cpp at all.

Speed is decode speed, as ``ddd-jax bench`` measures it: new tokens after the first (which the prefill gives),
divided by the time from the first new token to the last. For transformers and llama.cpp the first token's time
is taken from a streamer / the token generator, so prefill is excluded the same way. Threads: every framework
uses all cores of the process's CPU affinity.

llama.cpp is optional (``pip install llama-cpp-python``: it builds from source, ~8 minutes on 2 cores); torch and
transformers come with the ``[torch]`` extra. A peer whose package is missing is skipped with a line saying what to
install -- unless it was asked for by name, then it is an error.
"""
from __future__ import annotations

import os
import time

import numpy as np

PEERS = ("ddd-jax", "ddd-jax-ddd", "ddd-jax-blocks", "ddd-jax-blocks-ddd", "ddd-jax-int8", "ddd-jax-int8-ddd",
         "transformers", "transformers-pld", "llama.cpp", "llama.cpp-fa")
LLAMA_CPP_PEERS = ("llama.cpp", "llama.cpp-fa")
BLOCK_PEERS = ("ddd-jax-blocks", "ddd-jax-blocks-ddd")
INT8_PEERS = ("ddd-jax-int8", "ddd-jax-int8-ddd")
SPEC_PEERS = ("ddd-jax-ddd", "ddd-jax-blocks-ddd", "ddd-jax-int8-ddd")
# the peers over another load of the target: (vanilla, DDD) -> load_target's gguf_blocks
LOADS = {BLOCK_PEERS: True, INT8_PEERS: "int8"}
REFERENCE = "ddd-jax"


def _threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# ----------------------------------------------------------------------------------------------- runners
# A runner maps (prompt ids, max_new_tokens) -> (new tokens, decode seconds after the first new token).
def jax_runner(target, draft, method: str, capacity: int, tree=None, ddd=None):
    """tree / ddd: None = what `generate` picks (the backend's tuned settings for this pair, else the paper's)."""
    from ddd_jax import generate

    kw = dict(method="vanilla") if method == "vanilla" else dict(method="ddd", sync="device", tree=tree, ddd=ddd)

    def run(ids, max_new):
        r = generate(target, draft if method != "vanilla" else None, ids, max_new_tokens=max_new, capacity=capacity,
                     **kw)
        return list(r.tokens), r.stats["decode_s"], r.stats.get("settings")
    return run


def torch_runner(target, prompt_lookup: int = 0):
    import torch
    import transformers

    from ddd_jax.bench.torch_decoding import torch_target

    torch.set_num_threads(_threads())
    model = torch_target(target)
    eos = list(target.eos_token_ids)

    class _Clock(transformers.generation.streamers.BaseStreamer):  # put(prompt), then put(new tokens) per step
        def __init__(self):
            self.calls, self.first = 0, None

        def put(self, value):
            self.calls += 1
            if self.calls == 2:
                self.first = time.perf_counter()

        def end(self):
            pass

    def run(ids, max_new):
        x = torch.tensor([ids], dtype=torch.long)
        clock = _Clock()
        extra = dict(prompt_lookup_num_tokens=prompt_lookup) if prompt_lookup else {}
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos[0], streamer=clock, **extra)
        t1 = time.perf_counter()
        new = out[0, len(ids):].tolist()
        return new, (t1 - clock.first) if clock.first is not None else 0.0, (
            {"prompt_lookup_num_tokens": prompt_lookup} if prompt_lookup else None)
    return run


def llama_cpp_runner(gguf_path, capacity: int, eos=(), flash_attn: bool = False, no_repack: bool = False):
    """eos: stop tokens besides the GGUF's own (pass the target's, so every peer stops where ddd-jax does).
    no_repack: load without llama.cpp's extra CPU buffer types (its `--no-repack`)."""
    try:
        import llama_cpp
        import llama_cpp.llama as llama_py
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError("the llama.cpp peer needs llama-cpp-python: pip install llama-cpp-python "
                                  "(builds from source; ~8 minutes on 2 cores)", name=e.name) from e
    kw = dict(model_path=str(gguf_path), n_ctx=capacity, n_threads=_threads(), n_threads_batch=_threads(),
              n_batch=512, flash_attn=flash_attn, verbose=False)
    if no_repack:
        # llama-cpp-python builds its model params from llama_model_default_params() and exposes no argument for
        # use_extra_bufts: hand it defaults with the field off for the length of this one construction.
        defaults = llama_py.llama_cpp.llama_model_default_params
        if "use_extra_bufts" not in dict(defaults()._fields_):
            raise ValueError(f"llama-cpp-python {llama_cpp.__version__} has no use_extra_bufts model parameter: "
                             "--llama-cpp-no-repack needs a newer one")

        def no_extra():
            p = defaults()
            p.use_extra_bufts = False
            return p
        llama_py.llama_cpp.llama_model_default_params = no_extra
        try:
            llm = llama_cpp.Llama(**kw)
        finally:
            llama_py.llama_cpp.llama_model_default_params = defaults
    else:
        llm = llama_cpp.Llama(**kw)
    eos = set(eos) | {llm.token_eos()}

    def run(ids, max_new):
        new, first = [], None
        for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            if first is None:
                first = time.perf_counter()
            new.append(int(tok))
            if tok in eos or len(new) >= max_new:
                break
        t1 = time.perf_counter()
        return new, (t1 - first) if first is not None else 0.0, {"version": llama_cpp.__version__,
                                                                "flash_attn": flash_attn, "no_repack": no_repack,
                                                                "system_info": llama_cpp.llama_print_system_info().decode()}
    return run


def required_capacity(target, draft, prompt_lengths, max_new_tokens: int, tree=None, ddd=None) -> int:
    """The smallest cache / context every ddd-jax peer fits in (generate's own formula; the others need less)."""
    from ddd_jax import settings
    from ddd_jax.decode import cache_capacity, make_plan
    from ddd_jax.config import DDDConfig, TreeConfig

    P = max(prompt_lengths)
    kw = dict(temperature=0.0, top_p=1.0, max_new_tokens=max_new_tokens)
    need = cache_capacity(P, make_plan(target, None, method="vanilla", sync="device", tree=TreeConfig(),
                                       ddd=DDDConfig(), **kw))
    if draft is not None:
        tree, ddd, _ = settings.resolve(target, draft, tree, ddd)
        need = max(need, cache_capacity(P, make_plan(target, draft, method="ddd", sync="device", tree=tree, ddd=ddd,
                                                     **kw)))
    return need


def build_runners(target, draft, peers, capacity: int, gguf_path=None, prompt_lookup: int = 10,
                  required=(), tree=None, ddd=None, blocks_target=None, int8_target=None,
                  llama_cpp_no_repack: bool = False) -> tuple[dict, dict]:
    """({peer: runner}, {peer: why skipped}). A peer in `required` that cannot be built raises. blocks_target /
    int8_target: the target loaded with gguf_blocks=True / "int8" (the ddd-jax-blocks / ddd-jax-int8 peers; the
    head is bound to it). llama_cpp_no_repack: the llama.cpp peers load without llama.cpp's extra buffer types (see
    the module doc)."""
    import dataclasses
    runners, skipped = {}, {}
    loaded = {BLOCK_PEERS: blocks_target, INT8_PEERS: int8_target}
    for p in peers:
        try:
            if p in SPEC_PEERS and draft is None:
                raise ValueError(f"{p} needs a draft head")
            pair = next((pair for pair in LOADS if p in pair), None)
            if pair is not None and loaded[pair] is None:
                why = f"{p} needs the target loaded with gguf_blocks={LOADS[pair]!r} (a GGUF-backed target)"
                if p in required:
                    raise ValueError(why)
                skipped[p] = why
                continue
            if p == "ddd-jax":
                runners[p] = jax_runner(target, None, "vanilla", capacity)
            elif p == "ddd-jax-ddd":
                runners[p] = jax_runner(target, draft, "ddd", capacity, tree, ddd)
            elif pair is not None and p == pair[0]:
                runners[p] = jax_runner(loaded[pair], None, "vanilla", capacity)
            elif pair is not None:
                runners[p] = jax_runner(loaded[pair], dataclasses.replace(draft, target=loaded[pair]), "ddd",
                                        capacity, tree, ddd)
            elif p == "transformers":
                runners[p] = torch_runner(target)
            elif p == "transformers-pld":
                runners[p] = torch_runner(target, prompt_lookup=prompt_lookup)
            elif p in LLAMA_CPP_PEERS:
                if gguf_path is None:
                    raise ValueError(f"{p} needs the target's GGUF file (--gguf, or the default target)")
                runners[p] = llama_cpp_runner(gguf_path, capacity, eos=target.eos_token_ids,
                                              flash_attn=p == "llama.cpp-fa", no_repack=llama_cpp_no_repack)
            else:
                raise ValueError(f"unknown peer {p!r}; known: {', '.join(PEERS)}")
        except (ModuleNotFoundError, ValueError) as e:
            if p in required or isinstance(e, ValueError):
                raise
            skipped[p] = str(e)
    return runners, skipped


# ----------------------------------------------------------------------------------------------- the run
def _common_prefix(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def run_peers(runners: dict, prompt_ids: list, max_new_tokens: int, progress: bool = True) -> dict:
    """Interleaved per prompt (peers in turn), one warm-up call each on the first prompt. Returns the summary."""
    from .run import progress_bar

    names = list(runners)
    for name in names:  # compile / allocate
        runners[name](prompt_ids[0], max_new_tokens)
    toks = {n: [] for n in names}
    secs = {n: [] for n in names}
    info = {}
    bar = progress_bar(len(prompt_ids) * len(names), progress, "peers")
    try:
        for ids in prompt_ids:
            for name in names:
                new, sec, extra = runners[name](ids, max_new_tokens)
                toks[name].append(new)
                secs[name].append(sec)
                info[name] = extra
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    ref = toks.get(REFERENCE)
    out = {}
    for name in names:
        dec = sum(max(len(t) - 1, 0) for t in toks[name])
        s = sum(secs[name])
        row = {"prompts": len(prompt_ids), "new_tokens": sum(len(t) for t in toks[name]), "decode_tokens": dec,
               "decode_s": s, "tokens_per_s": dec / s if s > 0 else 0.0, "settings": info.get(name)}
        if ref is not None:
            same = sum(a == b for a, b in zip(toks[name], ref))
            pref = [_common_prefix(a, b) / max(len(b), 1) for a, b in zip(toks[name], ref)]
            row.update(identical_to_ddd_jax=same, mean_common_prefix=float(np.mean(pref)))
        out[name] = row
    if REFERENCE in out and out[REFERENCE]["tokens_per_s"] > 0:
        for row in out.values():
            row["vs_ddd_jax"] = row["tokens_per_s"] / out[REFERENCE]["tokens_per_s"]
    return {"peers": out, "tokens": toks}


def peers_table(result: dict) -> str:
    from .report import cell, markdown_table
    rows = []
    for name, r in result["peers"].items():
        rows.append([name, cell(r["tokens_per_s"], "{:.1f}"), cell(r.get("vs_ddd_jax"), "{:.2f}x"),
                     f"{r.get('identical_to_ddd_jax', '-')}/{r['prompts']}",
                     cell(r.get("mean_common_prefix"), "{:.2f}")])
    return markdown_table(["decoder", "tok/s", "vs ddd-jax vanilla", "identical to ddd-jax", "mean common prefix"],
                          rows)
