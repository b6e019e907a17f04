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
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from ddd_jax import io as dio


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


def regenerate(target, prompts: list, out_path, *, max_new_tokens: int = 256, batch_size: int = 16,
               time_limit_s: float | None = None, max_records: int | None = None, min_batches: int = 0,
               progress: bool = True) -> dict:
    """Append the target's greedy replies to `prompts` ((id, token ids) pairs) to `out_path`, skipping ids there.

    Batches are formed from prompts of similar length (sorted within windows of 8 batches) so the batched
    prefill pads little; every batch has `batch_size` rows (a short last one is padded), so decoding compiles
    once per prompt bucket. Stops at the first batch boundary after `time_limit_s` (but not before `min_batches`
    batches of this call), or once the file holds `max_records` records. Returns a summary.
    """
    from ddd_jax import generate
    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError(f"batch_size and max_new_tokens must be >= 1, got {batch_size}, {max_new_tokens}")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done = {r["id"] for r in _read_records(out_path, repair=True)}
    todo = [(i, ids) for i, ids in prompts if i not in done]
    if max_records is not None:
        todo = todo[:max(0, max_records - len(done))]
    window = batch_size * 8
    batches = []
    for w in range(0, len(todo), window):
        chunk = sorted(todo[w:w + window], key=lambda x: len(x[1]))
        batches += [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
    stops = set(target.eos_token_ids)
    t0 = time.time()
    n_new = n_tok = 0
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(todo), desc="regenerate", unit="conv", initial=0)
    with open(out_path, "a", encoding="utf-8") as f:
        for b, batch in enumerate(batches):
            if time_limit_s is not None and b >= min_batches and time.time() - t0 > time_limit_s:
                break
            # a short last batch is padded with copies of its last prompt (results dropped): one batch shape
            prompts_b = [ids for _, ids in batch] + [batch[-1][1]] * (batch_size - len(batch))
            res = generate(target, None, prompts_b, max_new_tokens=max_new_tokens)
            lines = []
            for (conv_id, ids), toks in zip(batch, res.tokens):
                finished = bool(toks) and toks[-1] in stops
                lines.append(json.dumps({"id": conv_id, "prompt_len": len(ids), "ids": list(ids) + list(toks),
                                         "finished": finished}) + "\n")
                n_tok += len(toks)
            f.write("".join(lines))
            f.flush()
            os.fsync(f.fileno())
            n_new += len(batch)
            if bar is not None:
                bar.update(len(batch))
                bar.set_postfix(gen_tok_s=f"{n_tok / max(time.time() - t0, 1e-9):.0f}")
    if bar is not None:
        bar.close()
    return {"out": str(out_path), "records": len(done) + n_new, "new_records": n_new, "new_reply_tokens": n_tok,
            "remaining": len(todo) - n_new,
            "seconds": round(time.time() - t0, 1)}
