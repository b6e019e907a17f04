"""Load a draft head by name, from our head format, or from an official EAGLE-1/2 PyTorch directory."""
from __future__ import annotations

from pathlib import Path

from . import io as dio

HEADS_DIR = Path(__file__).parent / "heads"
# Packaged heads: name -> directory under ddd_jax/heads/ (our head format).
NAMED_DRAFTS = {"smollm2-135m-instruct-eagle": "smollm2-135m-instruct-eagle"}


def named_draft_dir(name: str) -> Path:
    if name not in NAMED_DRAFTS:
        raise ValueError(f"unknown draft head name {name!r}; known names: {sorted(NAMED_DRAFTS)} (or pass a path to "
                         "our head format or an official EAGLE-1/2 PyTorch head directory)")
    d = HEADS_DIR / NAMED_DRAFTS[name]
    if not (d / "config.json").is_file() or not (d / "model.safetensors").is_file():
        raise FileNotFoundError(f"draft head {name!r} is not packaged in this install ({d} is missing or "
                                "incomplete); train one with `ddd-jax train-draft` or pass a head directory")
    return d


def load_draft(path_or_name, target, dtype=None):
    """A draft head bound to `target`.

    path_or_name: a packaged name ("smollm2-135m-instruct-eagle"), a directory in our head format
    (`eagle.save_draft`), or an official EAGLE-1/2 PyTorch head (config.json + pytorch_model.bin /
    model.safetensors), converted on the fly. dtype defaults to the target's parameter dtype.
    """
    from . import eagle
    s = str(path_or_name)
    dtype = dtype or target.params["embed"].dtype
    if s in NAMED_DRAFTS:
        return eagle.load_draft_dir(named_draft_dir(s), target, dtype=dtype)
    path = Path(s).expanduser()
    if not path.exists():
        if "/" not in s and "\\" not in s:
            raise ValueError(f"unknown draft head name {s!r} (and no such path); known names: {sorted(NAMED_DRAFTS)}")
        raise FileNotFoundError(f"no draft head at {path}")
    if not path.is_dir() or not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: a draft head is a directory with a config.json")
    fmt = dio.read_json(path / "config.json").get("format")
    if fmt == eagle.FORMAT:
        return eagle.load_draft_dir(path, target, dtype=dtype)
    if fmt is not None:
        raise ValueError(f"{path} holds a {fmt!r} checkpoint, not a draft head")
    from .eagle_convert import convert_official_head
    return convert_official_head(path, target, dtype=dtype)
