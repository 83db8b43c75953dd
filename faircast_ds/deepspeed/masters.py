"""The fp32 masters of a DeepSpeed checkpoint tag folder, one parameter at a time (DeepSpeed's own
``zero_to_fp32``, lazily): what ``faircast-ds inspect --checkpoint`` compares an export against."""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Callable

import torch


def reader(tag_dir: str) -> Callable[[str], torch.Tensor | None]:
    """name -> full fp32 master (None for a name the checkpoint lacks), read lazily from DeepSpeed's
    checkpoint files (a :data:`faircast_ds.tools.inspect.MastersReader`)."""
    tag_dir = os.path.abspath(tag_dir)
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs and zero_to_fp32 reports progress on stdout
        from deepspeed.utils.zero_to_fp32 import (
            get_fp32_state_dict_from_zero_checkpoint,
        )

        lazy = get_fp32_state_dict_from_zero_checkpoint(os.path.dirname(tag_dir), tag=os.path.basename(tag_dir),
                                                        lazy_mode=True)

    def get(name: str) -> torch.Tensor | None:
        t = lazy.get(name)
        return None if t is None else t.contiguous().detach()

    return get
