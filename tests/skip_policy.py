"""The suite's skip policy: every skip is printed with its reason, and a skip whose reason is not on the
short list below fails the run (exit status 1), so that a component setup installs (vLLM, megatron-core,
Triton, gguf, ray, an older DeepSpeed) can never be silently absent again: its tests fail instead.

A reason is allowed when it matches one of ``ALLOWED``'s patterns (``re.search``). The list is kept short on
purpose and in this one place: what the machine cannot have (a CUDA device, the other CPU family's kernel
build) and parametrized cases that do not apply, each named. Anything else, add a setup step, not a line here.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import pytest

# (pattern, why it may skip): the only reasons a test of this suite may skip for.
ALLOWED: tuple[tuple[str, str], ...] = (
    (r"CUDA", "no CUDA device on the CPU machines that run the suite (the GPU check script covers it)"),
    (r"^not an x86 CPU", "the kernel's x86 builds on another architecture"),
    (r"AVX-512 CPU, whose kernels round differently from this CPU's \(AVX2\)",
     "a bit-for-bit reference recorded on AVX-512, on an AVX2 CPU"),
    (r"^this CPU has no \w+: its native build already is ", "a kernel build for an instruction set this CPU does not have"),
    (r"^FAIRCAST_DS_KERNELS=eager: ", "a session that simulates a machine without the fused kernel"),
    (r"^the descriptor is the shm plane's", "the parametrized plane case that does not apply: shm alone has a descriptor"),
)


@dataclass(frozen=True)
class Skip:
    nodeid: str
    reason: str

    @property
    def allowed_because(self) -> str | None:
        return allowed_because(self.reason)


def allowed_because(reason: str) -> str | None:
    """Why ``reason`` may skip (the list's entry), or None when it may not."""
    for pattern, why in ALLOWED:
        if re.search(pattern, reason):
            return why
    return None


def _reason(report) -> str:
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text[len("Skipped: "):] if text.startswith("Skipped: ") else text


class SkipPolicy:
    def __init__(self) -> None:
        self.skips: list[Skip] = []

    def pytest_runtest_logreport(self, report) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            self.skips.append(Skip(report.nodeid, _reason(report)))

    def pytest_collectreport(self, report) -> None:
        if report.skipped:  # a module skipped as a whole (allow_module_level, importorskip)
            self.skips.append(Skip(report.nodeid, _reason(report)))

    def refused(self) -> list[Skip]:
        return [s for s in self.skips if s.allowed_because is None]

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.skips:
            return
        tr = terminalreporter
        tr.section(f"skips ({len(self.skips)}): every reason, against tests/skip_policy.py")
        for s in self.skips:
            why = s.allowed_because
            tr.write_line(f"{'allowed' if why else 'REFUSED'}  {s.nodeid}: {s.reason}" + (f"  [{why}]" if why else ""))
        refused = self.refused()
        if refused:
            tr.write_line(f"{len(refused)} skip(s) for a reason not on tests/skip_policy.py's list: the run fails. "
                          "Install what they need (launch/setup.sh) or fix the test; do not widen the list.",
                          red=True, bold=True)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session, exitstatus) -> None:
        if self.refused() and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config) -> None:
    config.pluginmanager.register(SkipPolicy(), "faircast_skip_policy")
