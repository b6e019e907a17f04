"""Self-distillation data: the target's own greedy replies to ShareGPT prompts, as training examples for a head.

A head is used on the target's own output (greedy speculative decoding is lossless, so the tokens it must guess
are exactly the target's greedy continuation), while ShareGPT's replies were written by another model. EAGLE
trains on ShareGPT's fixed replies; regenerating them with the target (as Medusa-2 and HASS do) moves the
training distribution to the test one. `regenerate` decodes the first user turn of each conversation with
`ddd_jax.generate(method="vanilla")` (batched, greedy) and appends one JSON line per conversation::

    {"id": str, "prompt_len": int, "ids": [int, ...], "finished": bool}

``ids`` = chat-rendered prompt (system prompt included, generation prompt appended) + the generated reply (with
the stop token when the reply ended before `max_new_tokens`: ``finished``). The loss counts the reply only
(`example_from_record`). The file is appended batch by batch and flushed; a rerun with the same file skips
conversations already there (a torn last line from an interrupted run is dropped first), so generation resumes.

Every batch of a call runs the same decoding programs: a fixed number of rows, its prompts padded to one of a few
prompt buckets, and one KV-cache capacity for the whole call (`regen_plan` picks them, and passes the same ones to
several calls -- a held-out part and a training part -- so the second call compiles nothing). `CompileCounter`
counts the XLA compiles a call did.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import numpy as np
from jax import monitoring

from ddd_jax import io as dio

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax/_src/dispatch.py BACKEND_COMPILE_EVENT
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"  # jax/_src/compiler.py: a persistent-cache load
_counting: list = []  # the CompileCounters now active (one pair of jax listeners, registered once, feeds them)


def _on_duration(event: str, seconds: float, **_) -> None:
    if event == _COMPILE_EVENT:
        for c in _counting:
            if c.thread == threading.get_ident():
                c.built += 1
                c.seconds += seconds


def _on_event(event: str, **_) -> None:
    if event == _CACHE_HIT_EVENT:
        for c in _counting:
            if c.thread == threading.get_ident():
                c.cache_hits += 1


class CompileCounter:
    """Counts the XLA executables jax builds while active: `with CompileCounter() as cc: ...; cc.compiles`.

    `built`: executables jax had to make (its backend-compile event: a jit, or an eager op, on shapes, dtypes or
    static arguments it had not seen in this process); `cache_hits`: those of them loaded from jax's persistent
    compilation cache instead of compiled; `compiles` = built - cache_hits, the real XLA compiles; `seconds`: the
    time spent building all of them. Programs already in jax's in-memory caches count nothing. Only the thread that
    entered the counter is counted (jax builds a program on the thread that calls it): the recipe compiles the
    fit's programs on another thread meanwhile (`eagle3_fit.compile_ahead`).
    """

    _listening = False

    def __enter__(self) -> "CompileCounter":
        if not CompileCounter._listening:
            monitoring.register_event_duration_secs_listener(_on_duration)
            monitoring.register_event_listener(_on_event)
            CompileCounter._listening = True
        self.built, self.cache_hits, self.seconds = 0, 0, 0.0
        self.thread = threading.get_ident()
        _counting.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _counting.remove(self)

    @property
    def compiles(self) -> int:
        return self.built - self.cache_hits


def _read_records(path: Path, repair: bool = False) -> list[dict]:
    """Complete records of a regeneration file; a torn last line (interrupted write) is skipped, and removed from
    the file with `repair` (before appending to it)."""
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    recs, good = [], []
    for k, line in enumerate(lines):
        try:
            if not line.endswith("\n"):
                raise ValueError("torn line")
            recs.append(json.loads(line))
            good.append(line)
        except ValueError:
            if k != len(lines) - 1:
                raise ValueError(f"{path}: line {k + 1} is not a JSON record (only the last line may be torn)")
            if repair:
                dio.atomic_write_text(path, "".join(good))
    return recs


def load_records(path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no regenerated data at {path} (make it with `ddd-jax train-draft regenerate`)")
    recs = _read_records(path)
    for r in recs:
        if not {"id", "prompt_len", "ids"} <= r.keys() or not 0 < r["prompt_len"] <= len(r["ids"]):
            raise ValueError(f"{path}: malformed record {str(r)[:120]}")
    return recs


def example_from_record(rec: dict, max_len: int) -> dict | None:
    """`{"id","ids","mask"}` for `extract`: the loss counts the generated reply (mask 1 from prompt_len on)."""
    ids = np.asarray(rec["ids"], np.int32)[:max_len]
    mask = np.zeros(len(ids), np.uint8)
    mask[rec["prompt_len"]:] = 1
    if len(ids) < 2 or mask[1:].sum() == 0:
        return None
    return {"id": rec["id"], "ids": ids, "mask": mask}


def first_turn_prompts(target, items: list, max_prompt_len: int) -> tuple[list, int]:
    """[(id, chat-rendered first user turn + generation prompt)] of `items` ((id, messages) pairs), and how many
    were skipped for exceeding `max_prompt_len` tokens."""
    out, skipped = [], 0
    for conv_id, msgs in items:
        if not msgs or msgs[0]["role"] != "user":
            continue
        ids = target.encode_chat(msgs[:1], add_generation_prompt=True)
        if len(ids) > max_prompt_len:
            skipped += 1
            continue
        out.append((conv_id, list(ids)))
    return out, skipped


def later_turn_prompts(target, items: list, max_prompt_len: int) -> tuple[list, int]:
    """[(id + "#" + k, the conversation up to its k-th user turn, chat-rendered + generation prompt)] for every user
    turn k >= 2 of `items` ((id, messages) pairs) that renders to at most `max_prompt_len` tokens, and how many were
    skipped for exceeding it. The earlier replies in the context are the conversation's own (ShareGPT's)."""
    out, skipped = [], 0
    for conv_id, msgs in items:
        users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
        for k, i in enumerate(users[1:], start=2):
            ids = target.encode_chat(msgs[:i + 1], add_generation_prompt=True)
            if len(ids) > max_prompt_len:  # a longer context holds every later turn: none of them fits either
                skipped += len(users) - k + 1
                break
            out.append((f"{conv_id}#{k}", list(ids)))
    return out, skipped


def choose_buckets(lengths, max_buckets: int = 3) -> tuple:
    """At most `max_buckets` padded prompt lengths covering `lengths`: values of `bucket_length` (the decoder's
    standard prompt buckets), the largest the longest prompt's, chosen to pad the prompts' sum of lengths least
    (each prompt padded to the smallest chosen bucket that holds it)."""
    from ddd_jax.decode.state import bucket_length
    if max_buckets < 1:
        raise ValueError(f"max_buckets must be >= 1, got {max_buckets}")
    lengths = [int(n) for n in lengths]
    if not lengths:
        return (bucket_length(1),)
    vals, counts = np.unique([bucket_length(n) for n in lengths], return_counts=True)
    vals, below = [int(v) for v in vals], [0] + np.cumsum(counts).tolist()  # below[j]: prompts under vals[j]

    def padded(i: int, j: int) -> int:  # the prompts of vals[i + 1] .. vals[j], padded to vals[j]
        return vals[j] * (below[j + 1] - below[i + 1])

    # best[j]: (padded tokens, buckets) for the prompts up to vals[j], vals[j] the largest bucket; each round
    # allows one more bucket (on a tie, the fewer buckets)
    best = [(padded(-1, j), (vals[j],)) for j in range(len(vals))]
    for _ in range(max_buckets - 1):
        best = [min([best[j]] + [(best[i][0] + padded(i, j), best[i][1] + (vals[j],)) for i in range(j)],
                    key=lambda r: r[0]) for j in range(len(vals))]
    return best[-1][1]


def regen_plan(target, prompt_lists: list, batch_size: int, max_new_tokens: int, max_buckets: int = 3) -> dict:
    """One set of decoding shapes for several `regenerate` calls (e.g. a held-out part, then a training part):
    `{"batch_size": rows, "buckets": (padded prompt lengths), "capacity": KV-cache slots}`, to pass as keywords
    (`regenerate(target, part, out, max_new_tokens=max_new_tokens, **plan)`) so every call runs the programs the
    first one compiled. rows: `batch_size`, or the longest list's length when every list is shorter; buckets:
    `choose_buckets` of all the prompts' lengths; capacity: the largest bucket's `cache_capacity`."""
    from ddd_jax.decode.state import cache_capacity, vanilla_plan
    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError(f"batch_size and max_new_tokens must be >= 1, got {batch_size}, {max_new_tokens}")
    buckets = choose_buckets([len(ids) for prompts in prompt_lists for _, ids in prompts], max_buckets)
    rows = min(batch_size, max([len(prompts) for prompts in prompt_lists] + [1]))
    return {"batch_size": rows, "buckets": buckets,
            "capacity": cache_capacity(buckets[-1], vanilla_plan(target, max_new_tokens))}


def compile_plan(target, plan: dict, max_new_tokens: int) -> dict:
    """Start building a `regen_plan`'s programs on background threads, one for each prompt bucket's prefill and one
    for the decoding loop, all at once: {bucket or "loop": Future of the seconds it took}. `regenerate(warm=...)`
    waits only for the programs its next batch runs. On the second H200 run the plan's programs were built one
    after another as batches first met them: 98 s of a 186 s stage."""
    from concurrent.futures import ThreadPoolExecutor

    from ddd_jax.decode import compile_vanilla

    def build(prompt_len: int, parts) -> float:
        t0 = time.time()
        compile_vanilla(target, plan["batch_size"], prompt_len, plan["capacity"], max_new_tokens, parts=parts)
        return round(time.time() - t0, 1)

    buckets = list(plan["buckets"])
    pool = ThreadPoolExecutor(len(buckets) + 1, thread_name_prefix="regen-compile")
    jobs = {"loop": pool.submit(build, buckets[0], ("loop",))}
    jobs.update({b: pool.submit(build, b, ("prefill",)) for b in buckets})
    pool.shutdown(wait=False)
    return jobs


def _wait(warm: dict | None, keys) -> float:
    """Wait for `compile_plan`'s programs named by `keys`; seconds waited (a failed build is left to `generate`)."""
    t0 = time.time()
    for k in keys:
        if warm and k in warm:
            try:
                warm[k].result()
            except Exception:  # noqa: BLE001 -- generate compiles the program itself
                pass
    return time.time() - t0


