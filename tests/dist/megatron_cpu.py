"""CPU stand-ins that let Megatron-Core 0.16.1's DDP and DistributedOptimizer run on a CPU-only torch.

Unmodified, the first build stops at
  megatron/core/distributed/param_and_grad_buffer.py:800, ``device=torch.cuda.current_device()``
  (``_ParamAndGradBuffer.__init__``), AssertionError: Torch not compiled with CUDA enabled;
with that one stood in, at
  megatron/core/optimizer/optimizer.py:485, ``torch.tensor([1.0], ..., device='cuda')``
  (``MixedPrecisionOptimizer.__init__``), the same AssertionError;
and with both stood in, at
  megatron/core/optimizer/distrib_optimizer.py:431 (``_build_model_and_main_param_groups``, whose
  checks at lines 361/420 accept only ``.type()`` ``torch.cuda.{Half,BFloat16,Float}Tensor``), TypeError:
  Wrapped parameters must be one of torch.cuda.FloatTensor,  torch.cuda.HalfTensor, or
  torch.cuda.BFloat16Tensor. Received torch.BFloat16Tensor

Megatron-Core 0.12.x without Transformer Engine also stops in its own main->model copy, at
  megatron/core/fp8_utils.py:302 (the no-TE fallback ``_quantize_param_shard_impl`` raises
  RuntimeError: Invalid Transformer Engine version for FP8 distributed optimizer, even when there is no
  fp8 parameter to quantize); 0.13.0 made that fallback return when the list is empty, which is what
  :func:`_empty_quantize_is_a_no_op` puts in for 0.12 (found by the fallback's signature, not the version).

None of these is on the cast path: the stand-ins only put CUDA tensors on the CPU and let the
parameter-type check see CPU tensors as their CUDA counterparts. The shard ranges, the main->model
copy, the reduce-scatter and the param all-gather (over gloo) are Megatron's own code.
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode


class _CudaOnCpu(TorchFunctionMode):
    """Rewrites ``device='cuda...'`` arguments of torch calls to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if device is not None and "cuda" in str(device):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def enable() -> None:
    if torch.cuda.is_available():
        return
    torch.cuda.current_device = lambda: torch.device("cpu")
    plain_type = torch.Tensor.type

    def cuda_type_name(self, *args, **kwargs):
        name = plain_type(self, *args, **kwargs)
        if not args and not kwargs and name.startswith("torch.") and not name.startswith("torch.cuda."):
            return "torch.cuda." + name[len("torch."):]
        return name

    torch.Tensor.type = cuda_type_name
    _CudaOnCpu().__enter__()
    _empty_quantize_is_a_no_op()


def _empty_quantize_is_a_no_op() -> None:
    """Megatron-Core 0.12's no-TE ``_quantize_param_shard_impl(*args, **kwargs)`` raises on every call; from
    0.13 it takes ``model_params`` first and returns when there are none. Put 0.13's behaviour in (no fp8
    parameter here: the list is always empty, and a non-empty one still raises)."""
    import inspect

    from megatron.core import fp8_utils

    impl = fp8_utils._quantize_param_shard_impl
    if getattr(fp8_utils, "HAVE_TE", False) or "model_params" in inspect.signature(impl).parameters:
        return

    def quantize(model_params, *args, **kwargs):
        if len(model_params) == 0:
            return
        impl(model_params, *args, **kwargs)

    fp8_utils._quantize_param_shard_impl = quantize
