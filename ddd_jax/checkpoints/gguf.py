"""llama.cpp GGUF (llama, qwen2, qwen3 architectures) -> our target: dequantized float weights, config and BPE
tokenizer from metadata.

`general.architecture` picks the family (`GGUF_ARCHS`; others fail naming the supported ones); metadata keys are
read under that prefix (`qwen2.embedding_length`, ...). Weights: `gguf.quants.dequantize` to float32; for the
llama architecture (which llama.cpp also uses for Mistral) its Q/K row permutation (made by its converter for its
interleaved RoPE) is undone, giving exactly the tensors transformers' own GGUF loader produces; qwen2/qwen3 are
stored unpermuted (NeoX rope). Qwen2 adds q/k/v biases (`attn_{q,k,v}.bias`), Qwen3 per-head q/k norms
(`attn_{q,k}_norm.weight`). A sliding window in the metadata fails; llama.cpp records none for Mistral (stored
as the llama architecture), so none is applied there, as in llama.cpp.
Tokenizer: byte-level BPE (`tokenizer.ggml.model == "gpt2"`) rebuilt with `tokenizers`
from the vocab and merges; control tokens become special added tokens.
"""
from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np

from .. import io as dio
from .. import llama
from ..config import ModelConfig
from ..target import Target
from .hf import target_placer
from ..keytable import Rule, SourceTensor, convert, flat_shapes, plan, resolve_dtype

GGUF_LLAMA_RULES = (
    Rule(r"token_embd\.weight", "embed"),
    Rule(r"blk\.(\d+)\.attn_norm\.weight", "layers.attn_norm"),
    Rule(r"blk\.(\d+)\.attn_q\.weight", "layers.wq", transpose=True, fn="unpermute_q"),
    Rule(r"blk\.(\d+)\.attn_k\.weight", "layers.wk", transpose=True, fn="unpermute_k"),
    Rule(r"blk\.(\d+)\.attn_v\.weight", "layers.wv", transpose=True),
    # family leaves: matched only where the config expects them (qwen2 biases, qwen3 q/k norms)
    Rule(r"blk\.(\d+)\.attn_q\.bias", "layers.bq"),
    Rule(r"blk\.(\d+)\.attn_k\.bias", "layers.bk"),
    Rule(r"blk\.(\d+)\.attn_v\.bias", "layers.bv"),
    Rule(r"blk\.(\d+)\.attn_q_norm\.weight", "layers.q_norm"),
    Rule(r"blk\.(\d+)\.attn_k_norm\.weight", "layers.k_norm"),
    Rule(r"blk\.(\d+)\.attn_output\.weight", "layers.wo", transpose=True),
    Rule(r"blk\.(\d+)\.ffn_norm\.weight", "layers.mlp_norm"),
    Rule(r"blk\.(\d+)\.ffn_gate\.weight", "layers.w_gate", transpose=True),
    Rule(r"blk\.(\d+)\.ffn_up\.weight", "layers.w_up", transpose=True),
    Rule(r"blk\.(\d+)\.ffn_down\.weight", "layers.w_down", transpose=True),
    Rule(r"output_norm\.weight", "final_norm"),
    Rule(r"output\.weight", "lm_head", transpose=True),
)
GGUF_IGNORE = ()
# general.architecture -> (our model_type, whether llama.cpp permuted the Q/K rows)
GGUF_ARCHS = {"llama": ("llama", True), "qwen2": ("qwen2", False), "qwen3": ("qwen3", False)}

