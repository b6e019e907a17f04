"""HF LLaMA checkpoints -> our params through a declarative key table (safetensors, sharded, or pytorch .bin).

The conversion engine (`plan` + `convert`) is shared with the GGUF and EAGLE-head converters: a key table
is a list of `Rule`s (regex over source names -> our flat key, with an optional transform and transpose);
layer tensors (the regex's first group is the layer index) are stacked on a leading axis. Every source
tensor must match exactly one rule (or an ignore pattern), every expected (key, layer) must be filled
exactly once, and every shape is checked against the one abstract description (`llama.param_shapes`)
before a single tensor is read. Tensors are then read and written one at a time into preallocated
buffers, so converting a 7B never holds two full copies.
"""
from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from . import io as dio

# ---------------------------------------------------------------------------------------------------------
# Key tables


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


def llama_layer_rules(prefix: str, input_norm: bool = True) -> tuple:
    """Rules for HF-named decoder layers `<prefix>layers.N.*` (shared by targets and EAGLE heads)."""
    p = re.escape(prefix) + r"layers\.(\d+)\."
    rules = [Rule(p + r"input_layernorm\.weight", "layers.attn_norm")] if input_norm else []
    rules += [Rule(p + f"self_attn\\.{n}_proj\\.weight", f"layers.w{n}", transpose=True) for n in "qkvo"]
    rules.append(Rule(p + r"post_attention_layernorm\.weight", "layers.mlp_norm"))
    rules += [Rule(p + f"mlp\\.{n}_proj\\.weight", f"layers.w_{n}", transpose=True) for n in ("gate", "up", "down")]
    return tuple(rules)


# HF `LlamaForCausalLM` state-dict names -> `llama.param_shapes` keys.
HF_LLAMA_RULES = (
    Rule(r"model\.embed_tokens\.weight", "embed"),
    *llama_layer_rules("model."),
    Rule(r"model\.norm\.weight", "final_norm"),
    Rule(r"lm_head\.weight", "lm_head", transpose=True),
)
# Known non-weight buffers that some checkpoints carry.
HF_IGNORE = (r".*rotary_emb\.inv_freq", r".*\.masked_bias", r".*\.attn\.bias")


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
        layer = int(m.group(1)) if m.groups() else None
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


def convert(slots: list[_Slot], expected: dict, dtype, transforms: dict | None = None, as_jax: bool = True) -> dict:
    """Read the planned tensors one at a time into preallocated [L, ...] buffers; return nested params."""
    transforms = transforms or {}
    bufs = {k: np.empty(tuple(s), dtype) for k, s in expected.items()}
    for slot in slots:
        x = np.asarray(slot.src.load())
        if slot.rule.fn:
            x = transforms[slot.rule.fn](x)
        if slot.rule.transpose:
            x = x.T
        buf = bufs[slot.rule.key]
        if slot.layer is None:
            buf[...] = x
        else:
            buf[slot.layer] = x
        del x
    if as_jax:
        import jax.numpy as jnp
        for k in list(bufs):
            bufs[k] = jnp.asarray(bufs.pop(k))  # one leaf at a time: never two full copies
    return dio.unflatten(bufs)


def flat_shapes(nested_shapes: dict) -> dict:
    return {k: tuple(v) for k, v in dio.flatten(nested_shapes).items()}


# ---------------------------------------------------------------------------------------------------------
# Reading checkpoints lazily

_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
              "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def _np_dtype(name: str):
    import ml_dtypes
    return np.dtype(getattr(ml_dtypes, name)) if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2") \
        else np.dtype(name)


