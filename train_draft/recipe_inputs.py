"""The recipe's inputs as token ids in one compressed .npz, for a machine without the asset packages or a network:
prompts to regenerate, held-out prompts, the MT-bench first turns, and text the EAGLE-3 fit can learn from as it is.

Parts (each a list of (key, ids); `text` also carries a loss mask per token):
    train     ShareGPT user turns to regenerate: the short first turns first, then the longer first turns and the
              later user turns with the conversation before them (keys "<id>#<k>")
    holdout   held-out first turns (ShareGPT's split by `data.is_holdout`)
    mtbench   the MT-bench first turns as `ddd-jax bench` renders them
    text      sequences the fit learns from directly, the loss on the replies (mask): first the replies earlier
              runs regenerated (`--prior-regen`, keys "regen:<id>"; the target's own text), then ShareGPT's own
              conversations, assistant turns counted (keys "sharegpt:<id>"), as many as `max_bytes` leaves room for

The EAGLE-3 fit labels every token with the target's own next-token distribution, computed in the fit, so any
text is training data. MT-bench never enters training: conversations repeating an MT-bench turn are dropped, and
held-out conversations stay out of `train` and `text`. Everything is rendered with the target's chat template.

File layout: for each part P, `P_ids` uint16, `P_offsets` int64 [n + 1], `P_keys` str [n]; `text_mask` holds the
text part's loss mask as bits (`np.packbits`, `P_ids`' length); `meta` is JSON.
"""
from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np

from ddd_jax import io as dio

INPUTS_FORMAT = "ddd-jax-recipe-inputs"
PROBE_TEXT = "Hello! Compose a haiku about speculative decoding, then explain it in two sentences."
PARTS = ("train", "holdout", "mtbench")  # prompts
TEXT = "text"  # sequences with loss masks


def prepare_inputs(target, *, max_prompt_len: int = 192, max_context_len: int = 512, holdout_percent: float = 2.0,
                   max_train: int = 0, seed: int = 0, sharegpt=None, questions=None, prior_regen=(),
                   sharegpt_text_tokens: int = 0, text_max_len: int = 1024, progress: bool = True) -> dict:
    """Token ids of the recipe's inputs: {"meta", "train", "holdout", "mtbench", "text"} (see the module).

    prior_regen: regenerated-reply files of earlier runs (`export_dir.load_regen`: regen.npz, .jsonl, .jsonl.gz);
    their training records go into `text` and their prompts leave `train` (greedy replies would repeat them).
    sharegpt_text_tokens: ShareGPT conversations (training split, `text_max_len` tokens at most each) added to
    `text` until this many tokens (0: none; `save_inputs(max_bytes=...)` trims them to a size)."""
    from ddd_jax.measure.prompts import build_prompt, load_questions

    from .data import is_holdout, load_sharegpt, shuffled
    from .regen import first_turn_prompts, later_turn_prompts
    if max_context_len and max_context_len < max_prompt_len:
        raise ValueError(f"max_context_len ({max_context_len}) must be 0 or at least max_prompt_len "
                         f"({max_prompt_len})")
    sg = load_sharegpt(sharegpt, holdout_percent=holdout_percent, exclude_mtbench=True)
    train_items = shuffled(sg.train, seed)
    if max_train:
        train_items = train_items[:max_train]
    say = (lambda msg: print(f"recipe inputs: {msg}", flush=True)) if progress else (lambda msg: None)
    say(f"tokenizing {len(train_items)} training and {len(sg.holdout)} held-out conversations")
    firsts, skipped_first = first_turn_prompts(target, train_items, max(max_prompt_len, max_context_len))
    short = [(k, ids) for k, ids in firsts if len(ids) <= max_prompt_len]
    long_first = [(k, ids) for k, ids in firsts if len(ids) > max_prompt_len]
    later, skipped_later = later_turn_prompts(target, train_items, max_context_len) if max_context_len else ([], 0)
    more = shuffled(long_first + later, seed + 1)
    holdout, skipped_hold = first_turn_prompts(target, shuffled(sg.holdout, seed), max_prompt_len)
    mtbench = [(str(q["id"]), build_prompt(target, q, 0, [])) for q in load_questions(questions)]

    text, prior_stats = _prior_text(target, prior_regen, holdout_percent, is_holdout)
    answered = {k.split(":", 1)[1] for k, _, _ in text}
    train = [(k, ids) for k, ids in short + more if k not in answered]
    n_sg = 0
    if sharegpt_text_tokens:
        from .data import render_example
        for cid, msgs in shuffled(sg.train, seed + 2):
            if n_sg >= sharegpt_text_tokens:
                break
            ex = render_example(target, cid, msgs, text_max_len)
            if ex is not None:
                text.append((f"sharegpt:{cid}", ex["ids"].tolist(), ex["mask"].tolist()))
                n_sg += len(ex["ids"])
        say(f"{n_sg} tokens of ShareGPT conversations as text")
    parts = {"train": train, "holdout": holdout, "mtbench": mtbench, TEXT: text}
    meta = {"format": INPUTS_FORMAT, "version": 2, "target": target.name, "vocab_size": target.config.vocab_size,
            "hidden_size": target.config.hidden_size, "probe_ids": target.encode(PROBE_TEXT),
            "max_prompt_len": max_prompt_len, "max_context_len": max_context_len, "holdout_percent": holdout_percent,
            "seed": seed, "sharegpt": sg.stats,
            "train_order": {"short_first_turns": len(short), "long_first_turns": len(long_first),
                            "later_turns": len(later), "answered_by_prior_regen": len(short) + len(more) - len(train)},
            "skipped_long": {"train_first_turns": skipped_first, "train_later_turns": skipped_later,
                             "holdout": skipped_hold},
            "text": {"prior_regen": prior_stats, "sharegpt_tokens": n_sg, "max_len": text_max_len}}
    return _with_counts({"meta": meta, **parts})


