"""Fair Cast on every era of DeepSpeed in the supported range, each release beside the default install.

One 2-rank launch per release (tests/dist/releases_worker.py), the releases side by side: ZeRO-1,
ZeRO-2 (with and without CPU offload), ZeRO-3 (with and without) and BF16_Optimizer in every mode on
the same deterministic fp32 masters must serve the default release's bits, which must be the cast of
those masters; the staging route forced on CPU; a save -> load -> continue round trip, bitwise; casts
bypassed on purpose must stop the run with the guard's error. The releases are installed by
launch/setup.d/20-deepspeed-releases.sh (``FAIRCAST_DS_RELEASES`` picks others, e.g. "0.16.8 0.18.4
0.19.5"). Also, without a launch: the range check and what compat detects.
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
from conftest import DIST, ROOT, deepspeed_launch

from faircast_ds.casting.noise import name_id
from faircast_ds.casting.bits import bf16_bits
from faircast_ds.casting.modes import MODES
from faircast_ds.casting.rules import cast
from faircast_ds.deepspeed import compat

sys.path.insert(0, str(DIST))
from common import deterministic_master  # noqa: E402

CACHE = Path(os.environ.get("FAIRCAST_DS_RELEASE_CACHE", "~/.cache/faircast-ds")).expanduser()
CI_RELEASES = ("0.16.9", "0.18.9")
OTHERS = tuple(os.environ.get("FAIRCAST_DS_RELEASES", " ".join(CI_RELEASES)).split())
DEFAULT = importlib.metadata.version("deepspeed")
RELEASES = (DEFAULT,) + tuple(v for v in OTHERS if v != DEFAULT)
STAGES = ("zero1", "zero2", "zero2+offload", "zero3", "zero3+offload", "bf16_optimizer")
CASES = [f"{stage}/{mode}" for stage in STAGES for mode in MODES]
SEED = 1234


def vt(version: str) -> tuple[int, ...]:
    from packaging.version import Version

    return tuple(Version(version).release[:3])


# ---- without a launch ------------------------------------------------------------------------------

@pytest.mark.parametrize("version, inside", [("0.16.0", True), ("0.16.9", True), ("0.18.9", True), ("0.19.8", True),
                                             ("0.19.8+cu124", True), ("0.19.99", True), ("0.15.4", False),
                                             ("0.14.5", False), ("0.20.0", False), ("0.20.0.dev0", False),
                                             ("0.20.0rc1", False), ("1.0.0", False)])
def test_the_supported_range(version, inside):
    problem = compat.release_problem(version)
    assert (problem is None) == inside, problem
    if not inside:
        assert problem.startswith(f"DeepSpeed {version} is not supported: faircast-ds supports deepspeed>=0.16.0,<0.20")
        assert ("weights_only" in problem) == (vt(version) < (0, 16, 0))


def test_an_unreadable_version_is_refused():
    assert "has no version number" in compat.release_problem("not-a-version")


def test_setup_declares_the_range_and_ci_tests_one_release_per_era():
    setup = (ROOT / "setup.py").read_text()
    assert f'"deepspeed{compat.SUPPORTED_RANGE}"' in setup
    assert compat.TESTED == CI_RELEASES + (DEFAULT,)  # the newest is the default install
    steps = (ROOT / "launch" / "setup.d" / "20-deepspeed-releases.sh").read_text()
    assert f'RELEASES="${{FAIRCAST_DS_RELEASES:-{" ".join(CI_RELEASES)}}}"' in steps


REPORTS_THE_VERSION = {"faircast_ds/deepspeed/check.py", "faircast_ds/tools/cli.py"}  # print it, decide nothing


def test_nothing_else_compares_deepspeed_versions():
    """Every release difference is feature-detected in compat; the range check is its one comparison."""
    offenders = []
    for path in (ROOT / "faircast_ds").rglob("*.py"):
        name = str(path.relative_to(ROOT))
        if path.name == "compat.py" or name in REPORTS_THE_VERSION:
            continue
        text = path.read_text()
        if "deepspeed.__version__" in text or "VERIFIED_DEEPSPEED" in text:
            offenders.append(name)
    assert offenders == [], offenders


# ---- the launches ------------------------------------------------------------------------------------

def release_dir(version: str) -> Path | None:
    """Where a release is installed (None: the default install, in site-packages)."""
    if version == DEFAULT:
        return None
    target = CACHE / f"deepspeed-{version}"
    if not (target / ".faircast-complete").exists():
        raise AssertionError(f"DeepSpeed {version} is not installed in {target}: run "
                             f"FAIRCAST_DS_RELEASES='{version}' bash launch/setup.d/20-deepspeed-releases.sh")
    return target


def launch(version: str, out: Path) -> None:
    target = release_dir(version)
    env = {}
    if target is not None:  # first on the path; its own JIT extensions folder (op sources differ per release)
        env = {"PYTHONPATH": os.pathsep.join([str(target), str(ROOT)]),
               "TORCH_EXTENSIONS_DIR": str(target / ".torch_extensions")}
    deepspeed_launch(DIST / "releases_worker.py", 2, out, timeout=1800, runner=True, **env)  # its own runner


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    outs = {v: tmp_path_factory.mktemp(f"release_{v}") for v in RELEASES}
    for v in RELEASES:
        release_dir(v)  # fail in seconds when one is missing
    with ThreadPoolExecutor(len(RELEASES)) as pool:  # most of a launch is imports and waiting
        list(pool.map(lambda v: launch(v, outs[v]), RELEASES))
    return {v: {"ranks": [json.loads((outs[v] / f"releases_rank{r}.json").read_text()) for r in (0, 1)],
                "bits": torch.load(outs[v] / "served.pt")} for v in RELEASES}


slow = pytest.mark.slow  # the tests that read the launches


@slow
@pytest.mark.parametrize("version", RELEASES)
def test_each_rank_runs_the_intended_release(runs, version):
    target = release_dir(version)
    for report in runs[version]["ranks"]:
        assert report["version"] == version
        where = Path(report["file"]).resolve()
        if target is None:
            assert CACHE.resolve() not in where.parents
        else:
            assert where == (target / "deepspeed" / "__init__.py").resolve()
        assert report["range_problem"] is None
        assert report["errors"] == {}, "\n\n".join(f"{k}: {v}" for k, v in report["errors"].items())


FIRST_IN = {  # compat's table, read from the release sources: (fact, first release with it)
    "precision_models": (0, 17, 1), "bf16_master_field": (0, 18, 3), "autocast_field": (0, 18, 0),
    "sub_group_process_groups": (0, 19, 3), "offload_staging": (0, 17, 0),
}


@slow
@pytest.mark.parametrize("version", RELEASES)
def test_compat_detects_what_each_release_has(runs, version):
    cases = runs[version]["ranks"][0]["cases"]
    z3, z2 = cases["zero3/stochastic"]["facts"], cases["zero2+offload/stochastic"]["facts"]
    has = {fact: vt(version) >= first for fact, first in FIRST_IN.items()}
    for fact in ("precision_models", "bf16_master_field", "autocast_field"):
        assert z3[fact] == has[fact], (fact, z3)
    assert z3["bf16"] and not z3["fp16"]
    assert z3["sub_group_process_groups"] == has["sub_group_process_groups"]
    assert z3["universal_load_takes_param_shapes"] == (vt(version) < (0, 18, 0))
    module_load = vt(version) >= (0, 19, 3)
    assert z3["load_sites"] == ["_rigid_load_state_dict", "load_hp_checkpoint_state_from_checkpoint_dir_stage3"] + (
        ["load_module_checkpoint_state_from_checkpoint_dir_stage3"] if module_load else [])
    assert z2["cpu_offload"] and z2["offload_staging"] == has["offload_staging"]
    assert runs[version]["ranks"][0]["bf16_optimizer_buildable"] == (not refuses_bf16_optimizer(version))
    refused = [c for c, info in runs[version]["ranks"][0]["cases"].items() if "refused" in info]
    assert refused == ([f"bf16_optimizer/{m}" for m in MODES] if refuses_bf16_optimizer(version) else [])


def reference_bits(mode: str, numels: dict[str, int]) -> list[dict[str, torch.Tensor]]:
    """The served bits of two casts of the deterministic masters, computed here without DeepSpeed."""
    residual = {n: torch.zeros(k) for n, k in numels.items()}
    out = []
    for step in (1, 2):
        out.append({n: bf16_bits(cast(deterministic_master(name_id(n), 0, k), mode, seed=SEED, step=step, name=n,
                                      start=0, residual=residual[n] if mode == "error_feedback" else None))
                    for n, k in numels.items()})
    return out


def assert_same_bits(got: list, want: list, what: str) -> int:
    compared = 0
    for step in (0, 1):
        assert got[step].keys() == want[step].keys(), what
        for name in want[step]:
            assert torch.equal(got[step][name], want[step][name]), f"{what} step {step + 1}: {name}"
            compared += 1
    return compared


@slow
@pytest.mark.parametrize("mode", MODES)
def test_the_default_release_serves_the_cast_of_the_masters(runs, mode):
    """What every other release is compared with is itself right (and the modes differ: not vacuous)."""
    default = runs[DEFAULT]["bits"]["served"]
    numels = {n: b.numel() for n, b in default[f"zero3/{mode}"][0].items()}
    want = reference_bits(mode, numels)
    for stage in STAGES:
        assert_same_bits(default[f"{stage}/{mode}"], want, f"{DEFAULT} {stage}/{mode}")
    if mode != "nearest":  # (error feedback's first cast, from a zero residual, is round-to-nearest: step 2)
        assert not torch.equal(want[1]["lm_head.weight"], reference_bits("nearest", numels)[1]["lm_head.weight"])


def refuses_bf16_optimizer(version: str) -> bool:
    """0.18.0 - 0.18.4 build FP16_UnfusedOptimizer for BF16_Optimizer's config (see compat)."""
    return (0, 18, 0) <= vt(version) <= (0, 18, 4)


