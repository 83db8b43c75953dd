"""What a framework served and what its forward multiplied by, recorded for the framework tests.

The framework tests (tests/transformers_tests/test_frameworks.py, tests/deepspeed_tests/test_activation.py) check that the served bf16
bits of every element are ``cast(master, mode, seed, step)`` computed by an oracle, and that the
weights the framework's forward (and generation) used are those served bits. This module only
records, through DeepSpeed's and torch's own interfaces, never through Fair Cast's:

- :func:`snapshot`: per parameter, the fp32 master as DeepSpeed's optimizer holds it
  (``deepspeed.utils.safe_get_full_fp32_param``: its fp32 partitions, all-gathered) and the served
  bf16 bits (the parameter gathered by ``deepspeed.zero.GatheredParameters``);
- :class:`ForwardTap`: forward hooks on every ``nn.Linear`` that keep the weight bits each call
  multiplied by (and check that the call's output is that weight's product, so the kept weight is
  the one used), keyed by the framework's step and the phase (training, generation, other).

Nothing here compares against a cast: the pytest side does, with its own oracle.
"""
from __future__ import annotations

from typing import Any, Callable

import torch


def _gathered_bits(module: Any, to_bf16: bool) -> dict[str, torch.Tensor]:
    import deepspeed

    params = dict(module.named_parameters())
    bits = {}
    with deepspeed.zero.GatheredParameters(list(params.values())):  # a no-op for parameters ZeRO-3 does not hold
        for n, p in params.items():
            w = p.detach().reshape(-1)
            if to_bf16:
                w = w.to(torch.bfloat16)
            elif w.dtype != torch.bfloat16:
                raise TypeError(f"{n}: served as {w.dtype}, not bf16")
            bits[n] = w.view(torch.int16).clone().cpu()
    return bits


def served(module: Any) -> dict[str, torch.Tensor]:
    """The served bf16 bits of every parameter of ``module`` (a ZeRO-3 engine's module), gathered. A
    collective: call it on every rank."""
    return _gathered_bits(module, to_bf16=False)


def initial_bits(module: Any) -> dict[str, torch.Tensor]:
    """The bf16 bits of every parameter of a model before DeepSpeed's engine wraps it (gathered when a
    ``zero.Init`` built it partitioned; rounded to nearest by torch when it is not bf16, as the
    engine's bf16 conversion does). A collective when partitioned."""
    return _gathered_bits(module, to_bf16=True)


def snapshot(module: Any, step: int, **extra: Any) -> dict[str, Any]:
    """Masters and served bits of every parameter of ``module`` (a DeepSpeed engine's module), with
    ``step`` as the framework counts its optimizer steps. A collective: call it on every rank."""
    from deepspeed.utils import safe_get_full_fp32_param

    params = dict(module.named_parameters())
    bits = served(module)
    masters: dict[str, torch.Tensor | None] = {}
    for n, p in params.items():  # one all-gather per trainable parameter, in the same order on every rank
        full = safe_get_full_fp32_param(p) if p.requires_grad else None
        masters[n] = None if full is None else full.detach().reshape(-1).float().clone().cpu()
    return {"step": step, "served": bits, "master": masters, **extra}


class ForwardTap:
    """Forward hooks (put ahead of DeepSpeed's, which release ZeRO-3's gathered weights) on every
    ``nn.Linear`` of ``model``: for each (step, phase, layer), the weight bits of the first call, how
    many calls there were, and the calls whose weight differed from the first one's, whose weight was
    not gathered, or whose output is not ``F.linear`` of the call's input with the weight kept."""

    def __init__(self, model: Any, step: Callable[[], int], phase: Callable[[], str] | None = None,
                 prefix: str = "") -> None:
        self.step = step
        self.phase = phase or (lambda: "train" if torch.is_grad_enabled() else "no_grad")
        self.weights: dict[str, torch.Tensor] = {}
        self.calls: dict[str, int] = {}
        self.problems: list[str] = []
        self.handles = []
        for name, m in model.named_modules():
            if isinstance(m, torch.nn.Linear):
                self.handles.append(m.register_forward_hook(self._hook(prefix + name), prepend=True))
        if not self.handles:
            raise ValueError("ForwardTap: the model has no nn.Linear")

    def _hook(self, layer: str):
        def hook(module: Any, args: tuple, output: torch.Tensor) -> None:
            key = f"{self.step()}/{self.phase()}/{layer}.weight"  # the phase first: it reads the grad mode
            with torch.no_grad():
                self._keep(key, module, args, output)
        return hook

    def _keep(self, key: str, module: Any, args: tuple, output: torch.Tensor) -> None:
        w = module.weight.detach()
        self.calls[key] = self.calls.get(key, 0) + 1
        if w.numel() != int(getattr(module.weight, "ds_numel", w.numel())) or w.dim() != 2:
            self.problems.append(f"{key}: the weight was not gathered during forward ({tuple(w.shape)})")
            return
        if not torch.equal(output, torch.nn.functional.linear(args[0], w, module.bias)):
            self.problems.append(f"{key}: the output is not the product with the weight seen in forward")
        bits = w.reshape(-1).view(torch.int16).clone().cpu()
        first = self.weights.setdefault(key, bits)
        if not torch.equal(first, bits):
            self.problems.append(f"{key}: the weight changed between calls of one step and phase")

    def record(self) -> dict[str, Any]:
        return {"weights": self.weights, "calls": self.calls, "problems": self.problems}

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
