"""Fair Cast on the oldest and the newest megatron-core that install here, under the run-time guard.

The supported range is megatron-core>=0.12.0,<0.20 (faircast_ds.megatron.compat). On Python 3.11 pip
offers 0.12.0 ... 0.16.1 (0.17.0 and later declare Requires-Python >=3.12); CI runs the oldest, 0.12.0
(installed beside the default by launch/setup.d/25-megatron-releases.sh, first on PYTHONPATH), and the
default install, 0.16.1. One 2-rank launch of tests/dist/megatron_worker.py per (release, route): the
runtime route on both, the hook route on a patched copy of 0.12.0 (0.16.1's hook route is
tests/megatron_tests/test_megatron.py's). Checked against faircast_ds/casting/reference.py's cast_reference, written apart from
the casts: every served bit of every bf16 parameter after each of 3 steps, in every mode, is the
reference cast of the gathered fp32 masters; the guard checked every step and stops the run when the
served bits are not what Fair Cast wrote; the release-dependent settings are refused by the names the
release has. ``FAIRCAST_MEGATRON_RELEASES`` picks other side releases (e.g. "0.12.0 0.13.1 0.15.3").
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import DIST, ROOT, cpu_env, free_port, run_logged

from faircast_ds.casting.reference import cast_reference
from faircast_ds.megatron import compat

CACHE = Path(os.environ.get("FAIRCAST_DS_RELEASE_CACHE", "~/.cache/faircast-ds")).expanduser()
CI_RELEASES = ("0.12.0",)
OTHERS = tuple(os.environ.get("FAIRCAST_MEGATRON_RELEASES", " ".join(CI_RELEASES)).split())
try:
    DEFAULT = importlib.metadata.version("megatron-core")
except importlib.metadata.PackageNotFoundError:
    DEFAULT = None
RELEASES = ((DEFAULT,) if DEFAULT else ()) + tuple(v for v in OTHERS if v != DEFAULT)
MODES = ("nearest", "stochastic", "dither", "error_feedback")
SEED = 77  # the worker's
PATCHES = ROOT / "patches"


def vt(version: str) -> tuple[int, ...]:
    from packaging.version import Version

    return tuple(Version(version).release[:3])


# ---- without a launch ------------------------------------------------------------------------------

@pytest.mark.parametrize("version, inside", [("0.12.0", True), ("0.12.3", True), ("0.13.1", True), ("0.16.1", True),
                                             ("0.16.0rc0.dev132713", True), ("0.16.1+abc", True), ("0.19.2", True),
                                             ("0.19.99", True), ("0.12.0rc3", True), ("0.11.0", False),
                                             ("0.20.0", False), ("0.20.0rc0", False), ("1.0.0", False)])
def test_the_supported_range(version, inside):
    problem = compat.release_problem(version)
    assert (problem is None) == inside, problem
    if not inside:
        assert problem.startswith(f"megatron-core {version} is not supported: faircast-ds supports "
                                  "megatron-core>=0.12.0,<0.20")
        assert "tested: 0.12.0, 0.16.1" in problem


def test_an_unreadable_version_is_refused():
    assert "has no version number" in compat.release_problem("not-a-version")


def test_ci_tests_the_oldest_and_the_newest_installable_release():
    assert compat.TESTED == CI_RELEASES + ("0.16.1",)
    steps = (ROOT / "launch" / "setup.d" / "25-megatron-releases.sh").read_text()
    assert f'RELEASES="${{FAIRCAST_MEGATRON_RELEASES:-{" ".join(CI_RELEASES)}}}"' in steps


def test_nothing_else_compares_megatron_versions():
    """Every release difference is feature-detected in compat; its range check is the one comparison."""
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "faircast_ds" / "megatron").rglob("*.py")
                 if p.name != "compat.py" and ("VERIFIED" in p.read_text() or "__version__" in p.read_text())]
    assert offenders == []


# ---- the launches ------------------------------------------------------------------------------------

def release_dir(version: str) -> Path | None:
    """Where a release is installed (None: the default install, in site-packages)."""
    if version == DEFAULT:
        return None
    target = CACHE / f"megatron-core-{version}"
    if not (target / ".faircast-complete").exists():
        raise AssertionError(f"megatron-core {version} is not installed in {target}: run "
                             f"FAIRCAST_MEGATRON_RELEASES='{version}' bash launch/setup.d/25-megatron-releases.sh")
    return target


def patch_for(version: str) -> Path:
    """The hook patch variant patches/README.md lists for ``version``."""
    for line in (PATCHES / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) > 3 and cells[1].startswith("`megatron-core-") and version in cells[2].split(", "):
            return PATCHES / cells[1].strip("`")
    raise AssertionError(f"patches/README.md lists no megatron-core patch for {version}")


def patched_copy(version: str, site: Path) -> Path:
    """A copy of the release's ``megatron`` package with its patch variant applied (exactly: no fuzz)."""
    source = release_dir(version) or Path(importlib.util.find_spec("megatron").submodule_search_locations[0]).parent
    shutil.copytree(source / "megatron", site / "megatron")
    proc = subprocess.run(["patch", "-p1", "--forward", "--fuzz=0", "-d", str(site), "-i", str(patch_for(version))],
                          capture_output=True, text=True)
    assert proc.returncode == 0 and "fuzz" not in proc.stdout, proc.stdout + proc.stderr
    return site