@slow
@pytest.mark.parametrize("version", [v for v in RELEASES if v != DEFAULT])
@pytest.mark.parametrize("case", CASES)
def test_same_served_bits_as_the_default_release(runs, version, case):
    if case.startswith("bf16_optimizer") and refuses_bf16_optimizer(version):
        refused = runs[version]["ranks"][0]["cases"][case]["refused"]
        assert "builds FP16_UnfusedOptimizer (no ZeRO) instead" in refused, refused
        assert case not in runs[version]["bits"]["served"]
        return
    got, want = runs[version]["bits"]["served"][case], runs[DEFAULT]["bits"]["served"][case]
    assert assert_same_bits(got, want, f"{version} {case}") == 2 * 25
    info = runs[version]["ranks"][0]["cases"][case]
    assert info["guard_steps_checked"] == 2  # the guard checked both steps and found nothing


@slow
@pytest.mark.parametrize("version", RELEASES)
def test_forced_staging_route_serves_the_same_bits(runs, version):
    """FAIRCAST_DS_STAGING=always on CPU: the staged route (fused kernel into a staging buffer, one copy)
    serves the direct route's bits; ZeRO-1/2 use DeepSpeed's own pinned buffer where the release has
    one, the caster's own otherwise and under ZeRO-3."""
    report = runs[version]["ranks"][0]["forced"]
    bits = runs[version]["bits"]["forced"]
    assert sorted(report) == sorted(bits) and len(bits) == 4
    for case, info in report.items():
        assert info["force_staging"]
        numels = {n: b.numel() for n, b in bits[case][0].items()}
        assert_same_bits(bits[case], reference_bits(case.split("/")[1], numels), f"{version} forced {case}")
        if case.startswith("zero3"):
            assert info["own_staging"] == ["0"]
        elif info["facts"]["offload_staging"]:
            assert info["own_staging"] == [] and info["deepspeed_buffer_holds_served"], info
        else:
            assert info["own_staging"] == ["0"]


