"""What int8 activations cost in quality: SmolLM2's Q4_1 GGUF loaded twice, as exact blocks (`gguf_blocks=True`,
bitwise the float32 load) and as int8 blocks (`gguf_blocks="int8"`), over the first N MT-bench first turns.

    python experiments/int8_quality.py [N=8] [max_new_tokens=64] [question.jsonl] > int8_quality.json

For each turn it decodes greedily with both (chat template, vanilla) and records whether the replies are identical
and how many leading tokens they share. Then, on the exact model's own reply, it scores every reply token under
both models in one teacher-forced forward each and records the log-probability int8 gives it minus the one the
exact model gives it (mean and mean absolute per token), the KL divergence of the exact model's next-token
distribution from int8's (mean per token, nats), and how often the two argmaxes differ. Prints one JSON object:
the totals, then one record per turn.
"""
import json
import sys


def _logprobs(target, ids):
    """log-softmax [T, V] float64 of the target's logits over `ids`, positions 0..T-1 (no cache)."""
    import jax.numpy as jnp
    import numpy as np
    tok = jnp.asarray(np.asarray(ids, np.int32)[None])
    pos = jnp.arange(len(ids), dtype=jnp.int32)[None]
    z = np.asarray(target.forward(tok, pos).logits[0], np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def main(argv) -> int:
    import numpy as np
    from tqdm import tqdm

    import ddd_jax
    from ddd_jax import generate
    from ddd_jax.backends.cpu import kernels
    from ddd_jax.measure.prompts import build_prompt, load_questions

    n = int(argv[0]) if argv else 8
    new = int(argv[1]) if len(argv) > 1 else 64
    qs = load_questions(argv[2] if len(argv) > 2 else None, limit=n)  # default: MT-bench's, from its wheel
    exact = ddd_jax.load_target("smollm2-135m-instruct", gguf_blocks=True)
    int8 = ddd_jax.load_target("smollm2-135m-instruct", gguf_blocks="int8")
    rows, same, lead, toks, d_sum, a_sum, kl_sum, flips = [], 0, 0, 0, 0.0, 0.0, 0.0, 0
    for q in tqdm(qs, desc="turns"):
        ids = build_prompt(exact, q, 0, [])
        a = generate(exact, None, ids, max_new_tokens=new).tokens
        b = generate(int8, None, ids, max_new_tokens=new).tokens
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        seq = list(ids) + list(a)
        lp_e, lp_i = _logprobs(exact, seq), _logprobs(int8, seq)
        at = np.arange(len(ids) - 1, len(seq) - 1)  # the positions predicting each reply token
        nxt = np.asarray(seq[len(ids):])
        gap = lp_i[at, nxt] - lp_e[at, nxt]
        kl = (np.exp(lp_e[at]) * (lp_e[at] - lp_i[at])).sum(-1)
        flip = int((lp_e[at].argmax(-1) != lp_i[at].argmax(-1)).sum())
        rows.append({"question_id": q["id"], "identical": a == b, "shared_prefix": k,
                     "tokens": len(a), "logprob_gap_mean": float(gap.mean()),
                     "logprob_gap_abs_mean": float(np.abs(gap).mean()), "kl_mean": float(kl.mean()),
                     "argmax_differs": flip})
        same += a == b
        lead += k
        toks += len(a)
        d_sum += float(gap.sum())
        a_sum += float(np.abs(gap).sum())
        kl_sum += float(kl.sum())
        flips += flip
    print(json.dumps({"turns": len(qs), "max_new_tokens": new, "int8_variant": kernels.int8_variant(),
                      "identical": same, "shared_prefix_mean": lead / len(qs), "reply_tokens": toks,
                      "logprob_gap_mean": d_sum / toks, "logprob_gap_abs_mean": a_sum / toks, "kl_mean": kl_sum / toks,
                      "argmax_differs_per_token": flips / toks, "per_turn": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