LAUNCHES = [(v, "runtime") for v in RELEASES] + [(v, "hook") for v in RELEASES if v != DEFAULT]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if DEFAULT is None:
        pytest.skip("needs megatron-core installed")
    outs = {key: tmp_path_factory.mktemp(f"megatron_{key[0]}_{key[1]}") for key in LAUNCHES}
    path = {}
    for version, route in LAUNCHES:
        target = release_dir(version)  # fail in seconds when one is missing
        first = [str(patched_copy(version, tmp_path_factory.mktemp(f"patched_{version}")))] if route == "hook" else []
        path[(version, route)] = first + ([str(target)] if target is not None else []) + [str(ROOT)]

    def launch(key) -> None:
        env = cpu_env(ROUTE=key[1], OUT_DIR=str(outs[key]), CHECKPOINT="0", PYTHONPATH=os.pathsep.join(path[key]))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(DIST / "megatron_worker.py")]
        run_logged(cmd, outs[key] / "launch.log", env=env, timeout=900)

    with ThreadPoolExecutor(len(LAUNCHES)) as pool:  # most of a launch is imports
        for done in [pool.submit(launch, key) for key in LAUNCHES]:
            done.result()
    return {key: {"ranks": [json.loads((outs[key] / f"report_rank{r}.json").read_text()) for r in (0, 1)],
                  "bits": torch.load(outs[key] / "bits.pt"), "masters": torch.load(outs[key] / "masters.pt")}
            for key in LAUNCHES}


slow = pytest.mark.slow


@slow
@pytest.mark.parametrize("key", LAUNCHES, ids=lambda k: f"{k[0]}-{k[1]}")
def test_each_launch_runs_the_intended_release(runs, key):
    version, route = key
    target = release_dir(version)
    for report in runs[key]["ranks"]:
        assert report["release"] == version and report["range_problem"] is None
        where = Path(report["megatron_file"]).resolve()
        if route == "hook":
            assert "patched_" in str(where) and report["has_hook"]
        elif target is None:
            assert CACHE.resolve() not in where.parents
        else:
            assert where == (target / "megatron" / "core" / "__init__.py").resolve()


def bits16(t: torch.Tensor) -> torch.Tensor:
    """A bf16 tensor's bit patterns as non-negative integers (the worker saves them so)."""
    return t.reshape(-1).view(torch.int16).to(torch.int32) & 0xFFFF


