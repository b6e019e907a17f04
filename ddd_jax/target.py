"""The Target: a loaded LLaMA-family model (Llama, Mistral, Qwen2, Qwen3) (config, params, tokenizer, chat template) and its jitted forward."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import jax

from . import llama
from .keytable import check_shapes
from .config import ModelConfig


@partial(jax.jit, static_argnames=("cfg", "return_logits"))
def _forward(params, cfg, tokens, positions, cache=None, attn_mask=None, logit_index=None, return_logits=True):
    return llama.forward(params, cfg, tokens, positions, cache, attn_mask, logit_index, return_logits)


@dataclass
class Target:
    """A target model. `params` follow `llama.param_shapes(config)`; `tokenizer` is a `tokenizers.Tokenizer`
    (None for tokenizer-less test models); `chat_template` is the model's Jinja chat template (or None)."""

    name: str
    config: ModelConfig
    params: dict
    tokenizer: object | None = None
    chat_template: str | None = None
    special_tokens: dict = field(default_factory=dict)  # e.g. {"bos_token": "<|im_start|>", "eos_token": ...}
    mesh: object = None  # a ("data", "model") jax.sharding.Mesh the params are sharded over (None: one device)

    def __post_init__(self):
        check_shapes(self.params, llama.param_shapes(self.config), f"target {self.name!r}")
        if self.mesh is not None:  # no-op for params a loader already placed tensor by tensor
            from . import ops, sharding
            if ops.has_blocks(self.params):
                raise ValueError(f"target {self.name!r}: GGUF blocks (gguf_blocks=True) are not sharded over a mesh "
                                 "yet; load float weights to shard")
            if ops.has_panels(self.params):
                raise ValueError(f"target {self.name!r}: panel-major weights are not sharded over a mesh; "
                                 "load with panels=False (or ops.unpacked(params)) to shard")
            sharding.check_mesh(self.mesh)
            sharding.check_divisible(self.config, self.mesh, f"target {self.name!r}")
            self.params = sharding.place_params(self.params, llama.param_axes(self.config), self.mesh)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self.config.eos_token_id)

    def forward(self, tokens, positions, cache=None, attn_mask=None, logit_index=None, return_logits=True):
        """Jitted `llama.forward` over this target's params (see there for shapes)."""
        return _forward(self.params, self.config, tokens, positions, cache, attn_mask, logit_index, return_logits)

    def module(self):
        """This target as a flax nnx module (`modules.LlamaModule`) over the same arrays."""
        from .modules import LlamaModule
        return LlamaModule.from_target(self)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"target {self.name!r} has no tokenizer")
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        if self.tokenizer is None:
            return " ".join(str(int(i)) for i in ids)
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of `messages` rendered with the model's chat template (plus the generation prompt)."""
        from .chat import render_chat
        return self.encode(render_chat(self, messages, add_generation_prompt))