@slow
@pytest.mark.parametrize("version", RELEASES)
@pytest.mark.parametrize("case", ("zero3/error_feedback", "zero2/error_feedback"))
def test_save_load_continue_is_bitwise(runs, version, case):
    from conftest import assert_bitwise

    trip = runs[version]["bits"]["round_trips"][case]
    assert_bitwise(trip["loaded"], trip["saved"], f"{version} {case}: after the load")
    assert_bitwise(trip["resumed"], trip["straight"], f"{version} {case}: the step after the load")
    assert trip["resumed"]["step"] == trip["straight"]["step"] == 3
    assert not all(torch.equal(trip["straight"]["served"][n], trip["saved"]["served"][n])
                   for n in trip["saved"]["served"])  # step 3 moved the served weights
    assert runs[version]["ranks"][0]["round_trips"][case]["guard_steps_checked"] == 1


BYPASSED = {"step/zero2": "after the first optimizer step (DeepSpeedZeroOptimizer.step)",
            "step/zero3": "after the first optimizer step (DeepSpeedZeroOptimizer_Stage3.step)",
            "never_cast/zero3": "optimizer step 1 ran without Fair Cast's cast",
            "load/zero2": "after load_checkpoint(", "load/zero3": "after load_checkpoint("}


@slow
@pytest.mark.parametrize("version", RELEASES)
@pytest.mark.parametrize("case", sorted(BYPASSED))
def test_a_bypassed_cast_site_stops_the_run(runs, version, case):
    """DeepSpeed monkeypatched to overwrite the served partition by round-to-nearest after Fair Cast's cast
    (or to call its own refresh instead): UnsupportedSetupError on both ranks, naming the release, where
    it was seen and the first differing element. The ZeRO-2 load reads a copy of the checkpoint with one
    module element changed: a load whose restore changes no served bit skips the all-gather, and with it
    the refresh the bypass hooks (tests/dist/releases_worker.py tampered_copy)."""
    got = [report["bypassed"][case] for report in runs[version]["ranks"]]
    for g in got:
        assert g["raised"] and g["type"] == "UnsupportedSetupError", g
        message = g["message"]
        assert message.startswith("fair_cast: ")
        assert BYPASSED[case] in message
        assert f"DeepSpeed {version} (" in message and "round-to-nearest" in message
        assert f"supports deepspeed{compat.SUPPORTED_RANGE}" in message
        if not case.startswith("never_cast"):
            assert "differ from what Fair Cast wrote (first: parameter '" in message
    assert got[0]["message"] == got[1]["message"]  # agreed across ranks