def _shapes(target, prompts: list, max_new_tokens: int, buckets, capacity, max_buckets: int) -> tuple:
    """(buckets, capacity) of a `regenerate` call, checked: every prompt fits the largest bucket, and the cache
    holds it and `max_new_tokens`."""
    from ddd_jax.decode.state import cache_capacity, cache_slack, vanilla_plan
    buckets = tuple(int(b) for b in (choose_buckets([len(ids) for _, ids in prompts], max_buckets)
                                     if buckets is None else buckets))
    if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
        raise ValueError(f"buckets must be ascending positive lengths, got {buckets}")
    too_long = [i for i, ids in prompts if len(ids) > buckets[-1]]
    if too_long:
        raise ValueError(f"{len(too_long)} prompts (e.g. {too_long[0]!r}) are longer than the largest bucket, "
                         f"{buckets[-1]} tokens")
    vplan = vanilla_plan(target, max_new_tokens)
    need = buckets[-1] + max_new_tokens + cache_slack(vplan)
    if capacity is None:
        capacity = cache_capacity(buckets[-1], vplan)
    elif capacity < need:
        raise ValueError(f"capacity={capacity} is under the {need} slots a {buckets[-1]}-token bucket + "
                         f"max_new_tokens={max_new_tokens} needs")
    return buckets, capacity


