"""A vLLM engine in a separate process, fed by :mod:`faircast_ds.export`'s weight sync.

Engine process (not part of the training job)::

    python -m faircast_ds.vllm.remote exports/policy --port 29600 --control-port 29601

Trainer, every rank::

    remote = RemoteEngine(engine, host="127.0.0.1", port=29600, control_port=29601)
    report = remote.push()        # WeightSender.sync(), then the engine loads and is checked
    tokens, logps = remote.generate(prompts, max_tokens=8, seeds=seeds)   # rank 0

The weights travel over the existing authenticated channel and protocol (:class:`WeightSender` /
:class:`WeightReceiver`: dense first, then sparse deltas, all-or-nothing; same secret variables).
The receiver writes into a CPU copy of the weights in the engine process (vLLM's CPU kernels repack
their own, so they cannot be the receiver's in-place targets): one bf16 copy of the model there.
A second session on ``control_port`` (same framed channel, same secret, JSON messages) asks the
engine process to load what changed — whole packed groups, found from which tensors the receiver
wrote — and to return the digests of what its kernels now compute with; :meth:`RemoteEngine.push`
compares them with the served weights' own and raises :class:`EngineWeightsMismatch` otherwise.
The same session carries generation requests.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from faircast_ds.dist import from_rank0, rank_world
from faircast_ds.export import WeightReceiver, WeightSender, WeightSyncError
from faircast_ds.export.channel import DEFAULT_HOST, AcceptTimeout, ChannelError, Limits, Listener, connect, resolve_secret
from faircast_ds.export.source import ServedItem
from faircast_ds.vllm.bits import digest
from faircast_ds.vllm.push import EngineWeightsMismatch, PushReport, packed_groups

logger = logging.getLogger("faircast_ds.vllm")
CONTROL_PROTOCOL = 1
_CONTROL_LIMITS = dict(max_json=64 << 20, max_frame=64 << 20)


def staging_weights(model_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The parameters of the HF directory as CPU tensors, in the model class's ``named_parameters()``
    order (the order the trainer's weight sync sends them in)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = Path(model_dir)
    config = AutoConfig.from_pretrained(directory)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    names = [n for n, _ in skeleton.named_parameters()]
    index = directory / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(directory / f)))
    missing = [n for n in names if n not in tensors]
    if missing:
        raise ValueError(f"{directory} lacks {len(missing)} parameter(s) of {type(skeleton).__name__}, e.g. {missing[:5]}")
    return {n: tensors[n].contiguous() for n in names}


class EngineServer:
    """The engine process: a :class:`~faircast_ds.vllm.inference.VllmEngine` on ``model_dir``, a
    :class:`WeightReceiver` on ``port`` and a control listener on ``control_port`` (default
    ``port + 1``). :meth:`serve` runs until a client asks it to shut down."""

    def __init__(self, model_dir: str | os.PathLike, *, host: str = DEFAULT_HOST, port: int = 29600,
                 control_port: int | None = None, secret: str | bytes | None = None, timeout: float = 600.0,
                 **engine_kwargs: Any) -> None:
        from faircast_ds.vllm.inference import VllmEngine

        self.engine = VllmEngine(model_dir, in_process=True, **engine_kwargs)
        self.staging = staging_weights(model_dir)
        self.specs = [(n, list(t.shape)) for n, t in self.staging.items()]
        self.groups = packed_groups(list(self.staging), self.engine.info["packed"])
        self.timeout = timeout
        self.receiver = WeightReceiver(self.staging, host, port, timeout=timeout, secret=secret)
        self.control = Listener(host, port + 1 if control_port is None else control_port, timeout,
                                secret=resolve_secret(secret), limits=Limits(**_CONTROL_LIMITS))
        self._versions = {n: t._version for n, t in self.staging.items()}  # bumped by every in-place write
        self._pending: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._receive_loop, daemon=True, name="faircast-ds vllm weights")

    @property
    def ports(self) -> tuple[int, int]:
        return self.receiver.port, self.control.port

    def _receive_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.receiver.accept(timeout=1.0)
            except AcceptTimeout:
                continue
            except WeightSyncError:
                continue  # refused and logged by the receiver; it keeps its weights
            while not self._stop.is_set():
                try:
                    report = self.receiver.receive(timeout=self.timeout)
                except WeightSyncError:
                    break
                if report is None:
                    break
                with self.receiver.lock:
                    for name, t in self.staging.items():
                        if t._version != self._versions[name]:
                            self._versions[name] = t._version
                            self._pending.add(name)

    def _apply(self) -> dict[str, Any]:
        """Load what the receiver wrote since the last call (whole groups) into the engine; digests."""
        with self.receiver.lock:
            pending, self._pending = self._pending, set()
            names = {m for n in pending for m in self.groups[n]}
            items = [(n, t.clone()) for n, t in self.staging.items() if n in names]
            version = self.receiver.version
        load = self.engine.reload(items) if items else 0.0
        self.engine.reset_prefix_cache()
        t0 = time.perf_counter()
        digests = self.engine.digests(self.specs)
        return {"version": version, "params": len(items), "load_seconds": load,
                "verify_seconds": time.perf_counter() - t0, "digests": digests}

    def _handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        kind = msg.get("type")
        if kind == "apply":
            return self._apply()
        if kind == "generate":
            tokens, logps = self.engine.generate(msg["prompts"], int(msg["max_tokens"]), msg["seeds"],
                                                 float(msg.get("temperature", 1.0)))
            return {"tokens": tokens.tolist(), "logprobs": logps.tolist()}
        if kind == "score":
            return {"logprobs": self.engine.score(msg["sequences"]).tolist()}
        raise ValueError(f"unknown request {str(kind)[:40]!r}")

    def serve(self) -> None:
        self._thread.start()
        print(f"[faircast-ds vllm] serving: weights {self.receiver.host}:{self.receiver.port}, "
              f"control {self.control.host}:{self.control.port}", flush=True)
        try:
            while not self._stop.is_set():
                try:
                    ch = self.control.accept(timeout=1.0)
                except AcceptTimeout:
                    continue
                except WeightSyncError as exc:
                    logger.warning("faircast-ds vllm control: refused a client: %s", exc)
                    continue
                try:
                    hello = ch.recv_json()
                    ok = hello.get("type") == "hello" and hello.get("protocol") == CONTROL_PROTOCOL
                    ch.send_json({"ok": ok, "error": None if ok else f"control protocol {CONTROL_PROTOCOL} expected"})
                    while ok and not self._stop.is_set():
                        msg = ch.recv_json(timeout=self.timeout)
                        if msg.get("type") in ("bye", "shutdown"):
                            if msg["type"] == "shutdown":
                                self._stop.set()
                            ch.send_json({"ok": True})
                            break
                        try:
                            ch.send_json({"ok": True, **self._handle(msg)})
                        except (KeyError, TypeError, ValueError) as exc:
                            ch.send_json({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
                except (ChannelError, WeightSyncError) as exc:
                    logger.warning("faircast-ds vllm control session ended: %s", exc)
                finally:
                    ch.close()
        finally:
            self.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        self.receiver.close()
        self.control.close()
        self.engine.close()


class RemoteEngine:
    """The trainer's end of an :class:`EngineServer`. Construct, :meth:`push` and :meth:`close` on every
    rank (a push is a collective of the training job); :meth:`generate` and :meth:`score` on rank 0.
    ``model`` is a DeepSpeed engine or an ``nn.Module`` (then pass ``version`` to :meth:`push`)."""

    def __init__(self, model: Any, host: str = DEFAULT_HOST, port: int = 29600, control_port: int | None = None, *,
                 secret: str | bytes | None = None, timeout: float = 120.0, delta: bool = True,
                 verify: bool = True) -> None:
        self.model = model
        self.rank, _ = rank_world()
        self.verify = verify
        self.sender = WeightSender(model, host, port, timeout=timeout, delta=delta, secret=secret)
        self._expected: dict[str, str] = {}  # rank 0: canonical digests of what the receiver acknowledged
        self._expected_complete = False  # every rank alike: whether they cover every parameter
        self._control = None
        if self.rank == 0:
            self._control = connect(host, port + 1 if control_port is None else control_port, timeout, secret=secret,
                                    limits=Limits(**_CONTROL_LIMITS))
            self._control.send_json({"type": "hello", "protocol": CONTROL_PROTOCOL})
            reply = self._control.recv_json()
            if not reply.get("ok"):
                raise WeightSyncError(f"the vLLM engine process refused this trainer: {reply.get('error')}")

    def _request(self, msg: dict[str, Any]) -> dict[str, Any]:
        if self._control is None:
            raise RuntimeError("requests to the engine process go from rank 0")
        self._control.send_json(msg)
        reply = self._control.recv_json()
        if not reply.get("ok"):
            raise WeightSyncError(f"the vLLM engine process failed {msg.get('type')!r}: {reply.get('error')}")
        return reply

    def push(self, version: int | None = None, *, verify: bool | None = None) -> PushReport:
        """Sync the served weights (dense the first time, then deltas), have the engine load them,
        and check that its kernels compute with exactly the served bits (collective). One walk of the
        served weights: the digests the check expects are taken from the parameters the sync walks
        (under ZeRO-3 one gather per parameter it sends), the others are the acknowledged sync's."""
        began = time.perf_counter()
        verify = self.verify if verify is None else verify
        digests = verify or self.verify
        fresh: dict[str, str] = {}

        def take_digest(item: ServedItem) -> None:
            if self.rank == 0 and digests:
                fresh[item.name] = digest(item.tensor)

        kind = "auto" if self._expected_complete or not verify else "dense"
        sync = self.sender.sync(version, kind=kind, on_param=take_digest)
        self._expected = fresh if sync.kind == "dense" else {**self._expected, **fresh}
        self._expected_complete = digests and (sync.kind == "dense" or self._expected_complete)
        outcome = None
        if self.rank == 0:
            try:
                reply = self._request({"type": "apply"})
                got = reply["digests"]
                mismatched = [s.name for s in self.sender.specs if got.get(s.name) != self._expected.get(s.name)] \
                    if verify else []
                error = None
                if mismatched:
                    error = (f"after the push the engine process computes with other bits than the served ones in "
                             f"{len(mismatched)} of {len(self.sender.specs)} parameter(s): {mismatched[:5]}")
                outcome = {"error": error, "mismatched": mismatched, "params": reply["params"],
                           "load_seconds": reply["load_seconds"], "verify_seconds": reply["verify_seconds"]}
            except (WeightSyncError, KeyError) as exc:
                outcome = {"error": f"the engine process did not load update {sync.version}: {exc}", "mismatched": [],
                           "params": 0, "load_seconds": 0.0, "verify_seconds": 0.0}
        outcome = from_rank0(outcome)
        if outcome["error"] is not None:
            self.sender.source.require_dense()  # the engine's kernels may not hold it: the next sync is whole
            raise EngineWeightsMismatch(outcome["error"], outcome["mismatched"])
        return dataclasses.replace(sync, params=outcome["params"], seconds=time.perf_counter() - began,
                                   load_seconds=outcome["load_seconds"], verify_seconds=outcome["verify_seconds"],
                                   verified=True if verify else None)

    def generate(self, prompts: torch.Tensor | Sequence[Sequence[int]], max_tokens: int, seeds: Sequence[int],
                 temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        rows = prompts.tolist() if isinstance(prompts, torch.Tensor) else [list(p) for p in prompts]
        reply = self._request({"type": "generate", "prompts": rows, "max_tokens": int(max_tokens),
                               "seeds": [int(s) for s in seeds], "temperature": float(temperature)})
        return torch.tensor(reply["tokens"], dtype=torch.long), torch.tensor(reply["logprobs"], dtype=torch.float32)

    def score(self, sequences: torch.Tensor | Sequence[Sequence[int]]) -> torch.Tensor:
        rows = sequences.tolist() if isinstance(sequences, torch.Tensor) else [list(s) for s in sequences]
        return torch.tensor(self._request({"type": "score", "sequences": rows})["logprobs"], dtype=torch.float32)

    def close(self, *, shutdown: bool = False) -> None:
        """End the sessions (``shutdown``: also stop the engine process)."""
        if self._control is not None:
            try:
                self._request({"type": "shutdown" if shutdown else "bye"})
            except (WeightSyncError, ChannelError):
                pass
            self._control.close()
            self._control = None
        self.sender.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve an HF directory from vLLM, fed by faircast-ds weight sync.")
    parser.add_argument("model_dir")
    parser.add_argument("--host", default=DEFAULT_HOST)
    parser.add_argument("--port", type=int, default=29600, help="weight sync port")
    parser.add_argument("--control-port", type=int, default=None, help="default: --port + 1")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    EngineServer(args.model_dir, host=args.host, port=args.port, control_port=args.control_port,
                 max_model_len=args.max_model_len, dtype=args.dtype, seed=args.seed,
                 kv_cache_gib=args.kv_cache_gib).serve()


if __name__ == "__main__":
    main()
