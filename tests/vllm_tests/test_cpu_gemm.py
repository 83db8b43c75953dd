"""The engine's fp32-summed CPU GEMM (faircast_ds/vllm/cpu_gemm.py, ``FAIRCAST_VLLM_CPU_GEMM=fp32``), in process
against vLLM's own dispatcher module: what a layer computes (against float64 sums of the same bf16 values),
that it reads the live weight at every call, that only 2-D bf16 matrices are taken, and that a bad value is
named. The real engine with it (``vllm serve`` holding the pushed bits, read back through these products, and
answering through the chat template): tests/models/test_pretrained.py's smoke launch."""
from __future__ import annotations

import pytest
import torch

from faircast_ds.vllm import cpu_gemm

utils = pytest.importorskip("vllm.model_executor.layers.utils", reason="setup installs vLLM (launch/setup.d)")


@pytest.fixture
def vllm_dispatch(monkeypatch):
    """vLLM's dispatcher replaced by a recorder (restored after the test), so install() wraps a known original."""
    calls = []

    def original(layer, remove_weight):
        calls.append((layer, remove_weight))
        layer.cpu_linear = "vllm's own"

    monkeypatch.setattr(utils, "dispatch_cpu_unquantized_gemm", original)
    return calls


def layer_with(weight: torch.Tensor) -> torch.nn.Module:
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    return layer


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 at each value of ``x`` (float64): 2^(exponent - 7)."""
    return torch.ldexp(torch.ones_like(x), torch.frexp(x.abs().clamp_min(2.0 ** -126))[1] - 8)


def check_against_float64(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """Each output within one bf16 spacing of the exact sum plus what n fp32 additions can lose (at most
    n * 2^-24 of the sum of the terms' magnitudes): an output that cancels to far below its terms may be off by
    more than its own spacing in any fp32 order of sums (seen on an AVX-512 CPU: 4.2e-5 from terms summing to ~18)."""
    exact = x.double() @ w.double().T + (0 if b is None else b.double())  # bf16 products and sums, exact in float64
    magnitude = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    fp32_sums = (x.shape[-1] + 1) * 2.0 ** -24 * magnitude
    assert out.dtype == torch.bfloat16
    err = (out.double() - exact).abs()
    assert bool((err <= bf16_ulp(exact.abs() + fp32_sums) + fp32_sums).all()), \
        "an output is more than one bf16 spacing (and the fp32 sums' bound) from the exact sum"
    nearest = exact.to(torch.bfloat16)
    assert float((out == nearest).double().mean()) > 0.995  # fp32 sums: the exact sum's bf16 almost always


@pytest.mark.parametrize("value, want", [(None, "native"), ("native", "native"), ("fp32", "fp32"), (" ", "native")])
def test_the_choice_is_read_from_the_environment(value, want):
    env = {} if value is None else {cpu_gemm.ENV: value}
    assert cpu_gemm.chosen(env) == want


def test_a_bad_choice_names_the_variable_and_the_choices(vllm_dispatch):
    with pytest.raises(ValueError, match=r"FAIRCAST_VLLM_CPU_GEMM='bf16': choose from native, fp32"):
        cpu_gemm.install({cpu_gemm.ENV: "bf16"})


def test_native_leaves_vllms_dispatch_alone(vllm_dispatch):
    before = utils.dispatch_cpu_unquantized_gemm
    assert cpu_gemm.install({}) is False and cpu_gemm.install({cpu_gemm.ENV: "native"}) is False
    assert utils.dispatch_cpu_unquantized_gemm is before


def test_fp32_computes_bf16_products_from_fp32_sums_of_the_live_weight(vllm_dispatch, capsys):
    assert cpu_gemm.install({cpu_gemm.ENV: "fp32"}) is True
    assert "FAIRCAST_VLLM_CPU_GEMM=fp32" in capsys.readouterr().err  # the engine's log says so
    assert cpu_gemm.install({cpu_gemm.ENV: "fp32"}) is True  # idempotent: wrapped once
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 576, generator=g) * 0.05).bfloat16()
    b = (torch.randn(96, generator=g) * 0.1).bfloat16()
    layer = layer_with(w.clone())
    utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    assert vllm_dispatch == []  # a 2-D bf16 matrix: taken here, vLLM's dispatch not asked
    assert layer.weight.shape == (96, 576)  # kept: the kernel reads it live, nothing packed
    x = torch.randn(16, 576, generator=g).bfloat16()
    check_against_float64(layer.cpu_linear(x, layer.weight, b), x, w, b)
    check_against_float64(layer.cpu_linear(x, layer.weight, None), x, w, None)
    # a reload or an in-place delta writes the weight: the next product uses the new values
    layer.weight.data[7] = (torch.randn(576, generator=g) * 0.05).bfloat16()
    out = layer.cpu_linear(x, layer.weight, None)
    check_against_float64(out, x, layer.weight.data, None)
    assert not torch.equal(out[:, 7], (x.double() @ w[7].double()).to(torch.bfloat16))


@pytest.mark.parametrize("weight", [torch.zeros(8, 4), torch.zeros(8, 1, 4, dtype=torch.bfloat16)],
                         ids=["fp32-matrix", "3-d-bf16"])
def test_other_weights_keep_vllms_dispatch(vllm_dispatch, weight):
    cpu_gemm.install({cpu_gemm.ENV: "fp32"})
    layer = layer_with(weight)
    utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    assert [(lay, rw) for lay, rw in vllm_dispatch] == [(layer, True)] and layer.cpu_linear == "vllm's own"


def test_a_rows_bits_do_not_depend_on_the_rows_beside_it():
    """The row computed alone is the oracle: in any batch (1 to 608 rows: decode batches and a prefill of 16 prompts), at any
    position, beside any other rows, at 1 and 2 threads, the row's output is the same to the bit."""
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(1536, 576, generator=g) * 0.05).bfloat16()
    b = (torch.randn(1536, generator=g) * 0.1).bfloat16()
    row = torch.randn(1, 576, generator=g).bfloat16()
    alone = cpu_gemm.linear(row, w, b)[0]
    check_against_float64(alone[None], row, w, b)
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            for rows in (2, 7, 16, 17, 40, 608):
                for at in (0, rows // 2, rows - 1):
                    batch = torch.randn(rows, 576, generator=g).bfloat16()
                    batch[at] = row[0]
                    out = cpu_gemm.linear(batch, w, b)
                    assert out.shape == (rows, 1536)
                    assert torch.equal(out[at], alone), (n_threads, rows, at)
            three_d = torch.randn(3, 5, 576, generator=g).bfloat16()
            three_d[1, 2] = row[0]
            assert torch.equal(cpu_gemm.linear(three_d, w, b)[1, 2], alone)  # [batch, tokens, hidden] too
    finally:
        torch.set_num_threads(threads)
    assert cpu_gemm.linear(torch.empty(0, 576, dtype=torch.bfloat16), w, b).shape == (0, 1536)


def test_the_weights_blocks_give_the_whole_weights_bits():
    """linear converts the weight WEIGHT_ROWS output rows at a time. The oracle, written here: each block of ROWS
    input rows times the whole weight in fp32 (what linear did before), rounded once. SmolLM2's shapes as vLLM
    holds them (fused qkv 960 = 512 + 448, o_proj 576 = 512 + 64, gate/up 3072, down 576 x 1536), a head-like
    3000 rows, decode batches (and a prefill of 608 rows on one shape), with and without a bias, at 1 and 2
    threads: the same to the bit."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(2)
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            for n_out, n_in in ((960, 576), (576, 576), (3072, 576), (576, 1536), (3000, 576)):
                w = (torch.randn(n_out, n_in, generator=g) * 0.05).bfloat16()
                b = (torch.randn(n_out, generator=g) * 0.1).bfloat16()
                for rows in (16, 37) + ((608,) if n_out == 960 else ()):
                    x = torch.randn(rows, n_in, generator=g).bfloat16()
                    padded = torch.cat([x.float(), torch.zeros(-rows % 16, n_in)])
                    for bias in (None, b):
                        whole = torch.cat([F.linear(padded[i:i + 16], w.float(), None if bias is None else bias.float())
                                           for i in range(0, padded.shape[0], 16)])[:rows].bfloat16()
                        got = cpu_gemm.linear(x, w, bias)
                        assert torch.equal(got, whole), (n_threads, n_out, n_in, rows, bias is None)
            assert cpu_gemm.WEIGHT_ROWS < 960  # the shapes above do span several blocks
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------- the fp32 copies (FAIRCAST_VLLM_CPU_GEMM_CACHE)

FP32_KEEP = {cpu_gemm.ENV: "fp32", cpu_gemm.CACHE_ENV: "1"}


@pytest.mark.parametrize("env, want", [({}, False), ({cpu_gemm.CACHE_ENV: "0"}, False), (FP32_KEEP, True),
                                       ({cpu_gemm.ENV: "fp32", cpu_gemm.CACHE_ENV: " "}, False)])
def test_the_copies_choice_is_read_from_the_environment(env, want):
    assert cpu_gemm.copies_chosen(env) is want


@pytest.mark.parametrize("env, message", [
    ({cpu_gemm.ENV: "fp32", cpu_gemm.CACHE_ENV: "yes"}, r"FAIRCAST_VLLM_CPU_GEMM_CACHE='yes': 1 \(keep"),
    ({cpu_gemm.CACHE_ENV: "1"}, r"FAIRCAST_VLLM_CPU_GEMM_CACHE=1 .* needs FAIRCAST_VLLM_CPU_GEMM=fp32, not 'native'"),
])
def test_a_bad_copies_choice_names_the_variable(env, message, vllm_dispatch):
    with pytest.raises(ValueError, match=message):
        cpu_gemm.install(env)


@pytest.fixture
def worker_rpc(monkeypatch):
    """vLLM's own multiprocess worker RPC step (``WorkerProc._execute_worker_rpc``), restored after the test, run on
    a stand-in process holding a stand-in worker: what install() wraps is vLLM's code."""
    from vllm.v1.executor import multiproc_executor

    proc_cls = multiproc_executor.WorkerProc
    monkeypatch.setattr(proc_cls, "_execute_worker_rpc", proc_cls._execute_worker_rpc)  # restored afterwards
    monkeypatch.setattr(cpu_gemm, "COPIES", cpu_gemm.WeightCopies())

    class Proc:
        rank = 0

        def __init__(self, worker):
            self.worker, self.outputs = worker, []

        def handle_output(self, output):
            self.outputs.append(output)

        def call(self, method, *args):
            proc_cls._execute_worker_rpc(self, (method, args, {}, None))
            out = self.outputs.pop()
            if isinstance(out, Exception):
                raise out
            return out

    return Proc


def test_a_worker_keeps_fp32_copies_between_forwards_and_drops_them_at_any_other_call(vllm_dispatch, worker_rpc):
    """Oracle: float64 sums of the weight the layer holds when the forward runs, and the uncached linear's bits.
    A forward (execute_model, sample_tokens) uses the copies and keeps them; any other call to the worker
    (a weight update by name, a pickled function) drops them before it runs, so the next forward
    computes with the weights as they are then. A write that bypasses the worker's calls is not seen: that is
    the copies being used, and why a process that is not a multiprocess worker never arms them."""
    import cloudpickle

    assert cpu_gemm.install(FP32_KEEP) is True
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(960, 576, generator=g) * 0.05).bfloat16()  # two weight blocks: 512 + 448 rows
    layer = layer_with(w.clone())
    utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    x = torch.randn(16, 576, generator=g).bfloat16()

    class Worker:
        def execute_model(self, x):
            return layer.cpu_linear(x, layer.weight, None)

        def sample_tokens(self, x):
            return layer.cpu_linear(x, layer.weight, None)

        def update_weights(self, row, values):
            layer.weight.data[row] = values

    proc = worker_rpc(Worker())
    copies = cpu_gemm.COPIES
    first = proc.call("execute_model", x)
    check_against_float64(first, x, w, None)
    assert torch.equal(first.view(torch.int16), cpu_gemm.linear(x, w).view(torch.int16))  # the same bits
    assert (copies.fills, copies.hits, copies.armed) == (1, 0, False) and copies.nbytes == w.numel() * 4
    assert torch.equal(proc.call("sample_tokens", x), first) and (copies.fills, copies.hits) == (1, 1)
    assert torch.equal(layer.cpu_linear(x, layer.weight, None), first) and copies.hits == 1  # outside a call: live

    new_row = (torch.randn(576, generator=g) * 0.05).bfloat16()
    layer.weight.data[7] = new_row  # behind the worker's back: the forward still has the old row's copy
    assert torch.equal(proc.call("execute_model", x), first)
    layer.weight.data[7] = w[7]

    proc.call("update_weights", 7, new_row)  # a call by name: dropped
    assert copies.nbytes == 0 and copies.drops >= 1
    now = w.clone()
    now[7] = new_row
    second = proc.call("execute_model", x)
    check_against_float64(second, x, now, None)
    assert not torch.equal(second[:, 7], first[:, 7]) and torch.equal(second[:, :7], first[:, :7])

    other = (torch.randn(576, generator=g) * 0.05).bfloat16()
    proc.call(cloudpickle.dumps(lambda worker: worker.update_weights(900, other)))  # a pickled function: dropped
    now[900] = other
    third = proc.call("execute_model", x)
    check_against_float64(third, x, now, None)
    assert not torch.equal(third[:, 900], second[:, 900])

    with pytest.raises(RuntimeError, match="batch2 tensor"):  # a forward that fails (vLLM's step reports it): unarmed after
        proc.call("execute_model", torch.zeros(16, 5).bfloat16())
    assert copies.armed is False


def test_a_forward_that_raises_leaves_the_copies_unarmed():
    copies = cpu_gemm.WeightCopies()
    with pytest.raises(ValueError, match="inside"):
        with copies.during("execute_model"):
            assert copies.armed
            raise ValueError("inside")
    assert copies.armed is False
    with copies.during("update_weights"):
        assert copies.armed is False


def test_without_the_variable_a_worker_keeps_no_copies(vllm_dispatch, worker_rpc):
    cpu_gemm.install({cpu_gemm.ENV: "fp32"})
    layer = layer_with((torch.randn(64, 576) * 0.05).bfloat16())
    utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)

    class Worker:
        def execute_model(self, x):
            return layer.cpu_linear(x, layer.weight, None)

    x = torch.randn(16, 576).bfloat16()
    first = worker_rpc(Worker()).call("execute_model", x)
    layer.weight.data[3] = 0.5
    assert not torch.equal(worker_rpc(Worker()).call("execute_model", x)[:, 3], first[:, 3])  # read live
    assert cpu_gemm.COPIES.fills == 0
