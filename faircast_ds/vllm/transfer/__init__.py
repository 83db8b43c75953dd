"""The ``vllm serve`` setup: the trainer's one entry point, :class:`ServedPush`
(:mod:`~faircast_ds.vllm.transfer.served_push`: every rank's slices through a plane of
:mod:`~faircast_ds.vllm.transfer.planes` into the engine's staging segment), the ``faircast``
weight-transfer backend for vLLM's RL API (engine side :mod:`~faircast_ds.vllm.transfer.engine`, trainer
side for vLLM's own clients :mod:`~faircast_ds.vllm.transfer.trainer`), the ``/weight_checker`` checksums
of the bits the kernels compute with, and the server process (:class:`VllmServer`).

Installed faircast-ds exposes :func:`register` in vLLM's ``vllm.general_plugins`` entry-point group
(setup.py), so every vLLM process — ``vllm serve``, its engine core, its workers, an in-process
``LLM`` — registers the backend by name and answers ``/weight_checker`` from the kernels
(:mod:`faircast_ds.vllm.transfer.checksums`). docs/vllm.md.

Importing this package does not import vLLM.
"""
from __future__ import annotations

from faircast_ds._util import lazy

BACKEND = "faircast"

_LAZY = {
    "FairCastWeightTransferEngine": "faircast_ds.vllm.transfer.engine",
    "FairCastTrainerWeightTransferEngine": "faircast_ds.vllm.transfer.trainer",
    "FairCastTrainerInitInfo": "faircast_ds.vllm.transfer.trainer",
    "LLMWeightSyncClient": "faircast_ds.vllm.transfer.trainer",
    "VllmServer": "faircast_ds.vllm.transfer.server",
    "ServedPush": "faircast_ds.vllm.transfer.served_push",
    "served_checksums": "faircast_ds.vllm.transfer.checksums",
}

__all__ = sorted(_LAZY) + ["BACKEND", "register"]

__getattr__ = lazy.exports(__name__, _LAZY, globals())


def register() -> None:
    """vLLM general plugin (called in every vLLM process, maybe more than once): register the
    ``faircast`` backend with both of vLLM's weight-transfer factories, install the kernel-bit
    checksums of ``/weight_checker`` and, where ``FAIRCAST_VLLM_CPU_GEMM=fp32`` asks, the fp32-summed CPU GEMM."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "faircast_ds.vllm.transfer.engine",
                                                    "FairCastWeightTransferEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, "faircast_ds.vllm.transfer.trainer",
                                                     "FairCastTrainerWeightTransferEngine")
    from faircast_ds.vllm.cpu_gemm import install as install_cpu_gemm
    from faircast_ds.vllm.transfer.checksums import install_checksums

    install_checksums()
    install_cpu_gemm()  # FAIRCAST_VLLM_CPU_GEMM=fp32: bf16 matrix products from fp32 sums (faircast_ds/vllm/cpu_gemm.py)
    from faircast_ds.vllm.spin import install as install_spin

    install_spin()  # FAIRCAST_VLLM_SPIN_S: how long the queues' readers spin (faircast_ds/vllm/spin.py)