# ---- patches -----------------------------------------------------------------------------------------

PATCHES = ROOT / "patches"
TOUCHED = ["deepspeed/runtime/bf16_optimizer.py", "deepspeed/runtime/config.py", "deepspeed/runtime/zero/stage3.py",
           "deepspeed/runtime/zero/stage_1_and_2.py"]


def patch_for(version: str) -> Path:
    """The DeepSpeed patch variant that patches/README.md lists for ``version``."""
    for line in (PATCHES / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) > 3 and cells[1].startswith("`deepspeed-0.") and version in cells[2].split(", "):
            return PATCHES / cells[1].strip("`")
    raise AssertionError(f"patches/README.md lists no DeepSpeed patch for {version}")


def site_of(version: str) -> Path:
    target = release_dir(version)
    if target is not None:
        return target
    import importlib.util

    return Path(importlib.util.find_spec("deepspeed").origin).parent.parent


def code(path: Path) -> str:
    return "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))


@pytest.mark.parametrize("version", RELEASES)
def test_the_release_patch_applies_exactly_and_routes_every_site(version, tmp_path):
    if not shutil.which("patch"):
        pytest.skip("no patch command")
    patch, site = patch_for(version), site_of(version)
    proc = subprocess.run(["patch", "-p1", "--forward", "--dry-run", "--fuzz=0", "-d", str(site), "-i", str(patch)],
                          capture_output=True, text=True)
    assert proc.returncode == 0 and "fuzz" not in proc.stdout, f"{patch.name} on {version}:\n{proc.stdout}{proc.stderr}"
    for path in TOUCHED:  # a copy of the files it touches, patched
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(site / path, tmp_path / path)
    proc = subprocess.run(["patch", "-p1", "--forward", "--fuzz=0", "-d", str(tmp_path), "-i", str(patch)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "deepspeed/runtime/lp_cast.py").exists()
    stage3, stage12 = code(tmp_path / TOUCHED[2]), code(tmp_path / TOUCHED[3])
    bf16 = code(tmp_path / TOUCHED[0])
    module_only_load = "def load_module_checkpoint_state_from_checkpoint_dir_stage3" in stage3
    assert module_only_load == (vt(version) >= (0, 19, 3))
    # every refresh site of this release: ZeRO-3 step, rigid load, universal load (+ module-only load);
    # ZeRO-1/2 step with and without offload, update_lp_params; BF16_Optimizer's update_lp_params
    assert stage3.count("cast_hp_to_lp(") == 3 + module_only_load
    assert "fp16_partitioned_groups_flat[sub_group_id].data.copy_(" not in stage3
    assert "fp16_param.data.copy_(fp32_param.data)" not in stage3
    assert stage12.count("cast_hp_to_lp(") == 3 and "bit16_partitions[partition_id].data.copy_(fp32_partition" not in stage12
    assert bf16.count("cast_hp_to_lp(") == 1 and "update_lp_params(after_step=True)" in bf16
    assert "get_fair_cast_config(param_dict)" in code(tmp_path / TOUCHED[1])
