"""ddd-jax: lossless speculative decoding (EAGLE-2 dynamic trees, Dynamic Depth Decoding) in JAX."""
from .checkpoints.loading import load_draft, load_target
from .checkpoints.export_official import save_official
from .checkpoints.ours import save_draft
from .config import DDDConfig, DraftConfig, ModelConfig, TreeConfig
from .eagle import Draft, init_draft
from .calibration import calibrate
from .decode import GenerateResult, generate, stream
from .target import Target


def __getattr__(name):
    # The nnx module views load flax (~0.45 s) only when asked for, so `import ddd_jax` and the CLI stay quick.
    if name in ("LlamaModule", "EagleHeadModule"):
        from . import modules
        return getattr(modules, name)
    raise AttributeError(f"module 'ddd_jax' has no attribute {name!r}")


__all__ = ["DDDConfig", "DraftConfig", "ModelConfig", "TreeConfig", "Draft", "init_draft", "save_draft", "save_official",
           "GenerateResult", "generate", "stream", "calibrate", "Target", "load_target", "load_draft",
           "LlamaModule", "EagleHeadModule"]