def _prior_text(target, paths, holdout_percent: float, is_holdout) -> tuple[list, list]:
    """Training records of earlier runs' regen files as text entries (key "regen:<id>", mask from prompt_len)."""
    from .export_dir import load_regen
    out, stats, seen = [], [], set()
    for path in paths:
        recs = load_regen(path).get("train", [])
        kept = 0
        for r in recs:
            if r["id"] in seen or is_holdout(r["id"].split("#")[0], holdout_percent):
                continue
            if max(r["ids"]) >= target.config.vocab_size:
                raise ValueError(f"{path}: record {r['id']!r} has ids outside this target's vocabulary "
                                 f"({target.config.vocab_size} tokens): replies of another target?")
            seen.add(r["id"])
            mask = [0] * r["prompt_len"] + [1] * (len(r["ids"]) - r["prompt_len"])
            out.append((f"regen:{r['id']}", list(r["ids"]), mask))
            kept += 1
        stats.append({"path": str(path), "records": len(recs), "kept": kept})
    return out, stats


def _with_counts(inputs: dict) -> dict:
    inputs["meta"]["counts"] = {k: len(inputs.get(k, [])) for k in PARTS + (TEXT,)}
    inputs["meta"]["text_tokens"] = int(sum(len(ids) for _, ids, _ in inputs.get(TEXT, [])))
    return inputs


def _arrays(inputs: dict) -> dict:
    if inputs["meta"]["vocab_size"] > 65536:
        raise ValueError(f"vocabulary of {inputs['meta']['vocab_size']} tokens does not fit uint16 ids")
    arrays = {"meta": np.asarray(json.dumps(inputs["meta"]))}
    for name in PARTS + (TEXT,):
        entries = inputs.get(name, [])
        seqs = [np.asarray(e[1], np.uint16) for e in entries]
        arrays[f"{name}_ids"] = np.concatenate(seqs) if seqs else np.zeros(0, np.uint16)
        arrays[f"{name}_offsets"] = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int64)
        arrays[f"{name}_keys"] = np.asarray([e[0] for e in entries], dtype=str)
    masks = [np.asarray(m, np.uint8) for _, _, m in inputs.get(TEXT, [])]
    arrays[f"{TEXT}_mask"] = np.packbits(np.concatenate(masks) if masks else np.zeros(0, np.uint8))
    return arrays


def _npz_bytes(inputs: dict) -> bytes:
    buf = io.BytesIO()
    np.savez_compressed(buf, **_arrays(inputs))
    return buf.getvalue()


