"""Render a model's Jinja chat template (as transformers' `apply_chat_template` does) in a sandboxed environment."""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache


class ChatTemplateError(ValueError):
    """The template called raise_exception(...) or could not be rendered."""


def _raise_exception(message):
    raise ChatTemplateError(f"chat template error: {message}")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(template: str):
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not parse: {e}") from None


def render_template(template: str, messages: list[dict], add_generation_prompt: bool = True,
                    special_tokens: dict | None = None, **kwargs) -> str:
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) for m in messages):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
    ctx = {"bos_token": "", "eos_token": ""}
    ctx.update(special_tokens or {})
    ctx.update(kwargs)
    return _compile(template).render(messages=list(messages), add_generation_prompt=add_generation_prompt, **ctx)


def render_chat(target, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
    """The prompt text for `messages` under `target`'s chat template (bos/eos/unk/pad tokens passed in)."""
    template = getattr(target, "chat_template", None)
    if not template:
        raise ValueError(f"target {getattr(target, 'name', '?')!r} has no chat template; encode a plain prompt "
                         "instead, or load a checkpoint whose tokenizer_config.json / GGUF metadata has one")
    return render_template(template, messages, add_generation_prompt, getattr(target, "special_tokens", None),
                           **kwargs)