_CONTROL = 3  # llama.cpp token types
_USER_DEFINED = 4


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation on an [out, in] weight (n_head: query or kv heads)."""
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def read_gguf(path):
    import gguf
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # gguf raises ValueError / struct errors on bad magic or truncation
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from None


def gguf_arch(reader, path="GGUF") -> str:
    """general.architecture, checked against `GGUF_ARCHS`."""
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (supported: {sorted(GGUF_ARCHS)})")
    return arch


def gguf_config(reader, path="GGUF"):
    """ModelConfig from GGUF metadata (llama, qwen2, qwen3 architectures)."""
    arch = gguf_arch(reader, path)

    def opt(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    def need(key):
        v = opt(key)
        if v is None:
            raise ValueError(f"{path}: GGUF metadata is missing {arch}.{key}")
        return v

    tokens = _field(reader, "tokenizer.ggml.tokens")
    n_heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    vocab = opt("vocab_size") or (len(tokens) if tokens is not None else None)
    if vocab is None:
        emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
        vocab = int(emb.shape[-1])
    head_dim = opt("attention.key_length") or hidden // n_heads
    scaling = opt("rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"{path}: GGUF rope scaling ({arch}.rope.scaling.type) {scaling!r} is not supported")
    window = opt("attention.sliding_window")
    if window:
        raise ValueError(f"{path}: GGUF {arch}.attention.sliding_window={window} is not supported for GGUF; "
                         "convert from the HF checkpoint instead")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(f"{path}: GGUF has rope_freqs.weight (llama3 rope scaling); not supported for GGUF, "
                         "convert from the HF checkpoint instead")
    eos = [_field(reader, "tokenizer.ggml.eos_token_id"), _field(reader, "tokenizer.ggml.eot_token_id")]
    eos = tuple(dict.fromkeys(int(e) for e in eos if e is not None))
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    model_type = GGUF_ARCHS[arch][0]
    return ModelConfig(
        vocab_size=int(vocab), hidden_size=hidden, intermediate_size=int(need("feed_forward_length")),
        num_hidden_layers=int(need("block_count")), num_attention_heads=n_heads,
        num_key_value_heads=int(opt("attention.head_count_kv") or n_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(f"{opt('attention.layer_norm_rms_epsilon', 1e-5):.7g}"),  # f32 -> 1e-05
        rope_theta=float(opt("rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in names,
        max_position_embeddings=int(opt("context_length", 2048)),
        bos_token_id=None if bos is None else int(bos), eos_token_id=eos,
        model_type=model_type, qkv_bias=model_type == "qwen2", qk_norm=model_type == "qwen3")


def gguf_params(reader, cfg, dtype=None, path="GGUF", as_jax: bool = True, mesh=None,
                gguf_blocks: bool = False) -> dict:
    """The target's params from a GGUF reader: every tensor dequantized to `dtype` (float32 by default), or with
    gguf_blocks=True every matrix stored as Q4_1 / Q8_0 / Q4_0 kept as those blocks (`quant.BlockWeight`, float32
    arithmetic, the same values bit for bit); other tensors (norms, other types) are dequantized to float32."""
    from gguf.quants import dequantize
    sources = [SourceTensor(t.name, tuple(int(s) for s in reversed(list(t.shape))),
                            lambda t=t: dequantize(t.data, t.tensor_type)) for t in reader.tensors]
    expected = flat_shapes(llama.param_shapes(cfg))
    slots = plan(sources, GGUF_LLAMA_RULES, expected, f"GGUF {path}", ignore=GGUF_IGNORE)
    permuted = GGUF_ARCHS[gguf_arch(reader, path)][1]
    transforms = {"unpermute_q": (lambda w: unpermute(w, cfg.num_attention_heads)) if permuted else (lambda w: w),
                  "unpermute_k": (lambda w: unpermute(w, cfg.num_key_value_heads)) if permuted else (lambda w: w)}
    blocks = {}
    if gguf_blocks:
        if mesh is not None:
            raise ValueError("gguf_blocks=True: GGUF blocks are not sharded over a mesh yet (load float weights)")
        if resolve_dtype(dtype) not in (None, np.dtype(np.float32)):
            raise ValueError(f"gguf_blocks=True keeps float32 arithmetic; dtype={dtype!r} does not apply")
        blocks = _block_weights(reader, slots, expected, transforms, as_jax)
        slots = [s for s in slots if s.rule.key not in blocks]
        expected = {k: v for k, v in expected.items() if k not in blocks}
    params = convert(slots, expected, resolve_dtype(dtype) or np.dtype(np.float32), transforms, as_jax=as_jax,
                     place=target_placer(cfg, mesh))
    if not blocks:
        return params
    flat = dio.flatten(params)
    flat.update(blocks)
    return dio.unflatten(flat)


def _block_weights(reader, slots, expected: dict, transforms: dict, as_jax: bool) -> dict:
    """{our key: BlockWeight} for every key whose tensors are all of one kept block type (`quant.GGUF_KINDS`)."""
    from ..backends.cpu.quant import GGUF_KINDS, BlockWeight
    tensors = {t.name: t for t in reader.tensors}
    by_key: dict[str, list] = {}
    for slot in slots:
        by_key.setdefault(slot.rule.key, []).append(slot)
    out, floats = {}, {}
    for key, group in by_key.items():
        if len(expected[key]) - (group[0].layer is not None) < 2:
            continue  # norms, biases (vectors, stacked or not): float32
        types = {tensors[s.src.name].tensor_type.name for s in group}
        kinds = {GGUF_KINDS.get(t) for t in types}
        if len(kinds) != 1 or None in kinds:  # other types, or one matrix stored in several: dequantized
            floats[key] = sorted(types)
            continue
        kind = kinds.pop()
        rows = []
        for s in sorted(group, key=lambda s: -1 if s.layer is None else s.layer):
            raw = np.asarray(tensors[s.src.name].data)  # [R, K/32 * bytes] uint8: rows are output features
            rows.append(transforms[s.rule.fn](raw) if s.rule.fn else raw)
        stacked = rows[0] if group[0].layer is None else np.stack(rows)
        w = BlockWeight(jnp.asarray(stacked) if as_jax else stacked, kind, transposed=group[0].rule.transpose)
        if tuple(w.shape) != tuple(expected[key]):
            raise ValueError(f"GGUF blocks for {key}: logical shape {w.shape}, expected {tuple(expected[key])}")
        out[key] = w
    if floats:
        import warnings
        warnings.warn("gguf_blocks=True: these matrices are not kept as blocks (kept types: "
                      f"{sorted(GGUF_KINDS)}, one type per matrix) and are dequantized to float32: "
                      + ", ".join(f"{k} ({'/'.join(t)})" for k, t in sorted(floats.items())), stacklevel=4)
    return out


def gguf_tokenizer(reader, path="GGUF"):
    """(tokenizers.Tokenizer | None, chat_template | None, special tokens dict). None for non-BPE vocabularies."""
    import warnings
    template = _field(reader, "tokenizer.chat_template")
    model = _field(reader, "tokenizer.ggml.model")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    special = {}
    if tokens is not None:
        for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                          ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
            i = _field(reader, f"tokenizer.ggml.{key}")
            if i is not None and 0 <= int(i) < len(tokens):
                special[name] = tokens[int(i)]
    if model != "gpt2" or tokens is None:
        warnings.warn(f"{path}: GGUF tokenizer model {model!r} is not supported (only byte-level BPE 'gpt2'); "
                      "the target will have no tokenizer", stacklevel=3)
        return None, template, special
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    merges = _field(reader, "tokenizer.ggml.merges") or []
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                               fuse_unk=False, byte_fallback=False))
    split = _PRE_SPLITS.get(_field(reader, "tokenizer.ggml.pre"))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                              use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    # In a byte-level vocabulary every real token is spelled in the byte alphabet; a "control" token
    # that is not is a llama.cpp mislabel and is skipped (as transformers does).
    control = [AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types)
               if int(ty) == _CONTROL and set(t) <= alphabet]
    if control:
        tok.add_special_tokens(control)
    user = [AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types)
            if int(ty) == _USER_DEFINED]
    if user:
        tok.add_tokens(user)
    return tok, template, special


_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")  # as llama3, but one digit at a time
_PRE_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
               "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}


def load_gguf_target(path, dtype=None, name: str | None = None, as_jax: bool = True, mesh=None,
                     gguf_blocks: bool = False) -> Target:
    """A Target from a llama / qwen2 / qwen3 architecture .gguf file (float32 unless dtype is given; gguf_blocks:
    matrices stored as Q4_1 / Q8_0 / Q4_0 stay those blocks, see `gguf_params`)."""
    path = Path(path)
    reader = read_gguf(path)
    cfg = gguf_config(reader, path)
    params = gguf_params(reader, cfg, dtype, path, as_jax=as_jax, mesh=mesh, gguf_blocks=gguf_blocks)
    tok, template, special = gguf_tokenizer(reader, path)
    return Target(name or path.stem, cfg, params, tok, template, special, mesh=mesh)
