"""The declarative key tables live in `ddd_jax.keytable`, below the models that check their parameters' shapes with
them; this name stays for code written against it."""
from ..keytable import (Rule, SourceTensor, check_shapes, convert, export, flat_shapes, np_dtype, plan,  # noqa: F401
                        resolve_dtype, source_dtype)
