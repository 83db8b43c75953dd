"""The CI-sized real-model run (driven by tests/system/test_realsize.py): Qwen3-0.6B's architecture cut to 2
layers (the real 151,936 x 1,024 tied embedding and widths, 187M parameters) built under
``deepspeed.zero.Init``, ZeRO-3 on 2 CPU ranks, AdamW, ``dither`` (the shipped default mode) with diagnostics on. Each rank
writes what it checked to OUT_DIR/rank<r>.json; the test asserts on it.

- build: every parameter is partitioned at construction, and each rank's partition holds the
  published init (normal, std 0.02, a function of (seed, name)) at its place in the parameter;
- after every step: this rank's served bits are cast(master) for every element of its shard, by an
  oracle written here from the rounding rule (float64 value comparisons, its own hash from the noise
  specification), itself checked on a sample against faircast_ds.casting.reference.cast_reference;
- the engine push: a receiver (its own tensors, a thread of rank 0, over the weight-sync channel) takes
  a dense push after step 1 and a delta push after step 2; its bits = the served bits, every element;
  the export (save_hf) of the last step holds the served bits too;
- resume: save after step 2, run step 3, load, run step 3 again: served bits, masters and the noise
  step equal bit for bit.
"""
from __future__ import annotations

import os
import resource
import sys
import threading
import time

import deepspeed
import deepspeed.comm as dist
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import finish_and_exit, write_json  # noqa: E402

from faircast_ds import get_fair_cast  # noqa: E402
from faircast_ds.export import WeightReceiver, WeightSender, save_hf, served_weights  # noqa: E402
from faircast_bench.zero_init import real_causal_lm  # noqa: E402
from faircast_bench.builders import _initial_values  # noqa: E402
from faircast_ds.models.gemm import use_fp32_accumulation  # noqa: E402
from faircast_ds.casting.reference import cast_reference  # noqa: E402

MODE, SEED, LAYERS = "dither", 4321, 2
STREAM = 2  # the dither stream of the noise specification (faircast_ds/casting/modes.py), keyed by step 0
# elements the oracle works on at once: its float64 temporaries (4 MiB each here) come back from glibc's heap and
# stay in cache; at 1 << 22 each was a fresh mmap, page-faulted again on every chunk (10x slower on 2 cores)
CHUNK = 1 << 19


# ---------------------------------------------------------------- the oracle (no product code)

def _mix32(x: np.ndarray) -> np.ndarray:
    """mix32 of the specification (faircast_ds/casting/noise.py's docstring), on uint64 arrays in [0, 2^32)."""
    m = np.uint64(0xFFFFFFFF)
    x = x ^ (x >> np.uint64(16))
    x = (x * np.uint64(0x21F0AAAD)) & m
    x = x ^ (x >> np.uint64(15))
    x = (x * np.uint64(0x735A2D97)) & m
    return x ^ (x >> np.uint64(15))


def _mix32_int(x: int) -> int:
    return int(_mix32(np.array([x & 0xFFFFFFFF], dtype=np.uint64))[0])


def _stream_key(seed: int, step: int, name: str, stream: int) -> int:
    h = 0x811C9DC5
    for byte in name.encode():
        h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
    k = _mix32_int(h)
    for word in (stream, seed & 0xFFFFFFFF, seed >> 32, step & 0xFFFFFFFF, step >> 32):
        k = _mix32_int(k ^ word)
    return k


def _magnitudes(bits16: np.ndarray) -> np.ndarray:
    """|value| of bf16 bit patterns as float64; Inf as 2^128 (where the next value would sit)."""
    v = np.abs((bits16.astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64))
    return np.where(np.isinf(v), 2.0**128, v)


def oracle_unbiased(master: np.ndarray, *, seed: int, step: int, name: str, start: int) -> np.ndarray:
    """Served bits (uint16) of ``dither`` (its noise keyed by step 0) for fp32 ``master`` = elements [start, ...) of ``name``:
    round |v| up to the next bf16 iff noise/65536 >= 1 - p, p = where |v| sits between its neighbours."""
    bits = master.view(np.uint32)
    lo = (bits >> np.uint32(16)).astype(np.uint32)  # sign and the magnitude truncated: the lower neighbour
    a = np.abs(master.astype(np.float64))
    m_lo, m_hi = _magnitudes(lo & 0x7FFF), _magnitudes((lo & 0x7FFF) + 1)
    p = (a - m_lo) / (m_hi - m_lo)  # exact: fp32 differences over a power of two
    index = np.arange(start, start + master.size, dtype=np.uint64)
    key = np.uint64(_stream_key(seed, 0, name, stream=STREAM))
    noise = _mix32(_mix32((index & np.uint64(0xFFFFFFFF)) ^ key) ^ (index >> np.uint64(32))) >> np.uint64(16)
    up = (noise.astype(np.float64) / 65536.0 >= 1.0 - p) & (a != m_lo)
    if not np.all(np.isfinite(master)):
        raise AssertionError(f"{name}: a non-finite master in a finite run")
    # never Inf where round-to-nearest stays finite: |v| below bf16's largest value + half a spacing
    up &= ~((lo & 0x7FFF) + 1 == 0x7F80) | (a >= (2.0**128 - 2.0**119))
    return (lo + up).astype(np.uint16)


