"""The Hugging Face integration (transformers Trainer, TRL, PEFT): what users of those frameworks add.

- ``FairCastCallback`` / ``add_callback(trainer)``: Fair Cast's diagnostics in the Trainer's logs
  (``callback.py``), so they reach W&B, TensorBoard and ``log_history`` as the user configured them.
- ``install_lora_merge(model, ...)``: PEFT LoRA merges through the configured cast (``lora.py``).

Activation itself needs nothing from here: HF Trainer and TRL build their DeepSpeed engines through
``deepspeed.initialize``, which the interpreter-start hook watches (docs/integrations.md).
"""
from __future__ import annotations

from faircast_ds._util import lazy

_LAZY = {
    "FairCastCallback": "faircast_ds.transformers.callback",
    "add_callback": "faircast_ds.transformers.callback",
    "find_handle": "faircast_ds.transformers.callback",
    "install_lora_merge": "faircast_ds.transformers.lora",
    "lora_layers": "faircast_ds.transformers.lora",
}

__all__ = sorted(_LAZY)


__getattr__ = lazy.exports(__name__, _LAZY, globals())
