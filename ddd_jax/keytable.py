"""The generic key-table engine: source tensors -> our flat keys by regex rules, with completeness and shape checks.

A key table is a list of `Rule`s (regex over source names -> our flat key, with an optional transform and
transpose); layer tensors (the regex's first group is the layer index) are stacked on a leading axis. Every
source tensor must match exactly one rule (or an ignore pattern), every expected (key, layer) must be filled
exactly once, and every shape is checked against the one abstract description (e.g. `llama.param_shapes`)
before a single tensor is read. Tensors are then read and written one at a time into preallocated buffers, so
converting a 7B never holds two full copies. `check_shapes` runs the same checks on params already in memory.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np

from . import io as dio


@dataclass(frozen=True)
class Rule:
    """One row of a key table: source names matching `pattern` go to our flat key `key`.

    If the pattern has a group, it is the layer index and `key` is stacked on a leading layer axis.
    `fn` names a transform from the converter's `transforms` dict, applied to the [out, in] source
    tensor before `transpose` (HF Linear weights are [out, in]; ours are input-major [in, out]).
    """

    pattern: str
    key: str
    transpose: bool = False
    fn: str | None = None


@dataclass(frozen=True)
class SourceTensor:
    """A tensor in a checkpoint, not yet read: its name, shape and a loader returning a numpy array."""

    name: str
    shape: tuple
    load: Callable[[], np.ndarray]
    dtype: object = None  # numpy dtype of the stored values, when known


@dataclass(frozen=True)
class _Slot:
    src: SourceTensor
    rule: Rule
    layer: int | None


def plan(sources: Iterable[SourceTensor], rules, expected: dict, what: str, ignore=()) -> list[_Slot]:
    """Match every source tensor to one (key, layer) slot and check completeness and shapes.

    expected: flat {our key: full shape} (stacked keys have the leading layer axis). Raises one
    ValueError listing every unexpected, duplicate, missing or misshaped tensor.
    """
    compiled = [(re.compile(r.pattern + r"\Z"), r) for r in rules]
    ign = [re.compile(p + r"\Z") for p in ignore]
    slots: dict[tuple, _Slot] = {}
    unexpected, duplicates, misshaped = [], [], []
    for src in sources:
        hits = [(m, r) for c, r in compiled if (m := c.match(src.name))]
        if not hits:
            if not any(p.match(src.name) for p in ign):
                unexpected.append(src.name)
            continue
        if len(hits) > 1:
            raise ValueError(f"{what}: key table is ambiguous for {src.name!r}: {[r.pattern for _, r in hits]}")
        m, r = hits[0]
        if r.key not in expected:
            unexpected.append(src.name)
            continue
        layer = int(m.group(1) or 0) if m.groups() else None  # an optional group that matched nothing: layer 0
        full = tuple(expected[r.key])
        want = full[1:] if layer is not None else full
        if layer is not None and not 0 <= layer < full[0]:
            unexpected.append(f"{src.name} (layer {layer} >= {full[0]} layers)")
            continue
        got = tuple(src.shape)[::-1] if r.transpose else tuple(src.shape)
        if got != want:
            need = want[::-1] if r.transpose else want
            misshaped.append(f"{src.name}: got {tuple(src.shape)}, expected {need}")
        slot = (r.key, layer)
        if slot in slots:
            duplicates.append(f"{src.name} (also {slots[slot].src.name})")
            continue
        slots[slot] = _Slot(src, r, layer)
    missing = []
    for key, shape in expected.items():
        stacked = any(r.key == key and re.compile(r.pattern).groups for r in rules)
        for layer in (range(shape[0]) if stacked else [None]):
            if (key, layer) not in slots:
                missing.append(key if layer is None else f"{key}[{layer}]")
    problems = []
    if missing:
        problems.append(f"missing tensors {_abbrev(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors {_abbrev(unexpected)}")
    if duplicates:
        problems.append(f"duplicate tensors {_abbrev(duplicates)}")
    if misshaped:
        problems.append("misshaped tensors " + "; ".join(misshaped[:10]) + (" ..." if len(misshaped) > 10 else ""))
    if problems:
        raise ValueError(f"{what}: " + "; ".join(problems))
    return list(slots.values())


def _abbrev(xs: list, n: int = 12) -> str:
    return repr(xs[:n])[:-1] + (f", ... ({len(xs)} in all)]" if len(xs) > n else "]")


def convert(slots: list[_Slot], expected: dict, dtype, transforms: dict | None = None, as_jax: bool = True,
            place=None) -> dict:
    """Read the planned tensors into [L, ...] buffers, one of our keys at a time; return nested params.

    Each key's host buffer is finished, then handed to `place(key, buffer)` (e.g. `ddd_jax.sharding.placer`: a
    NamedSharding per tensor) or `jnp.asarray` with as_jax, and dropped before the next key's is built, so only
    one converted tensor is ever on the host beside what is already placed. as_jax=False keeps numpy buffers.
    """
    transforms = transforms or {}
    by_key: dict[str, list[_Slot]] = {k: [] for k in expected}
    for slot in slots:
        by_key[slot.rule.key].append(slot)
    if as_jax and place is None:
        import jax.numpy as jnp
        place = lambda key, x: jnp.asarray(x)  # noqa: E731
    out = {}
    for key, shape in expected.items():
        buf = np.empty(tuple(shape), dtype)
        for slot in by_key[key]:
            x = np.asarray(slot.src.load())
            if slot.rule.fn:
                x = transforms[slot.rule.fn](x)
            if slot.rule.transpose:
                x = x.T
            if slot.layer is None:
                buf[...] = x
            else:
                buf[slot.layer] = x
            del x
        out[key] = buf if not as_jax else place(key, buf)
        del buf
    return dio.unflatten(out)


def export(params: dict, rules, what: str, inverse: dict | None = None) -> dict:
    """The inverse of `plan` + `convert`: our params -> {source name: numpy array} by the same rules (layer
    tensors unstacked, `transpose` undone). Every param must be covered by a rule; rules whose key is absent
    (e.g. an untied lm_head) are skipped. A rule with a transform `fn` needs `inverse[fn]` (our array -> the source
    array before its transpose). A pattern's alternatives `(?:a|b)` export as their first one; a stacked key whose
    layer group sits in a branch not taken (EAGLE-3's `midlayer.`) must hold one layer, written unstacked."""
    flat = dio.flatten(params)
    inverse = inverse or {}
    out, used = {}, set()
    for r in rules:
        if r.key not in flat:
            continue
        if r.fn and r.fn not in inverse:
            raise ValueError(f"{what}: rule {r.pattern!r} has a transform ({r.fn}) and no inverse to export it with")
        x = np.asarray(flat[r.key])
        template = source_name(r.pattern, what)
        stacked = re.compile(r.pattern).groups > 0
        if stacked and "{}" not in template:  # an optional layer group: the one layer, unstacked
            if x.shape[0] != 1:
                raise ValueError(f"{what}: {r.key} holds {x.shape[0]} layers but {template!r} names one")
            items = [(template, x[0])]
        elif "{}" in template:
            items = [(template.format(i), x[i]) for i in range(x.shape[0])]
        else:
            items = [(template, x)]
        for name, a in items:
            if r.fn:
                a = np.asarray(inverse[r.fn](a))
            if name in out:
                raise ValueError(f"{what}: two rules export {name!r}")
            out[name] = a.T if r.transpose else a
        used.add(r.key)
    left = sorted(set(flat) - used)
    if left:
        raise ValueError(f"{what}: no rule exports {left}")
    return out


def source_name(pattern: str, what: str = "key table") -> str:
    """The source name a rule's pattern exports to: escapes undone, a layer group `(\\d+)` as "{}", the first
    branch of each `(?:a|b)`. Fails for anything else a name could not be written from (`*`, `?`, classes, ...)."""
    out, i, n = [], 0, len(pattern)
    slots = 0
    while i < n:
        c = pattern[i]
        if c == "\\":
            if i + 1 >= n or pattern[i + 1].isalnum():  # \d, \w, ...: a class, not a literal
                raise ValueError(f"{what}: cannot invert rule pattern {pattern!r}")
            out.append(pattern[i + 1])
            i += 2
        elif pattern.startswith(r"(\d+)", i):
            out.append("{}")
            slots += 1
            i += len(r"(\d+)")
        elif pattern.startswith("(?:", i):
            end = _group_end(pattern, i, what)
            first = _split_branches(pattern[i + 3:end], what)[0]
            out.append(source_name(first, what))
            slots += out[-1].count("{}")
            i = end + 1
        elif c in "()[]{}|?*+.^$":
            raise ValueError(f"{what}: cannot invert rule pattern {pattern!r}")
        else:
            out.append(c)
            i += 1
    if slots > 1:
        raise ValueError(f"{what}: cannot invert rule pattern {pattern!r} (more than one layer group)")
    return "".join(out)


def _group_end(pattern: str, start: int, what: str) -> int:
    """The index of the `)` closing the group opened at `start`."""
    depth, i = 0, start
    while i < len(pattern):
        if pattern[i] == "\\":
            i += 2
            continue
        depth += {"(": 1, ")": -1}.get(pattern[i], 0)
        if depth == 0:
            return i
        i += 1
    raise ValueError(f"{what}: unbalanced group in rule pattern {pattern!r}")


def _split_branches(body: str, what: str) -> list[str]:
    """A group's body split at its top-level `|`."""
    parts, depth, cur, i = [], 0, [], 0
    while i < len(body):
        c = body[i]
        if c == "\\":
            cur.append(body[i:i + 2])
            i += 2
            continue
        if c == "|" and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            depth += {"(": 1, ")": -1}.get(c, 0)
            cur.append(c)
        i += 1
    parts.append("".join(cur))
    return parts


def flat_shapes(nested_shapes: dict) -> dict:
    return {k: tuple(v) for k, v in dio.flatten(nested_shapes).items()}


def check_shapes(params: dict, expected: dict, what: str) -> None:
    """Fail with a clear message on missing, unexpected or misshaped tensors: the key-table checks with one
    identity rule per key. params: nested, leaves with `.shape`; expected: nested shape tuples."""
    exp = dict(sorted(flat_shapes(expected).items()))
    sources = [SourceTensor(k, tuple(v.shape), lambda: None) for k, v in sorted(dio.flatten(params).items())]
    plan(sources, [Rule(re.escape(k), k) for k in exp], exp, what)


# ---------------------------------------------------------------------------------------------------------
# dtypes

def np_dtype(name: str):
    """numpy dtype by name, including the ml_dtypes ones (bfloat16, float8_*)."""
    import ml_dtypes
    return np.dtype(getattr(ml_dtypes, name)) if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2") \
        else np.dtype(name)


def resolve_dtype(dtype):
    """A user's parameter dtype ("float32" | "float16" | "bfloat16", a numpy/jax dtype, or None) as a numpy dtype."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        if dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype!r}")
        return np_dtype(dtype)
    return np.dtype(dtype)


def source_dtype(sources: list[SourceTensor], prefer: str | None = None):
    """Default param dtype: the stored float dtype of `prefer` (or the first float tensor); f64 -> f32."""
    cands = [s for s in sources if s.name == prefer] + list(sources)
    for s in cands:
        dt = s.dtype if s.dtype is not None else np.asarray(s.load()).dtype
        if dt.kind == "f" or dt.name == "bfloat16":
            return np.dtype(np.float32) if dt == np.float64 or dt.itemsize == 1 else dt
    return np.dtype(np.float32)
