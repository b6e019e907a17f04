"""MT-bench prompts for the benchmarks: the questions live in `ddd_jax.measure.prompts`, which head training
shares too; their names stay importable from here."""
from __future__ import annotations

from ..measure.prompts import QUESTIONS_REL, default_questions_path, load_questions

__all__ = ["QUESTIONS_REL", "default_questions_path", "load_questions"]
