"""Stand-ins several test folders share: an adapter over two flat fp32/bf16 groups with the real ShardCaster."""
from __future__ import annotations

import torch

from faircast_ds.config.section import FairCastConfig
from faircast_ds.deepspeed.guard import Guard
from faircast_ds.shard.adapter import Adapter
from faircast_ds.shard.caster import ShardCaster, ShardSlice, with_padding

N = 4000


class TwoGroups(Adapter):
    """Two flat shards; the second holds many small parameters (more than one sampled check reads)."""

    def __init__(self, caster: ShardCaster) -> None:
        super().__init__(optimizer=object(), caster=caster, names={})
        gen = torch.Generator().manual_seed(0)
        self.masters = [torch.randn(N, generator=gen) * 0.05, torch.randn(N, generator=gen) * 0.05]
        self.served = [m.to(torch.bfloat16) for m in self.masters]
        self.slices = [with_padding([ShardSlice("big.w", 7, 3000, 10), ShardSlice("big.b", 0, 900, 3050)], N),
                       with_padding([ShardSlice(f"small.{i}", 0, 90, 100 * i) for i in range(40)], N)]

    def install(self) -> None:
        pass

    def flat_groups(self):
        for i in range(2):
            yield i, self.masters[i], self.served[i], self.slices[i]

    def publish(self) -> None:
        pass


def setup(mode: str = "stochastic") -> tuple[TwoGroups, Guard]:
    adapter = TwoGroups(ShardCaster(FairCastConfig(mode=mode, seed=3)))
    return adapter, Guard(adapter, describe_sites="the stand-in's sites")


def step(adapter: TwoGroups, g: Guard, *, full: bool) -> None:
    g.prepare(full=full)
    adapter.caster.begin_step()
    adapter.cast_all()


def overwrite(adapter: TwoGroups, group: int, start: int, stop: int) -> None:
    """What a moved cast site does: round-to-nearest over the served shard after the cast."""
    adapter.served[group][start:stop] = adapter.masters[group][start:stop].to(torch.bfloat16)
