"""Push the served weights into a vLLM engine the trainer holds, and check what the engine computes with.

:class:`WeightPush` reads the served weights through one walk of the served-weight source
(:class:`faircast_ds.export.source.ServedSource`; under ZeRO-3 one bf16 gather per parameter
walked, never fp32): a dense walk the first time, then a delta walk that visits only the parameters
whose bits changed since the last acknowledged push, each with its whole packed group, since vLLM
rebuilds a fused layer (``qkv_proj``, ``gate_up_proj``) from all of its parts. The digests the
verification expects are computed in the same walk (those of parameters the walk skips are the
acknowledged push's). After the push it reads every parameter back from the engine's kernels
(:mod:`faircast_ds.vllm.colocated.worker`) and compares digests of the canonical bits
(:mod:`faircast_ds.vllm.bits`) with the served ones; any difference raises
:class:`EngineWeightsMismatch` on every rank, and the next push is dense.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from faircast_ds._util.dist import from_rank0, rank_world
from faircast_ds.export.source import ServedItem, ServedReport, ServedSource
from faircast_ds.vllm.bits import digest
from faircast_ds.vllm.fused import packed_groups
from faircast_ds.vllm.engine_weights import TIED_EMBEDDING, TIED_HEAD, EngineWeightsMismatch


class WeightPush:
    """The trainer's end of a colocated engine. Construct and :meth:`push` on every rank; ``engine``
    is the :class:`~faircast_ds.vllm.colocated.inference.VllmEngine` on rank 0 and None elsewhere.

    ``delta``: after the first push, hand over only changed groups. ``verify``: read everything
    back after each push and raise :class:`EngineWeightsMismatch` unless it equals the served bits.
    ``batch_bytes``: how many bytes of served tensors rank 0 stages per engine call (whole groups).
    """

    def __init__(self, model: Any, engine: Any | None, *, delta: bool = True, verify: bool = True,
                 batch_bytes: int = 64 << 20, source: ServedSource | None = None) -> None:
        self.model = model
        self.rank, self.world = rank_world()
        if self.rank == 0 and engine is None:
            raise ValueError("WeightPush needs the engine on rank 0")
        self.engine = engine if self.rank == 0 else None
        self.delta, self.verify, self.batch_bytes = delta, verify, int(batch_bytes)
        self.source = source if source is not None else ServedSource(model, delta=delta)
        self.specs = self.source.specs
        names = [s.name for s in self.specs]
        groups = packed_groups(names, self.engine.info["packed"]) if self.engine is not None else None
        self.groups: dict[str, tuple[str, ...]] = from_rank0(groups)  # a delta walk's groups: alike on every rank
        # a head tied to the embedding is checked through its own kernel, as the embedding's bits
        embedding = next((s for s in self.specs if s.name == TIED_EMBEDDING), None)
        tied = self.engine is not None and bool(self.engine.info.get("tied_head")) and TIED_HEAD not in names
        self.checked: list[tuple[str, Any]] = [(s.name, s.shape) for s in self.specs]
        self.tied_head = from_rank0(tied and embedding is not None)
        if self.tied_head:
            self.checked.append((TIED_HEAD, embedding.shape))
        self._expected: dict[str, str] = {}  # rank 0: canonical digests of the acknowledged push
        self._expected_complete = False  # every rank: whether _expected covers every parameter
        self.last_walk = None
        self.pushes = 0

    @property
    def _acked(self) -> bool:
        return self.source.acknowledged is not None

    def push(self, version: int | None = None, *, verify: bool | None = None, kind: str = "auto") -> ServedReport:
        """Hand the served weights to the engine (a collective under ZeRO-3). ``kind``: ``auto`` (delta
        when a previous push succeeded and ``delta`` is on), ``dense`` or ``delta``."""
        if kind not in ("auto", "dense", "delta"):
            raise ValueError(f"kind must be 'auto', 'dense' or 'delta', not {kind!r}")
        if kind == "delta" and not (self.delta and self._acked):  # decided alike on every rank, before the walk
            raise ValueError("a delta push needs delta=True and a previous successful push")
        if version is None:
            version = getattr(self.model, "global_steps", None)
        verify = self.verify if verify is None else verify
        digests = verify or self.verify  # kept for the pushes after this one when the push verifies by default
        if verify and not self._expected_complete:
            kind = "dense"  # the digests of parameters a delta skips are unknown: walk them all
        walk = self.source.walk("dense" if kind == "dense" or not self.delta else "auto", groups=self.groups,
                                version=version)
        self.last_walk = walk
        state = _RankZeroPush(self, walk.kind == "dense", verify, digests) if self.engine is not None else None
        for item in walk:  # every rank walks it: ZeRO-3 gathers are collectives
            if state is not None:
                state.see(item)
        outcome = state.finish() if state is not None else None
        outcome = from_rank0(outcome)
        if outcome["error"] is not None:
            walk.abort()
            self.source.require_dense()  # the engine may hold part of this push: the next one is whole
            self._expected_complete = False
            raise EngineWeightsMismatch(outcome["error"], outcome["mismatched"])
        walk.acknowledge()
        self._expected_complete = digests and (walk.kind == "dense" or self._expected_complete)
        self.pushes += 1
        return walk.report(bytes=outcome["bytes"], params=outcome["params"], elements=outcome["elements"],
                           load_seconds=outcome["load_seconds"], verify_seconds=outcome["verify_seconds"],
                           verified=outcome["verified"], mismatched=outcome["mismatched"])


class _RankZeroPush:
    """Rank 0's state during one push: staged groups, digests, the engine calls."""

    def __init__(self, owner: WeightPush, dense: bool, verify: bool, digests: bool) -> None:
        self.owner, self.verify, self.digests, self.dense = owner, verify, digests, dense
        self.fresh: dict[str, str] = {}
        self.waiting: dict[tuple[str, ...], dict[str, torch.Tensor]] = {}
        self.batch: list[tuple[str, torch.Tensor]] = []
        self.batch_size = 0
        self.params = self.elements = self.bytes = 0
        self.load_seconds = 0.0
        self.error: str | None = None

    def see(self, item: ServedItem) -> None:
        if self.error is not None:
            return  # keep walking with the other ranks; reported at the end
        try:
            self._see(item.name, item.tensor)
        except Exception as exc:  # noqa: BLE001 - reported on every rank
            self.error = f"staging {item.name}: {type(exc).__name__}: {exc}"

    def _see(self, name: str, tensor: torch.Tensor) -> None:
        if self.digests:  # canonical digests: what the verification compares, now or after a later delta
            self.fresh[name] = digest(tensor)
            if name == TIED_EMBEDDING and self.owner.tied_head:
                self.fresh[TIED_HEAD] = self.fresh[name]  # a tied head computes with the same bits
        group = self.owner.groups.get(name, (name,))
        if len(group) == 1:
            self._stage([(name, tensor.detach().clone())])
            return
        members = self.waiting.setdefault(group, {})
        members[name] = tensor.detach().clone()  # valid only until the walk advances
        if len(members) < len(group):
            return
        del self.waiting[group]
        self._stage([(m, members[m]) for m in group])

    def _stage(self, items: list[tuple[str, torch.Tensor]]) -> None:
        for name, t in items:
            self.batch.append((name, t))
            size = t.numel() * t.element_size()
            self.batch_size += size
            self.params += 1
            self.elements += t.numel()
            self.bytes += size
        if self.batch_size >= self.owner.batch_bytes:
            self._flush()

    def _flush(self) -> None:
        if self.batch and self.error is None:
            try:
                self.load_seconds += self.owner.engine.reload(self.batch)
            except Exception as exc:  # noqa: BLE001 - reported on every rank
                self.error = f"the engine refused the weights: {type(exc).__name__}: {exc}"
        self.batch, self.batch_size = [], 0

    def finish(self) -> dict[str, Any]:
        if self.waiting and self.error is None:
            incomplete = sorted(n for g in self.waiting for n in g if n not in self.waiting[g])
            self.error = f"packed groups incomplete after the walk: missing {incomplete[:5]}"
        self._flush()
        engine = self.owner.engine
        mismatched: list[str] = []
        verified, verify_seconds = None, 0.0
        expected = self.fresh if self.dense else {**self.owner._expected, **self.fresh}
        if self.error is None:
            engine.reset_prefix_cache()
            if self.verify:
                t0 = time.perf_counter()
                checked = self.owner.checked
                got = engine.digests(checked)
                mismatched = [n for n, _ in checked if got.get(n) != expected.get(n)]
                verify_seconds = time.perf_counter() - t0
                verified = not mismatched
                if mismatched:
                    detail = "; ".join(f"{n}: {got.get(n, 'missing')[:60]}" for n in mismatched[:5])
                    self.error = (f"after the push the engine computes with other bits than the served ones in "
                                  f"{len(mismatched)} of {len(checked)} parameter(s) (canonical bits: "
                                  f"-0.0 and subnormals count as +0): {detail}")
        if self.error is None:
            self.owner._expected = expected if self.digests else {}
        return {"error": self.error, "mismatched": mismatched, "kind": "dense" if self.dense else "delta",
                "params": self.params, "elements": self.elements, "bytes": self.bytes,
                "load_seconds": self.load_seconds, "verify_seconds": verify_seconds, "verified": verified}
