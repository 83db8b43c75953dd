"""The cast: pure, framework-free fp32 -> bf16 rounding.

- ``modes``: the mode registry, one :class:`~faircast_ds.casting.modes.ModeSpec` per mode, and the
  :class:`~faircast_ds.casting.modes.CastRule` a run casts with (a spec and a seed).
- ``rules``: the casts themselves, the one place that decides a served bit (``cast``, ``cast_into``).
- ``noise``: the counter-based noise every noisy mode hashes.
- ``bits``: bit-pattern helpers (fp32/bf16 patterns, the bf16 spacing).
- ``kernels/``: the fused one-pass kernels (C++ on CPU, Triton on CUDA) behind ``rules.cast_into``.
- ``reference``: a slow element-by-element restatement, the tests' oracle; it imports nothing from
  faircast_ds.
"""
