"""The cast modes, defined once: their names, the integer codes the fused kernels take, and which
noise stream each one hashes.

- ``nearest``: round to nearest even (DeepSpeed's own cast; the control). No noise.
- ``stochastic``: fresh noise every cast (stream 1, keyed by the step).
- ``dither``: a fixed per-element threshold for the whole run (stream 2, keyed by step 0).
- ``error_feedback``: round to nearest of master + carried residual. No noise.

The kernels' mode codes are the positions in that list: nearest 0, stochastic 1, dither 2,
error_feedback 3. The noise of a mode at optimizer step ``step`` is ``faircast_ds.cast.noise``'s
``noise16`` under ``key(name, stream, seed, step)`` with the stream and step above.
"""
from __future__ import annotations

import typing
from typing import Final, Literal

Mode = Literal["nearest", "stochastic", "dither", "error_feedback"]
MODES: Final[tuple[str, ...]] = typing.get_args(Mode)
# what the fused kernels (fused_cast.cpp, triton_cast.py) call each mode
MODE_CODES: Final[dict[str, int]] = {mode: code for code, mode in enumerate(MODES)}
# mode -> (noise stream, whether the noise is redrawn every step); modes without noise are absent
# (torch-free on purpose: the command line imports this without importing torch)
STREAM_STOCHASTIC: Final = 1  # stream tags keep the noise of different modes independent for one (seed, name)
STREAM_DITHER: Final = 2
NOISE_STREAMS: Final[dict[str, tuple[int, bool]]] = {
    "stochastic": (STREAM_STOCHASTIC, True),
    "dither": (STREAM_DITHER, False),
}


def uses_noise(mode: str) -> bool:
    return mode in NOISE_STREAMS


def noise_key(mode: str, *, seed: int, step: int, name: str) -> int:
    """The 32-bit stream key a noise mode hashes with at ``step`` (0 for modes without noise)."""
    from faircast_ds.cast.noise import stream_key

    if mode not in NOISE_STREAMS:
        return 0
    stream, per_step = NOISE_STREAMS[mode]
    return stream_key(seed=seed, step=step if per_step else 0, name=name, stream=stream)
