"""Test-wide settings: float64 everywhere and strict dtype promotion.

jaxtyping's pytest plugin (``--jaxtyping-packages`` in pyproject.toml) checks every annotated
signature in pegrad, models and optimizers with beartype while the tests run.
"""

import os

# Tests compile hundreds of tiny programs; XLA's optimizing passes cost more than they save here.
os.environ.setdefault(
    "XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
)

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_dtype_promotion", "strict")
