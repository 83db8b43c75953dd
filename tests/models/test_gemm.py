"""faircast_ds/models/gemm.py: bf16 linear layers as fp32 products rounded once to bf16, against float64."""
from __future__ import annotations

import pytest
import torch

from faircast_ds.models.gemm import Fp32AccumulatedLinear, use_fp32_accumulation

BF16 = torch.bfloat16


def _linear_f64(x, w, b):
    """The oracle: the same values in float64 through torch's own linear and autograd."""
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    b64 = None if b is None else b.double().requires_grad_()
    y = torch.nn.functional.linear(x64, w64, b64)
    return x64, w64, b64, y


def test_small_integers_are_exact_in_both_directions():
    """Integers small enough that every sum is exact in fp32 and in bf16: forward and every gradient equal
    float64's to the bit."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 4, (2, 5, 8), generator=g).to(BF16).requires_grad_()
    w = torch.randint(-3, 4, (6, 8), generator=g).to(BF16).requires_grad_()
    b = torch.randint(-3, 4, (6,), generator=g).to(BF16).requires_grad_()
    grad = torch.randint(-2, 3, (2, 5, 6), generator=g).to(BF16)
    y = Fp32AccumulatedLinear.apply(x, w, b)
    y.backward(grad)
    x64, w64, b64, y64 = _linear_f64(x.detach(), w.detach(), b.detach())
    y64.backward(grad.double())
    assert y.dtype == BF16 and torch.equal(y.double(), y64)
    assert torch.equal(x.grad.double(), x64.grad) and torch.equal(w.grad.double(), w64.grad)
    assert torch.equal(b.grad.double(), b64.grad)
    assert x.grad.dtype == w.grad.dtype == b.grad.dtype == BF16


@pytest.mark.parametrize("bias", [False, True])
def test_random_values_round_once_from_an_fp32_sum(bias):
    """Random values: every output and gradient is float64's result rounded to bf16, or its neighbour where
    the fp32 sum and the exact one round differently (a few in ten thousand)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, 64, generator=g).to(BF16).requires_grad_()
    w = torch.randn(48, 64, generator=g).to(BF16).requires_grad_()
    b = torch.randn(48, generator=g).to(BF16).requires_grad_() if bias else None
    grad = torch.randn(3, 7, 48, generator=g).to(BF16)
    y = Fp32AccumulatedLinear.apply(x, w, b)
    y.backward(grad)
    x64, w64, b64, y64 = _linear_f64(x.detach(), w.detach(), None if b is None else b.detach())
    y64.backward(grad.double())
    pairs = [(y, y64), (x.grad, x64.grad), (w.grad, w64.grad)] + ([(b.grad, b64.grad)] if bias else [])
    for got, exact in pairs:
        want = exact.to(BF16)
        ulp = (want.view(torch.int16).to(torch.int32) - got.view(torch.int16).to(torch.int32)).abs()
        assert int(ulp.max()) <= 1 and float((ulp > 0).float().mean()) < 0.01


def test_routes_bf16_linear_layers_only_and_leaves_their_outputs_as_bf16():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8, bias=False)).to(BF16)
    plain = torch.nn.Linear(4, 4)  # fp32: not routed
    assert use_fp32_accumulation(model) == 2 and use_fp32_accumulation(plain) == 0
    assert "forward" not in vars(plain)
    x = torch.randn(5, 16).to(BF16)
    y = model(x)
    manual = torch.nn.functional.linear(
        torch.relu(torch.nn.functional.linear(x.float(), model[0].weight.float(), model[0].bias.float()).to(BF16)
                   ).float(), model[2].weight.float()).to(BF16)
    assert y.dtype == BF16 and torch.equal(y, manual)
    y.float().sum().backward()
    assert model[0].weight.grad is not None and model[0].weight.grad.dtype == BF16
    with pytest.raises(TypeError, match="expects bf16 input and weight"):
        model[0](torch.randn(5, 16))
