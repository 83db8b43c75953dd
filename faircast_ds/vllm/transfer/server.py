"""A ``vllm serve`` process with the ``faircast`` backend, from the trainer's side.

:class:`VllmServer` starts one (``python -m vllm.entrypoints.openai.api_server``, which is what
``vllm serve`` runs, with ``VLLM_SERVER_DEV_MODE=1`` for the RL endpoints) on a loopback address and a
free port, in its own process group (killed as a group by :meth:`VllmServer.close`), or attaches to
one by URL; it talks to it over HTTP (generation, ``/weight_info``, ``/weight_checker``). The trainer
pushes into it with :class:`~faircast_ds.vllm.transfer.served_push.ServedPush`.
"""
from __future__ import annotations

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

from faircast_ds.export.channel import DEFAULT_HOST, free_port
from faircast_ds.vllm.cpu_gemm import CACHE_ENV as GEMM_CACHE_ENV, CHOICES as GEMMS, ENV as GEMM_ENV
from faircast_ds.vllm import spin

# what a launcher sets and vLLM would read as its own world (see faircast_ds.vllm.colocated.inference)
_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                       "MASTER_ADDR", "MASTER_PORT", "CROSS_RANK", "CROSS_SIZE", "TORCHELASTIC_RUN_ID")


class ServerUnavailable(RuntimeError):
    """The vLLM server did not come up, or stopped answering (the message quotes its log)."""


