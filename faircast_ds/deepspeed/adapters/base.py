"""What every DeepSpeed adapter says about its optimizer: the ZeRO stage it shards at."""
from __future__ import annotations

from faircast_ds.shard.adapter import Adapter, Setup


class ZeroAdapter(Adapter):
    """A DeepSpeed optimizer's adapter: ``zero_stage`` is set by each subclass (BF16_Optimizer: 1)."""

    zero_stage: int

    @property
    def setup(self) -> Setup:
        """``zero_stage=N``: what the banner prints and the state file records (the load's completeness
        check reads it: ``faircast_ds.deepspeed.checkpoint.incomplete``)."""
        return Setup.of(zero_stage=self.zero_stage)