def fit_to_bytes(inputs: dict, max_bytes: int) -> dict:
    """`inputs` with the ShareGPT entries of `text` cut (from the end) so the compressed file is at most
    `max_bytes`; the prompts and earlier runs' replies are never cut (an error says so when they alone are over)."""
    text = inputs.get(TEXT, [])
    fixed = [e for e in text if not e[0].startswith("sharegpt:")]
    extra = [e for e in text if e[0].startswith("sharegpt:")]
    base = {**inputs, TEXT: fixed}
    size = len(_npz_bytes(_with_counts(dict(base, meta=dict(inputs["meta"])))))
    if size > max_bytes:
        raise ValueError(f"recipe inputs: the prompts and earlier runs' replies alone take {size} bytes, over "
                         f"max_bytes={max_bytes} (fewer prompts: --max-context-len 384, --max-train N)")
    # the most ShareGPT entries that fit: bisection over the real compressed size (a handful of compressions)

    def build(n: int) -> dict:
        out = _with_counts({**inputs, "meta": dict(inputs["meta"]), TEXT: fixed + extra[:n]})
        out["meta"]["text"] = {**out["meta"].get("text", {}), "max_bytes": max_bytes,
                               "sharegpt_tokens": int(sum(len(e[1]) for e in extra[:n]))}
        return out

    lo, hi = 0, len(extra)  # build(lo) fits; find the largest n that does
    if len(_npz_bytes(build(hi))) <= max_bytes:
        return build(hi)
    while hi - lo > max(1, len(extra) // 500):
        mid = (lo + hi) // 2
        if len(_npz_bytes(build(mid))) <= max_bytes:
            lo = mid
        else:
            hi = mid
    return build(lo)


def save_inputs(inputs: dict, path, max_bytes: int | None = None) -> Path:
    """Write `prepare_inputs`' result as one compressed .npz, atomically; with `max_bytes`, ShareGPT text is cut to
    fit (`fit_to_bytes`)."""
    path = Path(path)
    if max_bytes is not None:
        inputs = fit_to_bytes(inputs, max_bytes)
    data = _npz_bytes(_with_counts(inputs))
    path.parent.mkdir(parents=True, exist_ok=True)
    with dio.atomic_file(path) as tmp:
        Path(tmp).write_bytes(data)
    return path


def load_inputs(path) -> dict:
    """Read `save_inputs`' file, checking it is whole and ours (errors name the file and the problem). Files of
    version 1 (no text part) read with an empty `text`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"recipe inputs {path} do not exist (make them with `ddd-jax train-draft "
                                "recipe-inputs --out FILE`)")
    try:
        with np.load(path, allow_pickle=False) as z:
            data = {k: z[k] for k in z.files}
    except Exception as e:  # zipfile / numpy errors for truncated or foreign files
        raise ValueError(f"recipe inputs {path}: not a readable .npz ({type(e).__name__}: {e})") from e
    try:
        meta = json.loads(str(data["meta"]))
    except (KeyError, json.JSONDecodeError) as e:
        raise ValueError(f"recipe inputs {path}: no valid 'meta' record") from e
    if meta.get("format") != INPUTS_FORMAT:
        raise ValueError(f"recipe inputs {path}: format {meta.get('format')!r}, expected {INPUTS_FORMAT!r}")
    out = {"meta": meta}
    for name in PARTS + (TEXT,):
        if name == TEXT and f"{name}_ids" not in data:
            out[name] = []
            continue
        try:
            ids, offs, keys = data[f"{name}_ids"], data[f"{name}_offsets"], data[f"{name}_keys"]
        except KeyError as e:
            raise ValueError(f"recipe inputs {path}: missing array {e.args[0]!r}") from e
        if len(offs) != len(keys) + 1 or offs[0] != 0 or offs[-1] != len(ids) or np.any(np.diff(offs) <= 0):
            raise ValueError(f"recipe inputs {path}: the {name} offsets do not delimit {len(keys)} non-empty prompts "
                             f"in {len(ids)} ids")
        spans = list(zip(keys, offs[:-1], offs[1:]))
        if name == TEXT:
            mask = np.unpackbits(data[f"{TEXT}_mask"])[:len(ids)]
            if len(mask) != len(ids):
                raise ValueError(f"recipe inputs {path}: the text mask holds {len(mask)} of {len(ids)} tokens")
            out[name] = [(str(k), ids[a:b].astype(np.int32).tolist(), mask[a:b].tolist()) for k, a, b in spans]
        else:
            out[name] = [(str(k), ids[a:b].astype(np.int32).tolist()) for k, a, b in spans]
    return out


def check_inputs_for(target, inputs: dict, where: str = "recipe inputs") -> None:
    """The inputs must come from this target's tokenizer and vocabulary."""
    m = inputs["meta"]
    if (m["vocab_size"], m["hidden_size"]) != (target.config.vocab_size, target.config.hidden_size):
        raise ValueError(f"{where} were made for {m['target']!r} (vocab_size={m['vocab_size']}, hidden_size="
                         f"{m['hidden_size']}), not for this target (vocab_size={target.config.vocab_size}, "
                         f"hidden_size={target.config.hidden_size})")
    if target.tokenizer is not None and target.encode(PROBE_TEXT) != m["probe_ids"]:
        raise ValueError(f"{where}: this target's tokenizer encodes a probe text differently from {m['target']!r}'s")
