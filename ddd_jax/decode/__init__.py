"""Decoding: the plan and state (`state`), the draft phase (`drafting`), one cycle -- prefill, verify, commit --
(`cycle`), the loops that drive it (`drivers`), and the API (`api`: `generate`, `stream`).

The draft phase -- how deep to draft and every DDD stop decision -- lives in `drafting`; a cycle asks it for the
finished tree, verifies it in one target forward and commits what was accepted.

Loops:
* vanilla: one jitted `lax.while_loop` over tokens (``loop="device"``) or a Python loop (``loop="host"``,
  streaming).
* speculative ``method="eagle2"`` / ``"ddd"`` with ``sync="device"`` or ``"callback"``: by default the whole
  generation is one jitted `lax.while_loop` over cycles; ``loop="host"`` runs one fused jitted cycle per
  Python iteration (one sync per cycle to read the done flag).
* ``sync="host"``: a Python loop in the fewest programs the host's decisions allow -- one per check. A cycle's
  verification and commit run in one program with the next cycle's draft up to its first check, the host reads
  that check's confidence together with the done flags (one sync), and each later check is a segment program and
  a read (`drafting.finish_from_host`).
* ``profile=True``: a Python loop over cycles whose phases (draft, verify, commit) are separate jitted calls;
  drafting is `drafting.draft_from_host`.

``profile=True`` blocks after each phase to split wall time into draft / verify / commit (same tokens; the
blocking adds time, so use it for the split, not for speed).

Every sync counted in ``stats["host_syncs"]`` happens during decoding; the final transfer of results is not
counted. ``draft_syncs`` counts those inside draft phases (one per DDD check executed in host and callback
modes; 0 in device mode and for EAGLE-2).
"""
from .api import compile_vanilla, generate, stream
from .state import (METHODS, PROMPT_BUCKETS, SYNCS, GenerateResult, Plan, State, bucket_length, cache_capacity,
                    cache_slack, make_plan, vanilla_plan)

__all__ = ["generate", "stream", "GenerateResult", "Plan", "State", "make_plan", "bucket_length", "cache_capacity",
           "cache_slack", "METHODS", "SYNCS", "PROMPT_BUCKETS"]