def _batches(todo: list, batch_size: int) -> list:
    """`todo` in batches of `batch_size`, prompts of similar length together (sorted within windows of 8 batches)."""
    window, batches = batch_size * 8, []
    for w in range(0, len(todo), window):
        chunk = sorted(todo[w:w + window], key=lambda x: len(x[1]))
        batches += [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
    return batches


def _decode_batches(target, batches: list, f, *, max_new_tokens: int, batch_size: int, buckets: tuple,
                    capacity: int, warm, ends, bar, t0: float, cc: CompileCounter) -> dict:
    """Decode `batches` one by one, appending each one's records to the open file `f` (flushed and synced), until
    `ends(b, done)` says so before batch b; {"new_records", "new_reply_tokens", "new_ids", "warm_wait_s"}."""
    from ddd_jax import generate
    stops = set(target.eos_token_ids)
    done = {"new_records": 0, "new_reply_tokens": 0, "new_ids": 0, "warm_wait_s": 0.0}
    for b, batch in enumerate(batches):
        if ends(b, done):
            break
        # a short last batch is padded with copies of its last prompt (results dropped): one batch shape
        prompts_b = [ids for _, ids in batch] + [batch[-1][1]] * (batch_size - len(batch))
        bucket = next(n for n in buckets if n >= max(len(ids) for _, ids in batch))
        done["warm_wait_s"] += _wait(warm, ("loop", bucket))
        res = generate(target, None, prompts_b, max_new_tokens=max_new_tokens, capacity=capacity, prompt_len=bucket)
        lines = []
        for (conv_id, ids), toks in zip(batch, res.tokens):
            finished = bool(toks) and toks[-1] in stops
            lines.append(json.dumps({"id": conv_id, "prompt_len": len(ids), "ids": list(ids) + list(toks),
                                     "finished": finished}) + "\n")
            done["new_reply_tokens"] += len(toks)
            done["new_ids"] += len(ids) + len(toks)
        f.write("".join(lines))
        f.flush()
        os.fsync(f.fileno())
        done["new_records"] += len(batch)
        if bar is not None:
            bar.update(len(batch))
            bar.set_postfix(gen_tok_s=f"{done['new_reply_tokens'] / max(time.time() - t0, 1e-9):.0f}",
                            compiles=cc.compiles)
    return done


def regenerate(target, prompts: list, out_path, *, max_new_tokens: int = 256, batch_size: int = 16,
               time_limit_s: float | None = None, max_records: int | None = None, min_batches: int = 0,
               progress: bool = True, buckets=None, capacity: int | None = None, max_buckets: int = 3,
               warm: dict | None = None, stop=None) -> dict:
    """Append the target's greedy replies to `prompts` ((id, token ids) pairs) to `out_path`, skipping ids there.

    Batches are formed from prompts of similar length (sorted within windows of 8 batches); every batch has
    `batch_size` rows (a short last one is padded with copies of its last prompt), its prompts padded to the
    smallest of `buckets` that holds its longest, and one KV cache of `capacity` slots serves the whole call: the
    call compiles one prefill per bucket and one decoding loop, whatever the mix of prompts, and a later call with
    the same batch_size, buckets and capacity (`regen_plan`) compiles nothing; warm: `compile_plan`'s futures for
    that plan (built on other threads; each batch waits for its own programs only). buckets: ascending padded prompt
    lengths, None = `choose_buckets` of the prompts' lengths (at most `max_buckets`); capacity: None = the largest
    bucket's `cache_capacity`. Stops at the first batch boundary after `time_limit_s`, or where `stop(done)`
    returns true (done: {"new_records", "new_reply_tokens", "new_ids" (prompt and reply tokens), "seconds"} of
    this call so far) -- but not before `min_batches` batches of this call --, or once the file holds
    `max_records` records.

    Returns a summary: out, records (in the file), new_records, new_reply_tokens (stop tokens included),
    remaining, seconds (the whole call), new_tokens_per_s (new_reply_tokens / seconds, compiles included),
    compiles (real XLA compiles during the call, on its thread: `CompileCounter`), programs (executables built,
    persistent-cache loads included: 0 when every program was already in memory), compile_s, warm_wait_s (time spent
    waiting for `warm`'s programs), rows, buckets, capacity.
    """
    t0 = time.time()
    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError(f"batch_size and max_new_tokens must be >= 1, got {batch_size}, {max_new_tokens}")
    buckets, capacity = _shapes(target, prompts, max_new_tokens, buckets, capacity, max_buckets)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    old = {r["id"] for r in _read_records(out_path, repair=True)}
    todo = [(i, ids) for i, ids in prompts if i not in old]
    if max_records is not None:
        todo = todo[:max(0, max_records - len(old))]

    def ends(b: int, done: dict) -> bool:  # before batch b
        if b < min_batches:
            return False
        return ((time_limit_s is not None and time.time() - t0 > time_limit_s)
                or (stop is not None and bool(stop({**done, "seconds": time.time() - t0}))))

    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(todo), desc="regenerate", unit="conv", initial=0)
    with open(out_path, "a", encoding="utf-8") as f, CompileCounter() as cc:
        done = _decode_batches(target, _batches(todo, batch_size), f, max_new_tokens=max_new_tokens,
                               batch_size=batch_size, buckets=buckets, capacity=capacity, warm=warm, ends=ends,
                               bar=bar, t0=t0, cc=cc)
    if bar is not None:
        bar.close()
    seconds, n_tok = time.time() - t0, done["new_reply_tokens"]
    return {"out": str(out_path), "records": len(old) + done["new_records"], "new_records": done["new_records"],
            "new_reply_tokens": n_tok, "remaining": len(todo) - done["new_records"], "seconds": round(seconds, 1),
            "new_tokens_per_s": round(n_tok / max(seconds, 1e-9), 1), "compiles": cc.compiles,
            "programs": cc.built, "compile_s": round(cc.seconds, 1), "warm_wait_s": round(done["warm_wait_s"], 1),
            "rows": batch_size, "buckets": list(buckets), "capacity": capacity}