class VllmServer:
    """A vLLM OpenAI-compatible server process serving ``model_dir`` with the ``faircast`` backend, or
    (``url=``) an existing one. Use as a context manager or call :meth:`close`.

    ``launcher``: a command prefix the server runs under, e.g. ``["ip", "netns", "exec", NS]`` for a
    server in another network namespace (the benchmark's cross-host row); it must exec the command it
    is given (the server stays this object's child, killed with its process group). With a launcher
    the port is not probed here (this host may not own ``host``): pass ``port``.

    ``threads``: the server's CPU threads (``OMP_NUM_THREADS``; None: this process's). On a CPU host where
    the trainer waits while the engine samples, give it every core.

    ``gemm``: ``"fp32"`` computes the engine's bf16 matrix products on CPU from fp32 sums of the bf16 values,
    rounded once (``FAIRCAST_VLLM_CPU_GEMM``, :mod:`faircast_ds.vllm.cpu_gemm`: 5-13x faster on a CPU without
    bf16 arithmetic; the weights are unchanged, the sampled tokens may differ from a stock engine's);
    ``"native"``: vLLM's own CPU dispatch. ``gemm_cache``: with ``"fp32"``, the worker keeps each weight's fp32
    copy from one forward to the next and drops it at any other call (a weight update included): the same bits,
    7-9% less time in a decode step's products, 4 bytes per weight element (``FAIRCAST_VLLM_CPU_GEMM_CACHE``).
    ``spin_s``: how long the server's message-queue readers spin before they sleep (``FAIRCAST_VLLM_SPIN_S``,
    :mod:`faircast_ds.vllm.spin`; None: vLLM's 1 s). On a CPU host 0 leaves the cores to the compute."""

    def __init__(self, model_dir: str | os.PathLike | None = None, *, url: str | None = None,
                 host: str = DEFAULT_HOST, port: int | None = None, dtype: str = "bfloat16", seed: int = 0,
                 max_model_len: int | None = None, kv_cache_gib: float = 1 / 16, log_path: str | os.PathLike | None = None,
                 start_timeout: float = 600.0, request_timeout: float = 300.0, extra_args: Sequence[str] = (),
                 worker_extension: bool = False, launcher: Sequence[str] = (), threads: int | None = None,
                 gemm: str = "native", gemm_cache: bool = False, spin_s: float | None = None) -> None:
        self.proc: subprocess.Popen | None = None
        self.request_timeout = request_timeout
        self._log = None
        if url is not None:
            self.url = url.rstrip("/")
            return
        if model_dir is None:
            raise ValueError("VllmServer needs model_dir (to start a server) or url (to attach to one)")
        launcher = [str(a) for a in launcher]
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"VllmServer: threads must be a positive int or None, not {threads!r}")
        if gemm not in GEMMS:
            raise ValueError(f"VllmServer: gemm must be one of {', '.join(GEMMS)}, not {gemm!r}")
        if type(gemm_cache) is not bool or (gemm_cache and gemm != "fp32"):
            raise ValueError(f"VllmServer: gemm_cache is True (with gemm='fp32') or False, not {gemm_cache!r} "
                             f"with gemm={gemm!r}")
        if spin_s is not None and not spin.valid(spin_s):
            raise ValueError(f"VllmServer: spin_s is a number of seconds >= 0 or None, not {spin_s!r}")
        if launcher and not port:
            raise ValueError("VllmServer with a launcher needs an explicit port (this process may not reach "
                             f"{host} to find a free one)")
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
        if worker_extension:  # the colocated setup's worker extension on vLLM's worker: engine_report()
            cmd += ["--worker-extension-cls", "faircast_ds.vllm.colocated.worker.FairCastWorkerExtension"]
        if max_model_len is not None:
            cmd += ["--max-model-len", str(max_model_len)]
        env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES}
        env.update(VLLM_SERVER_DEV_MODE="1", VLLM_ENABLE_V1_MULTIPROCESSING="1")
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        env[GEMM_ENV] = gemm  # read by the faircast plugin in every vLLM process of the server
        env[GEMM_CACHE_ENV] = "1" if gemm_cache else "0"
        if spin_s is not None:
            env[spin.ENV] = repr(float(spin_s))
        else:
            env.pop(spin.ENV, None)  # None is vLLM's own, whatever this process's environment says
        if not torch.cuda.is_available():
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # a shared machine: pin nothing
        self.log_path = Path(log_path) if log_path is not None else Path(f"vllm-server-{port}.log")
        self._log = open(self.log_path, "w")
        # its own session: one process group for the server and everything vLLM spawns, killed together,
        # tethered to this process: stopped when it dies, even by SIGKILL (a trainer rank killed for memory
        # left its server running, and the job's retry was then killed for memory in turn)
        cmd = [*launcher, sys.executable, "-m", "faircast_ds._util.tethered", str(os.getpid()), "--", *cmd]
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

    # -- vLLM's weight-transfer API (the RL endpoints a push drives; the names are vLLM's own) -----------
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """``/init_weight_transfer_engine``: the engine opens the backend's end of the push (``init_info``:
        the ``faircast`` backend's, :class:`~faircast_ds.vllm.transfer.engine.FairCastInitInfo`)."""
        self._post("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        """``/start_weight_update``: open an update session (vLLM refuses a second one while one is open)."""
        self._post("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """``/update_weights``: the engine receives, or takes the committed write of, one update
        (:class:`~faircast_ds.vllm.transfer.engine.FairCastUpdateInfo`)."""
        self._post("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """``/finish_weight_update``: the engine loads the session's update (and checks its kernels, where
        the update asked); vLLM then serves ``weight_version`` (None: vLLM's version stays)."""
        self._post("finish_weight_update", None if weight_version is None else {"weight_version": weight_version})

    def abandon_weight_update(self) -> None:
        """End an update session a dead trainer left open (its staged bits load at the next finish)."""
        self.update_weights({"abandon": True})
        self.finish_weight_update()

    def update_weight_version(self, weight_version: str) -> None:
        """``/update_weight_version``: vLLM serves ``weight_version`` with the weights it holds (a push that
        changed nothing)."""
        self._post("update_weight_version", {"new_version": weight_version})

    def shutdown_weight_transfer_engine(self) -> None:
        """``/shutdown_weight_transfer_engine``: the engine closes the backend's end."""
        self._post("shutdown_weight_transfer_engine")

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
