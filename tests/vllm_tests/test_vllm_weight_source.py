"""Fair Cast's served weights as vLLM's trainer-side WeightSource (faircast_ds/vllm/weight_source.py), read by
vLLM's own consumer code; no engine is started."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow  # importing vLLM takes 40 s or more here

def test_the_served_weights_are_a_vllm_weight_source():
    """vLLM's own consumer code (WeightSource.iter_groups: layer groups, order checked against
    metadata()) reads Fair Cast's source; the bits equal those vLLM's ModuleSource reads from the same
    module, and an acknowledged round makes the source's next walk a delta."""
    pytest.importorskip("vllm")
    from vllm.distributed.weight_transfer.base import ModuleSource, WeightSource

    from faircast_bench.builders import tiny_qwen3
    from faircast_ds.vllm.weight_source import FairCastWeightSource

    model = tiny_qwen3(seed=0).to(torch.bfloat16)
    ours = FairCastWeightSource(model)
    theirs = ModuleSource(model)
    assert isinstance(ours, WeightSource) and ours.metadata() == theirs.metadata()
    reference = {n: t.detach().clone().view(-1).view(torch.int16) for n, t in theirs}
    groups = list(ours.iter_groups())
    assert len(groups) == len(ours.groups()) == 4  # embeddings, 2 layers, final norm + lm_head
    got = {n: t.view(-1).view(torch.int16) for names, tensors in groups for n, t in zip(names, tensors)}
    assert list(got) == list(reference) and all(torch.equal(got[n], reference[n]) for n in reference)
    ours.acknowledge()
    with torch.no_grad():
        model.model.norm.weight[0] += 0.5
    walk = ours.source.walk()
    assert walk.kind == "delta" and [i.name for i in walk] == ["model.norm.weight"]
