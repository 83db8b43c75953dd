"""A fault for the ``vllm serve`` processes of tests/vllm_tests/transfer/test_vllm_faults.py: a kernel that
computes with other bits than the engine received. On PYTHONPATH of the server only (the test's engine
fixture), active when ``FAIRCAST_TEST_KERNEL_FAULT`` names a flag file: once the ``faircast`` backend has
loaded a set of layers, and while the flag file exists and names a vLLM parameter among them, that
parameter's first element is moved by 1.0 — after the load, before the backend's check. A flag
``<vLLM name>@<row>,<column>`` naming a linear layer instead makes its kernel compute as if element
(row, column) were 1.0 larger (the layer's ``quant_method.apply`` adds ``x[..., column]`` to output
``row``), while the flag file exists: one element in one column, the fault a sampled check finds only
if it reads that column (``lm_head.weight@<row>,<column>`` faults a tied LM head's kernel once a load
carried the embedding). A flag ``fail-reload`` makes the backend's call of vLLM's reload raise (called
on every load, after the load's in-place writes), while the flag file exists. Test code only: the
product has no such hook."""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

_FLAG = os.environ.get("FAIRCAST_TEST_KERNEL_FAULT")
_MODULE = "faircast_ds.vllm.transfer.engine"


def _patch(module) -> None:
    import torch

    cls = module.FairCastWeightTransferEngine
    load = cls._load

    def faulty_load(self, names, *args):
        load(self, names, *args)
        try:
            with open(_FLAG) as f:
                target = f.read().strip()
        except FileNotFoundError:
            return
        if "@" in target:
            name, _, at = target.partition("@")
            # a tied LM head ("lm_head.weight@...") computes with the embedding, which is what a load names
            if name in names or (name == "lm_head.weight" and "model.embed_tokens.weight" in names):
                _fault_element(self.model.get_submodule(name.rpartition(".")[0]))
        elif target in names:
            with torch.no_grad():
                dict(self.model.named_parameters())[target].data.view(-1)[0] += 1.0

    cls._load = faulty_load
    reload = cls._reload

    def failing_reload(self, names):
        # "fail-reload": vLLM's reload fails, after the load wrote whatever it writes in place
        try:
            with open(_FLAG) as f:
                target = f.read().strip()
        except FileNotFoundError:
            target = ""
        if target == "fail-reload":
            raise RuntimeError("kernel_fault: vLLM's reload failed")
        reload(self, names)

    cls._reload = failing_reload


def _fault_element(module) -> None:
    """Wrap ``module``'s kernel once: while the flag names it with ``@row,column``, output ``row`` gains
    input ``column`` (its weight read as 1.0 larger at that element)."""
    method = module.quant_method
    if getattr(method, "_faircast_fault", None) is not None:
        return
    apply = method.apply

    def faulty_apply(layer, x, bias=None):
        out = apply(layer, x, bias)
        try:
            with open(_FLAG) as f:
                target = f.read().strip()
        except FileNotFoundError:
            return out
        if layer is not module or "@" not in target:
            return out
        row, column = (int(v) for v in target.partition("@")[2].split(","))
        out = out.clone()
        out[..., row] += x[..., column].to(out.dtype)
        return out

    method._faircast_fault = faulty_apply
    method.apply = faulty_apply


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if _FLAG:
    sys.meta_path.insert(0, _Finder())
