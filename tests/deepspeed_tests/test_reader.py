"""DeepSpeed hands export its served-weight reader (faircast_ds/deepspeed/reader.py) when it attaches: one
process, no launch. A stand-in engine whose module holds ZeRO-3-shaped parameters (empty data, ``ds_*``
attributes): unread by export until the attach provides the reader, then read at full shape under the
engine and under its module; each rank's pieces are Fair Cast's adapter's shard, or refused without it."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from stand_ins import TwoGroups

from faircast_ds.config.section import FairCastConfig
from faircast_ds.export.source import ModelReader, ServedSource, reader_of, served_specs
from faircast_ds.shard.caster import ShardCaster
from faircast_ds.shard import routes
from faircast_ds.shard.handle import ATTR, FairCast

SHAPES = {"w": (6, 4), "b": (6,)}


class Partitioned(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        for i, (name, shape) in enumerate(SHAPES.items()):
            p = torch.nn.Parameter(torch.empty(0, dtype=torch.bfloat16))
            p.ds_id, p.ds_shape, p.ds_numel = i, torch.Size(shape), int(torch.Size(shape).numel())
            self.register_parameter(name, p)


class Engine(torch.nn.Module):
    """What attach reads of a DeepSpeed engine that never trains (no optimizer: attach stops there)."""

    def __init__(self) -> None:
        super().__init__()
        self.module = Partitioned()
        self.optimizer = None
        self._config = SimpleNamespace(_param_dict={})


def test_export_reads_a_zero3_engine_through_the_reader_the_attach_provided(monkeypatch):
    from faircast_ds.deepspeed.attachment import attach
    from faircast_ds.deepspeed.reader import DeepSpeedReader

    monkeypatch.delenv("FAIRCAST_DS_CONFIG", raising=False)
    engine = Engine()
    with pytest.raises(ValueError, match="no integration provided a reader"):
        served_specs(engine)  # nothing attached: export reads a plain module and refuses the empty parameter
    assert attach(engine) is None  # no optimizer: not attached, but the reader is handed over all the same
    for holder in (engine, engine.module):
        reader = reader_of(holder)
        assert isinstance(reader, DeepSpeedReader)
        assert [(s.name, s.shape, s.dtype) for s in reader.specs] == [
            (n, shape, torch.bfloat16) for n, shape in SHAPES.items()]
        assert all(reader.is_gathered(i) for i in range(len(SHAPES)))
        with pytest.raises(ValueError, match="goes through Fair Cast's adapter"):
            reader.local_slices()
    assert reader_of(engine) is not reader_of(engine)  # one reader per source: each reads the model as it is then
    assert ServedSource(engine).can_delta is False  # ZeRO-3 without Fair Cast: dense walks only
    assert reader_of(engine).fair_cast_summary() is None


def test_with_fair_cast_a_ranks_pieces_are_its_adapters_shard():
    from faircast_ds.deepspeed.reader import DeepSpeedReader, provide

    engine = Engine()
    provide(engine)
    config = FairCastConfig.from_section({"mode": "stochastic", "seed": 3})
    adapter = TwoGroups(ShardCaster(config))
    setattr(engine, ATTR, FairCast(config=config, adapters=[adapter], route=routes.DEEPSPEED_RUNTIME))
    reader = reader_of(engine)
    assert isinstance(reader, DeepSpeedReader)
    slices = reader.local_slices()
    want = [(s.name, s.start, s.numel, s.offset) for _, _, _, group in adapter.flat_groups() for s in group
            if not s.is_padding]
    assert [(s.name, s.start, s.numel) for s in slices] == [(n, st, k) for n, st, k, _ in want]
    for s, (_, _, numel, offset), served in zip(slices, want, [adapter.served[0]] * 2 + [adapter.served[1]] * 40):
        assert s.values.data_ptr() == served[offset:offset + numel].data_ptr()  # read in place, at its offset
    assert reader.fair_cast_summary() == {"mode": "stochastic", "seed": 3, "step": adapter.caster.step}


def test_a_module_no_integration_attached_is_read_as_a_plain_module():
    model = torch.nn.Linear(3, 2)
    reader = reader_of(model)
    assert type(reader) is ModelReader and [s.name for s in reader.specs] == ["weight", "bias"]
    assert not reader.is_gathered(0) and sum(s.numel for s in reader.local_slices()) == 8
