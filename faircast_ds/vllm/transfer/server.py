"""A ``vllm serve`` process with the ``faircast`` backend, from the trainer's side.

:class:`VllmServer` starts one (``python -m vllm.entrypoints.openai.api_server``, which is what
``vllm serve`` runs, with ``VLLM_SERVER_DEV_MODE=1`` for the RL routes) on a loopback address and a
free port, in its own process group (killed as a group by :meth:`VllmServer.close`), or attaches to
one by URL; it talks to it over HTTP (generation, ``/weight_info``, ``/weight_checker``).

:class:`ServedPush` is the trainer's end, on every rank: vLLM's ``HTTPVLLMWeightSyncClient`` drives
the ``faircast`` backend (:mod:`faircast_ds.vllm.transfer.trainer`), then the engine's prefix cache is
reset and, with ``verify``, vLLM's ``/weight_checker`` is asked to compare its checksums (the bits its
kernels compute with) with the served weights' own (:func:`~faircast_ds.vllm.transfer.checksums.served_checksums`,
computed without vLLM) and ``/weight_info`` to show the pushed version.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

import torch

from faircast_ds._util.dist import from_rank0, rank_world
from faircast_ds.export.channel import DEFAULT_HOST
from faircast_ds.export.stages import Stages
from faircast_ds.vllm.push import EngineWeightsMismatch, PushReport, packed_groups
from faircast_ds.vllm.transfer.checksums import (
    FUSED,
    SAMPLE_COLUMNS,
    ChecksumCollector,
    served_checksums,
)
from faircast_ds.vllm.transfer.trainer import free_port

# what a launcher sets and vLLM would read as its own world (see faircast_ds.vllm.inference)
_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                       "MASTER_ADDR", "MASTER_PORT", "CROSS_RANK", "CROSS_SIZE", "TORCHELASTIC_RUN_ID")


class ServerUnavailable(RuntimeError):
    """The vLLM server did not come up, or stopped answering (the message quotes its log)."""


class VllmServer:
    """A vLLM OpenAI-compatible server process serving ``model_dir`` with the ``faircast`` backend, or
    (``url=``) an existing one. Use as a context manager or call :meth:`close`."""

    def __init__(self, model_dir: str | os.PathLike | None = None, *, url: str | None = None,
                 host: str = DEFAULT_HOST, port: int | None = None, dtype: str = "bfloat16", seed: int = 0,
                 max_model_len: int | None = None, kv_cache_gib: float = 1 / 16, log_path: str | os.PathLike | None = None,
                 start_timeout: float = 600.0, request_timeout: float = 300.0, extra_args: Sequence[str] = (),
                 worker_extension: bool = False) -> None:
        self.proc: subprocess.Popen | None = None
        self.request_timeout = request_timeout
        self._log = None
        if url is not None:
            self.url = url.rstrip("/")
            return
        if model_dir is None:
            raise ValueError("VllmServer needs model_dir (to start a server) or url (to attach to one)")
        port = port or free_port(host)
        self.url = f"http://{host}:{port}"
        # absolute: the server runs in the export's parent directory, where a relative path would not
        # name the export (vLLM would take it for a hub repo id)
        model_dir = Path(model_dir).resolve()
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(f"VllmServer: {model_dir} is not a model directory (no config.json)")
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--host", host, "--port", str(port), "--weight-transfer-config", json.dumps({"backend": "faircast"}),
               "--enforce-eager", "--skip-tokenizer-init", "--dtype", dtype, "--seed", str(seed),
               "--kv-cache-memory-bytes", str(int(kv_cache_gib * 2**30)), "--uvicorn-log-level", "warning",
               *extra_args]
        if worker_extension:  # faircast_ds.vllm.worker's methods on vLLM's worker: engine_report()
            cmd += ["--worker-extension-cls", "faircast_ds.vllm.worker.FairCastWorkerExtension"]
        if max_model_len is not None:
            cmd += ["--max-model-len", str(max_model_len)]
        env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES}
        env.update(VLLM_SERVER_DEV_MODE="1", VLLM_ENABLE_V1_MULTIPROCESSING="1")
        if not torch.cuda.is_available():
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # a shared machine: pin nothing
        self.log_path = Path(log_path) if log_path is not None else Path(f"vllm-server-{port}.log")
        self._log = open(self.log_path, "w")
        # its own session: one process group for the server and everything vLLM spawns, killed together
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                     cwd=str(model_dir.parent))
        try:
            self._wait_healthy(start_timeout)
        except BaseException:
            self.close()
            raise

    # -- process ---------------------------------------------------------------------------------
    def _wait_healthy(self, timeout: float) -> None:
        import requests

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise ServerUnavailable(f"the vLLM server exited with {self.proc.returncode} at start:\n{self.log_tail()}")
            try:
                if requests.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise ServerUnavailable(f"the vLLM server did not answer /health within {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except (AttributeError, OSError):
            return "(no log)"

    def close(self, timeout: float = 30.0) -> int | None:
        """Stop a server this object started (its whole process group); returns its exit status."""
        proc, self.proc = self.proc, None
        code = None
        if proc is not None:
            for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    code = proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # anything of the group left behind
            except ProcessLookupError:
                pass
        if self._log is not None:
            self._log.close()
            self._log = None
        return code

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- HTTP --------------------------------------------------------------------------------------
    def _post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        import requests

        r = requests.post(f"{self.url}/{path}", json=body, timeout=self.request_timeout)
        if r.status_code != 200:
            raise ServerUnavailable(f"POST /{path}: HTTP {r.status_code}: {r.text[:500]}")
        return r.json() if r.content else None

    def weight_version(self) -> str:
        import requests

        return requests.get(f"{self.url}/weight_info", timeout=self.request_timeout).json()["weight_version"]

    def checksums(self) -> dict[str, str]:
        """vLLM's ``/weight_checker`` checksums (with faircast-ds installed: of the kernels' bits)."""
        return self._post("weight_checker", {"action": "checksum"})["checksums"]

    def compare(self, baseline: dict[str, str]) -> dict[str, Any]:
        """vLLM's ``/weight_checker`` compare: ``{"match": bool, "mismatches": [...]}``."""
        return self._post("weight_checker", {"action": "compare", "baseline": baseline})

    def engine_report(self) -> dict[str, Any]:
        """The engine side's account of the last update (``receive_seconds``, ``load_seconds`` inside
        vLLM's own ``reload_weights``, ``loaded``, ``bytes``), through vLLM's ``/collective_rpc``; needs a
        server started with ``worker_extension=True`` (:class:`ServerUnavailable` otherwise)."""
        results = self._post("collective_rpc", {"method": "faircast_transfer_last"})["results"]
        if not results or not isinstance(results[0], dict):
            raise ServerUnavailable(f"/collective_rpc faircast_transfer_last answered {results!r}")
        return results[0]

    def reset_prefix_cache(self) -> None:
        self._post("reset_prefix_cache")

    def generate(self, prompts: torch.Tensor | Sequence[Sequence[int]], max_tokens: int, seeds: Sequence[int],
                 temperature: float = 1.0, workers: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids in, ``(tokens [N, max_tokens], log-probs [N, max_tokens] fp32)`` out; each prompt
        with its own seed (one completion request each, ``workers`` in flight)."""
        rows = prompts.tolist() if isinstance(prompts, torch.Tensor) else [list(p) for p in prompts]
        if len(seeds) != len(rows):
            raise ValueError(f"{len(rows)} prompts but {len(seeds)} seeds")

        def one(args: tuple[list[int], int]) -> tuple[list[int], list[float]]:
            row, seed = args
            out = self._post("v1/completions", {
                "model": self.model_name(), "prompt": row, "max_tokens": int(max_tokens),
                "min_tokens": int(max_tokens), "temperature": float(temperature), "top_p": 1.0, "top_k": 0,
                "seed": int(seed), "logprobs": 0, "ignore_eos": True, "detokenize": False,
                "return_token_ids": True, "return_tokens_as_token_ids": True})
            choice = out["choices"][0]
            return list(choice["token_ids"]), [float(x) for x in choice["logprobs"]["token_logprobs"]]

        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            results = list(pool.map(one, zip(rows, seeds)))
        return (torch.tensor([r[0] for r in results], dtype=torch.long),
                torch.tensor([r[1] for r in results], dtype=torch.float32))

    def model_name(self) -> str:
        if getattr(self, "_model_name", None) is None:
            import requests

            self._model_name = requests.get(f"{self.url}/v1/models", timeout=self.request_timeout).json()["data"][0]["id"]
        return self._model_name


def _merged(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0.0) + v
    return out


class ServedPush:
    """Push Fair Cast's served weights into a ``vllm serve`` process through the ``faircast`` backend.
    Construct and :meth:`push` on every rank (collectives under ZeRO-3); ``server`` (a
    :class:`VllmServer` or a URL) on rank 0, None elsewhere.

    Verification (``verify=True``, the default) compares vLLM's ``/weight_checker`` checksums of the
    bits its kernels compute with against the served weights' own, after every push. The first
    verified push of a session (and any push after a failed or unverified one) is checked whole:
    every element of every tensor. Later pushes check every vector and the embedding whole and
    ``check_columns`` input columns of every matrix (64; columns that move with each update of the
    layer, :func:`~faircast_ds.vllm.transfer.checksums.sample_columns`), because reading a whole
    matrix back through its kernel costs more than the push (docs/vllm.md). ``push(verify="full")``
    asks for a whole check; ``check_columns=0`` makes every check whole."""

    def __init__(self, model: Any, server: VllmServer | str | None, *, port: int = 0, host: str = DEFAULT_HOST,
                 timeout: float = 120.0, delta: bool = True, verify: bool = True,
                 check_columns: int = SAMPLE_COLUMNS) -> None:
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.factory import (
            WeightTransferTrainerFactory,
        )

        from faircast_ds.vllm.transfer import register
        from faircast_ds.vllm.transfer.trainer import FairCastTrainerInitInfo

        if type(check_columns) is not int or check_columns < 0:
            raise ValueError(f"check_columns must be a non-negative integer, got {check_columns!r}")
        register()  # this process may not have run vLLM's plugin loader
        self.model, self.verify, self.check_columns = model, verify, check_columns
        self.rank, self.world = rank_world()
        if self.rank == 0 and server is None:
            raise ValueError("ServedPush needs the server (or its URL) on rank 0")
        self.server = (server if isinstance(server, VllmServer) else VllmServer(url=server)) if self.rank == 0 else None
        client = HTTPVLLMWeightSyncClient(self.server.url, timeout=timeout + 60) if self.server is not None else None
        self.transfer = WeightTransferTrainerFactory.trainer_init(
            FairCastTrainerInitInfo(rank=self.rank, port=port, host=host, timeout=timeout, delta=delta),
            client=client, source=model)
        self.params_total = len(self.transfer.sender.specs)
        # verification rides on the update's own walk: a delta walk also shows the unchanged parts of a
        # fused layer with a changed part (vLLM checksums the fused tensor), and the checksums of the
        # layers it does not show are the last verified update's
        names = [s.name for s in self.transfer.sender.specs]
        self.groups = {n: g for n, g in packed_groups(names, {k: list(v) for k, v in FUSED.items()}).items()
                       if len(g) > 1}
        # rank 0: vLLM-named checksums the engine's current weights must have, whole and sampled; None
        # where they are not known for every layer (every rank alike: whether they are known)
        self._whole: dict[str, str] | None = None
        self._sampled: dict[str, str] | None = None
        self.last_check: str | None = None  # "whole" or "sampled": how the last push was verified

    def push(self, version: int | None = None, *, verify: bool | str | None = None, kind: str = "auto") -> PushReport:
        """One update (dense the first time and after any failure, then deltas), the prefix cache reset,
        and (``verify``: True, ``"full"`` or False) vLLM's ``/weight_checker`` compared with the served bits
        and ``/weight_info`` with ``version``; :class:`EngineWeightsMismatch` on every rank otherwise."""
        verify = self.verify if verify is None else verify
        if verify not in (True, False, "full"):
            raise ValueError(f"verify must be True, False or 'full', got {verify!r}")
        if version is None:
            version = getattr(self.model, "global_steps", None)
        began = time.perf_counter()
        sampled = bool(verify) and verify != "full" and self.check_columns > 0 and self._sampled is not None
        collector = None
        if verify and self.rank == 0:
            # whole checksums only for a whole check; sampled ones always (cheap), for the next push
            collector = ChecksumCollector(whole=not sampled,
                                          sample=(self.check_columns, int(version)) if self.check_columns else None)

        stages = Stages()

        def see(item: Any) -> None:  # the tensor is valid only until the walk advances
            if collector is not None:
                collector.add(item.name, item.tensor)

        try:
            sync = self.transfer.send_weights(version, kind=kind, on_param=see if verify else None,
                                              groups=self.groups if verify else None,
                                              check_columns=self.check_columns if sampled else 0)
        except Exception:
            self._whole = self._sampled = None
            raise
        version = sync.version
        error, mismatched, verify_seconds = None, [], 0.0
        if self.server is not None:
            try:
                with stages("http.reset_prefix_cache"):
                    self.server.reset_prefix_cache()  # its KV blocks were computed with the old weights
            except Exception as exc:  # noqa: BLE001 - reported on every rank
                error = f"reset_prefix_cache failed: {exc}"
        whole = sampled_now = None
        if verify:
            t0 = time.perf_counter()
            if collector is not None:
                collector.done()
            dense = sync.kind == "dense"
            t_sums = time.perf_counter()
            if not sampled and not dense and self._whole is None:
                # a whole check of a delta, but the layers it did not show were last sent unverified or
                # sampled: one more walk (a collective under ZeRO-3, every rank alike)
                from faircast_ds.export.served import served_weights

                everything = served_checksums(served_weights(self.model))
                stages.add("trainer.checksums", time.perf_counter() - t_sums)
                if collector is not None:
                    collector.full = everything
                    dense = True  # the expected checksums now cover every layer
            if self.rank == 0:
                if sampled:
                    sampled_now = {**self._sampled, **collector.sampled}
                    expected = sampled_now
                else:
                    whole = collector.full if dense else {**self._whole, **collector.full}
                    expected = whole
                    if self.check_columns and (sync.kind == "dense" or self._sampled is not None):
                        sampled_now = collector.sampled if sync.kind == "dense" else {**self._sampled,
                                                                                      **collector.sampled}
            if self.server is not None and error is None:
                try:
                    with stages("http.weight_checker"):  # the engine reads its kernels back here
                        result = self.server.compare(expected)
                    mismatched = list(result["mismatches"])
                    with stages("http.weight_info"):
                        served_version = self.server.weight_version()
                    if mismatched:
                        error = (f"after update {version} vLLM's /weight_checker disagrees with the served bits in "
                                 f"{len(mismatched)} tensor(s) ({'sampled' if sampled else 'whole'} check): "
                                 f"{mismatched[:5]}")
                    elif served_version != str(version):
                        error = f"vLLM serves weight version {served_version!r} after update {version}"
                except Exception as exc:  # noqa: BLE001
                    error = f"/weight_checker failed: {exc}"
            verify_seconds = time.perf_counter() - t0
        with stages("trainer.collectives"):
            error, mismatched = from_rank0((error, mismatched))
            ok = bool(verify) and error is None
            # every rank alike: whether rank 0's checksums describe the engine's weights now
            known_sampled = from_rank0(sampled_now is not None) if ok else False
        collectives = sync.collectives + ((2 if ok else 1) if self.world > 1 else 0)
        self._whole = (whole if self.rank == 0 else {}) if ok and not sampled else None
        self._sampled = (sampled_now if self.rank == 0 else {}) if known_sampled else None
        self.last_check = ("sampled" if sampled else "whole") if verify else None
        if error is not None:
            self.transfer._drop()  # the next push is dense
            raise EngineWeightsMismatch(error, mismatched)
        return dataclasses.replace(sync, params_total=self.params_total, seconds=time.perf_counter() - began,
                                   verify_seconds=verify_seconds, verified=True if verify else None,
                                   stages=_merged(sync.stages, stages.as_dict()),
                                   http_calls=sync.http_calls + stages.http_calls(), collectives=collectives)

    def close(self) -> None:
        self.transfer.shutdown()