def oracle_nearest(master: np.ndarray) -> np.ndarray:
    """bf16 bits of round-to-nearest-even of finite fp32 values: add half a bf16 spacing minus one, plus
    the kept part's lowest bit (ties go to even), and keep the top 16 bits."""
    if not np.all(np.isfinite(master)):
        raise AssertionError("a non-finite master in a finite run")
    b = master.view(np.uint32).astype(np.uint64)
    return (((b + np.uint64(0x7FFF) + ((b >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16))
            & np.uint64(0xFFFF)).astype(np.uint16)


def check_shard(fc, step: int, oracle=None, *, count_nearest: bool = False) -> dict:
    """This rank's served shard against the oracle, every element of every parameter slice.
    ``oracle(master_chunk, name=, start=)`` gives the expected bits (default: this script's dither at SEED);
    with ``count_nearest``, also how many elements round-to-nearest would serve differently (a dither check
    is telling only if many)."""
    if oracle is None:
        def oracle(m, *, name, start):
            return oracle_unbiased(m, seed=SEED, step=step, name=name, start=start)
    checked = wrong = differ_rn = 0
    first = None
    for _, master, served, slices in fc.adapter.flat_groups():
        m_all, s_all = master.detach().view(-1), served.detach().view(-1).view(torch.int16)
        for s in slices:
            if s.is_padding:
                continue
            for at in range(0, s.numel, CHUNK):
                n = min(CHUNK, s.numel - at)
                m = m_all.narrow(0, s.offset + at, n).numpy()
                want = oracle(m, name=s.name, start=s.start + at)
                got = s_all.narrow(0, s.offset + at, n).numpy().view(np.uint16)
                bad = np.flatnonzero(got != want)
                checked += n
                wrong += bad.size
                if count_nearest:
                    differ_rn += int((got != oracle_nearest(m)).sum())
                if bad.size and first is None:
                    first = f"{s.name}[{s.start + at + int(bad[0])}]: served {got[bad[0]]:#06x}, oracle {want[bad[0]]:#06x}"
    out = {"step": step, "checked": checked, "wrong": wrong, "first": first}
    if count_nearest:
        out["differ_rn"] = differ_rn
    return out


def oracle_against_reference(fc, step: int, count: int = 3000) -> int:
    """The vectorized oracle agrees with faircast_ds.casting.reference on a random sample of this shard
    (the reference is a Python loop: a sample only). Returns the number of disagreements."""
    gen = np.random.default_rng(step)
    disagree = 0
    for _, master, _, slices in fc.adapter.flat_groups():
        params = [s for s in slices if not s.is_padding]
        for s in params[:: max(1, len(params) // 6)]:
            at = int(gen.integers(0, max(1, s.numel - count)))
            n = min(count, s.numel - at)
            m = master.detach().view(-1).narrow(0, s.offset + at, n)
            ref = cast_reference(m, MODE, seed=SEED, step=step, name=s.name, start=s.start + at)
            ours = oracle_unbiased(m.numpy(), seed=SEED, step=step, name=s.name, start=s.start + at)
            disagree += int((ref.view(torch.int16).numpy().view(np.uint16) != ours).sum())
    return disagree


# ---------------------------------------------------------------- the run

def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, 151_936, (1, 16), generator=torch.Generator().manual_seed(100 * step + rank))


def train_step(engine, step: int, rank: int) -> None:
    x = batch(step, rank)
    loss = engine(input_ids=x, labels=x).loss
    engine.backward(loss)
    engine.step()


def local_state(fc) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    return [(str(key), served.detach().view(-1).view(torch.int16).clone(), master.detach().view(-1).clone())
            for key, master, served, _ in fc.adapter.flat_groups()]


def engine_matches_served(engine, targets: dict | None, lock) -> dict:
    """Every parameter's gathered served bits against the receiver's (rank 0; a collective walk)."""
    wrong = checked = 0
    first = None
    for name, full in served_weights(engine):
        if targets is None:
            continue
        with lock:
            got = targets[name].view(torch.int16).reshape(-1)
            want = full.detach().reshape(-1).view(torch.int16)
            bad = int((got != want).sum())
        checked += want.numel()
        wrong += bad
        if bad and first is None:
            first = name
    return {"checked": checked, "wrong": wrong, "first": first}


def main() -> None:
    out = os.environ["OUT_DIR"]
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    result: dict = {"rank": rank}
    t_start = time.perf_counter()
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
           "steps_per_print": 10**9, "zero_optimization": {"stage": 3},
           "fair_cast": {"enabled": True, "mode": MODE, "seed": SEED, "diagnostics": {"every": 2}}}
    model = real_causal_lm("qwen3-0.6b", layers=LAYERS, seed=0, ds_config=cfg)
    # the head's input gradient ([16, 151936] @ [151936, 1024]) is slow in a CPU's bf16 fallback: the job's --gemm fp32
    result["routed_linears"] = use_fp32_accumulation(model)
    params = dict(model.named_parameters())
    result["params"] = sum(int(p.ds_numel) for p in params.values())
    result["partitioned"] = all(p.numel() == 0 and p.ds_tensor.numel() <= -(-p.ds_numel // 2) for p in params.values())
    init_wrong = 0
    for name in ("model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight", "model.norm.weight"):
        p = params[name]
        part = p.ds_tensor.numel()
        lo, hi = rank * part, min((rank + 1) * part, p.ds_numel)
        want = _initial_values(name, p.ds_shape, 0.02, 0).reshape(-1)[lo:hi].to(torch.bfloat16).view(torch.int16)
        init_wrong += int((p.ds_tensor.narrow(0, 0, hi - lo).view(torch.int16) != want).sum())
    result["init_wrong"] = init_wrong
    result["build_s"] = time.perf_counter() - t_start
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)  # a post-training rate
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    fc = get_fair_cast(engine)

    targets, lock, reports, rx = None, threading.Lock(), [], None
    port = torch.zeros(1, dtype=torch.int64)
    if rank == 0:  # the inference side: its own tensors, fed only by the channel
        targets = {n: torch.zeros(p.ds_shape, dtype=torch.bfloat16) for n, p in params.items()}
        rx = WeightReceiver(targets, host="127.0.0.1", port=0, timeout=300)
        lock = rx.lock
        port[0] = rx.port

        def serve() -> None:
            rx.accept(timeout=300)
            while (report := rx.receive(timeout=300)) is not None:
                reports.append({"kind": report.kind, "changed": report.changed, "bytes": report.bytes})

        threading.Thread(target=serve, daemon=True).start()
    dist.broadcast(port, 0)
    sender = WeightSender(engine, host="127.0.0.1", port=int(port[0]), timeout=300)

    checks, pushes = [], []
    for step in (1, 2):
        train_step(engine, step, rank)
        checks.append(check_shard(fc, fc.caster.step))
        result.setdefault("reference_disagreements", 0)
        result["reference_disagreements"] += oracle_against_reference(fc, fc.caster.step)
        t0 = time.perf_counter()
        sync = sender.sync()
        pushes.append({"kind": sync.kind, "changed": sync.changed, "seconds": time.perf_counter() - t0,
                       "engine": engine_matches_served(engine, targets, lock)})
    result["checks"], result["pushes"], result["received"] = checks, pushes, reports
    result["cast_steps"] = fc.caster.step
    result["diagnostics"] = dict(fc.diagnostics.last) if getattr(fc, "diagnostics", None) else None

    ckpt = os.path.join(out, "ckpt")
    t0 = time.perf_counter()
    engine.save_checkpoint(ckpt, tag="step2")
    result["save_s"] = time.perf_counter() - t0
    train_step(engine, 3, rank)
    straight, straight_step = local_state(fc), fc.caster.step
    t0 = time.perf_counter()
    engine.load_checkpoint(ckpt, tag="step2")
    result["load_s"] = time.perf_counter() - t0
    result["loaded_step"] = fc.caster.step
    train_step(engine, 3, rank)
    resumed = local_state(fc)
    result["resume"] = {"step": [straight_step, fc.caster.step],
                        "served_equal": all(torch.equal(a[1], b[1]) for a, b in zip(straight, resumed)),
                        "master_equal": all(torch.equal(a[2].view(torch.int32), b[2].view(torch.int32))
                                            for a, b in zip(straight, resumed)),
                        "groups": [len(straight), len(resumed)]}
    result["after_resume"] = check_shard(fc, fc.caster.step)
    del straight, resumed

    export = os.path.join(out, "export")
    save_hf(engine, export)
    export_wrong = None
    if rank == 0:
        from safetensors.torch import load_file

        loaded = {}
        for f in sorted(os.listdir(export)):
            if f.endswith(".safetensors"):
                loaded.update(load_file(os.path.join(export, f)))
        result["export_names"] = sorted(loaded)
        export_wrong = 0
    for name, full in served_weights(engine):
        if export_wrong is not None:
            export_wrong += int((loaded[name].view(torch.int16) != full.view(torch.int16)).sum())
    result["export_wrong"] = export_wrong
    sender.close()
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result["seconds"] = time.perf_counter() - t_start
    write_json(os.path.join(out, f"rank{rank}.json"), result)
    if rx is not None:
        rx.close()
    finish_and_exit(0)


if __name__ == "__main__":
    from common import freeze_the_imports

    freeze_the_imports()  # gc.collect() (DeepSpeed's and ours) then skips the imported modules
    main()
