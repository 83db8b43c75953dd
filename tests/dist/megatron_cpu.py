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