def safetensors_sources(path) -> list[SourceTensor]:
    """The tensors of one .safetensors file, memory-mapped (nothing is read until `.load()`)."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not a safetensors file ({e})") from None
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    start = 8 + n
    out = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _ST_DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        dt = _np_dtype(_ST_DTYPES[info["dtype"]])
        b, e = info["data_offsets"]
        shape = tuple(info["shape"])

        def load(b=b, e=e, dt=dt, shape=shape):
            return mm[start + b:start + e].view(dt).reshape(shape)

        out.append(SourceTensor(name, shape, load, dt))
    return out


def torch_bin_sources(path) -> list[SourceTensor]:
    """The tensors of a pytorch_model*.bin (torch.load(weights_only=True), mmap when possible)."""
    import torch  # only on this path
    try:
        sd = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # legacy (non-zip) format cannot be mmapped
        sd = torch.load(str(path), map_location="cpu", weights_only=True)
    if not isinstance(sd, dict):
        raise ValueError(f"{path}: expected a state dict, got {type(sd).__name__}")
    if "state_dict" in sd and isinstance(sd["state_dict"], dict):
        sd = sd["state_dict"]

    def to_np(t):
        t = t.detach()
        if t.dtype == torch.bfloat16:
            import ml_dtypes
            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()

    out = []
    for name, t in sd.items():
        if not hasattr(t, "shape"):
            continue
        out.append(SourceTensor(name, tuple(t.shape), lambda t=t: to_np(t), None))
    return out


def checkpoint_sources(d: Path) -> list[SourceTensor]:
    """All weight tensors of an HF-style directory: model.safetensors, a sharded index, or pytorch .bin."""
    d = Path(d)
    for index_name, reader in (("model.safetensors.index.json", safetensors_sources),
                               ("pytorch_model.bin.index.json", torch_bin_sources)):
        index = d / index_name
        if index.is_file():
            wm = dio.read_json(index).get("weight_map")
            if not isinstance(wm, dict):
                raise ValueError(f"{index}: no weight_map")
            files = sorted(set(wm.values()))
            missing = [f for f in files if not (d / f).is_file()]
            if missing:
                raise FileNotFoundError(f"{index} names shard files that do not exist: {missing}")
            out = []
            for f in files:
                out.extend(reader(d / f))
            return out
    st = sorted(d.glob("*.safetensors"))
    if st:
        out = []
        for f in st:
            out.extend(safetensors_sources(f))
        return out
    bins = sorted(d.glob("pytorch_model*.bin")) or sorted(d.glob("*.bin"))
    if bins:
        out = []
        for f in bins:
            out.extend(torch_bin_sources(f))
        return out
    raise FileNotFoundError(
        f"{d}: no weights found (expected model.safetensors, a sharded model.safetensors.index.json, "
        f"or pytorch_model*.bin)")


def source_dtype(sources: list[SourceTensor], prefer: str | None = None):
    """Default param dtype: the stored float dtype of `prefer` (or the first float tensor); f64 -> f32."""
    cands = [s for s in sources if s.name == prefer] + list(sources)
    for s in cands:
        dt = s.dtype if s.dtype is not None else np.asarray(s.load()).dtype
        if dt.kind == "f" or dt.name == "bfloat16":
            return np.dtype(np.float32) if dt == np.float64 or dt.itemsize == 1 else dt
    return np.dtype(np.float32)


def resolve_dtype(dtype):
    if dtype is None:
        return None
    if isinstance(dtype, str):
        if dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype!r}")
        return _np_dtype(dtype)
    return np.dtype(dtype)


# ---------------------------------------------------------------------------------------------------------
# HF LLaMA directory -> params


def load_hf_params(d, cfg, dtype=None, as_jax: bool = True) -> dict:
    """Convert the weights of HF LLaMA directory `d` to `llama.param_shapes(cfg)` params."""
    from . import llama
    d = Path(d)
    sources = checkpoint_sources(d)
    dtype = resolve_dtype(dtype) or source_dtype(sources, "model.embed_tokens.weight")
    expected = flat_shapes(llama.param_shapes(cfg))
    ignore = HF_IGNORE + ((r"lm_head\.weight",) if cfg.tie_word_embeddings else ())
    rules = [r for r in HF_LLAMA_RULES if not (cfg.tie_word_embeddings and r.key == "lm_head")]
    slots = plan(sources, rules, expected, f"HF checkpoint {d}", ignore=ignore)
    return convert(slots, expected, dtype, as_jax=as_jax)


def read_tokenizer_files(d) -> tuple[object | None, str | None, dict]:
    """(tokenizers.Tokenizer or None, chat template or None, special tokens) from an HF-style directory."""
    d = Path(d)
    tok = None
    if (d / "tokenizer.json").is_file():
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tc = dio.read_json(d / "tokenizer_config.json") if (d / "tokenizer_config.json").is_file() else {}
    template = tc.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    if template is None and (d / "chat_template.jinja").is_file():
        template = (d / "chat_template.jinja").read_text()
    if template is None and (d / "chat_template.json").is_file():
        template = dio.read_json(d / "chat_template.json").get("chat_template")
    special = {}
    for k in ("bos_token", "eos_token", "unk_token", "pad_token"):
        v = tc.get(k)
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str):
            special[k] = v
    return tok, template, special


def read_hf_config(d):
    """ModelConfig from config.json, with generation_config.json's eos ids merged in (e.g. Llama-3 <|eot_id|>)."""
    from dataclasses import replace

    from .config import ModelConfig
    d = Path(d)
    raw = dio.read_json(d / "config.json")
    mt = raw.get("model_type")
    archs = raw.get("architectures") or []
    if mt not in (None, "llama") and "LlamaForCausalLM" not in archs:
        raise ValueError(f"{d}/config.json: model_type {mt!r} is not a LLaMA architecture (supported: 'llama')")
    cfg = ModelConfig.from_hf_config(raw)
    gen = d / "generation_config.json"
    if gen.is_file():
        g = dio.read_json(gen).get("eos_token_id")
        extra = [] if g is None else (list(g) if isinstance(g, (list, tuple)) else [g])
        eos = tuple(dict.fromkeys(list(cfg.eos_token_id) + [int(x) for x in extra]))
        cfg = replace(cfg, eos_token_id=eos)
    return raw, cfg


# ---------------------------------------------------------------------------------------------------------
# Streaming safetensors writer (one tensor in memory at a time: big checkpoints never double in RAM)

_ST_CODES = {v: k for k, v in _ST_DTYPES.items()}


def write_safetensors(tensors: dict, path, dtype=None, metadata: dict | None = None) -> None:
    """Write {name: array} to `path` in safetensors format, casting each tensor to `dtype` (if given)
    only when it is written. Not atomic by itself: call inside `io.atomic_dir`."""
    dt = resolve_dtype(dtype)
    header, off, order = {}, 0, []
    for name, a in tensors.items():
        t_dt = dt if dt is not None else np.dtype(a.dtype)
        if t_dt.name not in _ST_CODES:
            raise ValueError(f"cannot write tensor {name!r} of dtype {t_dt} to safetensors")
        n = int(np.prod(a.shape, dtype=np.int64)) * t_dt.itemsize
        header[name] = {"dtype": _ST_CODES[t_dt.name], "shape": [int(s) for s in a.shape], "data_offsets": [off, off + n]}
        order.append((name, t_dt, n))
        off += n
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for name, t_dt, n in order:
            a = np.ascontiguousarray(np.asarray(tensors[name]).astype(t_dt, copy=False))
            if a.nbytes != n:
                raise ValueError(f"tensor {name!r} changed size while writing")
            f.write(a.reshape(-1).view(np.uint8).data)
            del a