@slow
@pytest.mark.parametrize("key", LAUNCHES, ids=lambda k: f"{k[0]}-{k[1]}")
@pytest.mark.parametrize("mode", MODES)
def test_served_bits_are_the_reference_cast_of_the_masters(runs, key, mode):
    """Rank 0's gathered parameters after each step equal cast_reference of the gathered fp32 masters."""
    served, masters = runs[key]["bits"][mode], runs[key]["masters"][mode]
    assert len(served) == len(masters) == 3
    residual = {n: torch.zeros(m.numel()) for n, m in masters[0].items()}
    compared = 0
    for step, (got, full) in enumerate(zip(served, masters), start=1):
        assert got.keys() == full.keys() and len(got) == 5
        for name, master in full.items():
            want = cast_reference(master, mode, seed=SEED, step=step, name=name,
                                  residual=residual[name] if mode == "error_feedback" else None)
            assert torch.equal(got[name].to(torch.int32), bits16(want)), f"{key} {mode} step {step}: {name}"
            compared += master.numel()
    assert compared > 3 * 1900
    report = runs[key]["ranks"][0]["cases"][mode]
    assert report["caster_step"] == 3 and report["route"] == key[1]
    assert report["hook_calls"] == (3 if key[1] == "hook" else 0)
    for r in runs[key]["ranks"]:
        assert r["cases"][mode]["guard_steps_checked"] == [3], r["cases"][mode]  # the guard checked every step


@slow
@pytest.mark.parametrize("key", LAUNCHES, ids=lambda k: f"{k[0]}-{k[1]}")
def test_nearest_is_megatrons_own_copy_and_stochastic_is_not(runs, key):
    """Megatron's own copy (no Fair Cast) is round to nearest: the reference's nearest, bit for bit."""
    own, ours, stochastic = (runs[key]["bits"][m] for m in ("megatron", "nearest", "stochastic"))
    for a, b in zip(own, ours):
        assert all(torch.equal(a[n], b[n]) for n in a)
    assert any(not torch.equal(a[n], b[n]) for a, b in zip(stochastic, ours) for n in a)


BYPASSED = {"step": "after the first optimizer step (DistributedOptimizer.step)",
            "never_cast": "optimizer step 1 ran without Fair Cast's cast",
            "load": "after the checkpoint load (noise step 2)"}


@slow
@pytest.mark.parametrize("version", RELEASES)
@pytest.mark.parametrize("case", sorted(BYPASSED))
def test_tampered_served_bits_stop_the_run(runs, version, case):
    """Megatron's round-to-nearest copy run again after Fair Cast's ("step"), Megatron's copy instead of
    Fair Cast's ("never_cast"), one served bit flipped on rank 1 before Fair Cast's checkpoint load
    ("load"): UnsupportedSetupError on both ranks, the same message, naming the release and where."""
    got = [report["bypassed"][case] for report in runs[(version, "runtime")]["ranks"]]
    for g in got:
        assert g["raised"] and g["type"] == "UnsupportedSetupError", g
        message = g["message"]
        assert message.startswith("fair_cast: ") and BYPASSED[case] in message, message
        assert f"megatron-core {version} (" in message and "round-to-nearest" in message
        assert "supports megatron-core>=0.12.0,<0.20" in message
        if case != "never_cast":
            assert "differ from what Fair Cast wrote (first: parameter '" in message
    if case == "load":
        assert "rank 1: " in got[0]["message"] and "1 of " in got[0]["message"]
    assert got[0]["message"] == got[1]["message"]
    assert all(not r["bypassed"]["load_clean"]["raised"] for r in runs[(version, "runtime")]["ranks"])


# the settings whose served copy is not a cast, per release: (field, first release with it), read from the
# release sources; before 0.14.0 Megatron's FSDP is use_custom_fsdp, from 0.14.0 use_megatron_fsdp (and
# use_custom_fsdp stays as its alias)
REFUSED_FROM = {"use_custom_fsdp": (0, 12, 0), "use_megatron_fsdp": (0, 14, 0), "fp8_param_gather": (0, 12, 0),
                "fp4_param_gather": (0, 17, 0), "fp8_recipe": (0, 13, 0),
                "reuse_grad_buf_for_mxfp8_param_ag": (0, 13, 0)}


@slow
@pytest.mark.parametrize("version", RELEASES)
def test_each_release_refuses_its_own_settings_by_name(runs, version):
    refusals = runs[(version, "runtime")]["ranks"][0]["refusals"]
    assert sorted(refusals) == sorted(f for f, first in REFUSED_FROM.items() if vt(version) >= first)
    for field, message in refusals.items():
        assert message is not None, f"{version}: {field} on is not refused"
        assert field in message
        assert ("Megatron-FSDP" in message) == field.endswith("fsdp"), message
