"""Laying weights out for the CPU kernels: a draft head's decode params packed the way its target's are."""
from __future__ import annotations

import jax.numpy as jnp

from .panels import DTYPES, has_panels, pack, pack_head, width_of
from .quant import has_block_panels, has_blocks, has_int8_blocks, is_block, pack_blocks


def pack_draft(params: dict, lm_sub, target_params) -> dict | None:
    """An EAGLE-1/2 head's params (and its draft-vocabulary rows `lm_sub`) panel-major where the target's weights
    are: float panels of the target's width, or -- for a head stored as GGUF blocks -- quantized panels, which the
    panel kernel dequantizes in registers (bitwise the float32 panels of the same values), or multiplies by integer
    products when the target's layers do (`gguf_blocks="int8"`: every matrix of the head, its draft-vocabulary rows
    included). None when the target's weights are not packed."""
    if not (has_panels(target_params) or has_block_panels(target_params)):
        return None
    if not has_blocks(params):
        width = width_of(target_params)  # the target's panel width (None: quantized panels)
        packed = pack_head(params, width)
        if lm_sub is not None:  # rows: the panels of its transpose, as the target's tied embedding
            packable = jnp.dtype(lm_sub.dtype) in DTYPES  # (not bfloat16)
            packed["lm_sub"] = pack(lm_sub, rows=True, width=width) if packable else lm_sub
        return packed
    int8 = has_int8_blocks(target_params)
    blocks = lambda v: pack_blocks(v, int8=int8) if is_block(v) else v  # noqa: E731
    packed = {**params, "fc_w": blocks(params["fc_w"]), "layers": {k: blocks(v) for k, v in params["layers"].items()}}
    if lm_sub is not None:
        packed["lm_sub"] = pack_blocks(lm_sub, int8=int8)
    return packed
