"""Served-weight export and weight sync with real DeepSpeed (ZeRO-3 and ZeRO-2, 2 CPU ranks), one
launch, plus a receiver process the test starts itself (not part of the training job)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import DIST, ROOT, cpu_env, deepspeed_launch

pytestmark = pytest.mark.slow
MODES = ("nearest", "stochastic", "dither", "error_feedback")
SESSIONS = [f"zero3/{m}" for m in MODES] + ["zero2/stochastic"]
TOTAL = 25088  # parameters of the tiny Qwen3
STEPS = 4


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def wait_for(path: Path, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"receiver exited with {proc.returncode} before listening")
        if time.monotonic() > deadline:
            raise AssertionError(f"receiver did not start listening within {timeout}s")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("export_zero")
    root = out / "artifacts"
    port_file, log = out / "receiver.port", out / "receiver.jsonl"
    with open(out / "receiver.log", "w") as receiver_log:
        receiver = subprocess.Popen(
            [sys.executable, str(DIST / "export_receiver.py"), "--port-file", str(port_file), "--log", str(log),
             "--sessions", str(len(SESSIONS)), "--timeout", "240",
             "--allow-rollback"],
            stdout=receiver_log, stderr=subprocess.STDOUT, env=cpu_env(), cwd=ROOT)
        try:
            wait_for(port_file, receiver, 300)  # a liveness limit only
            deepspeed_launch(DIST / "export_worker.py", 2, out, timeout=420,
                             args=["--root", str(root), "--receiver-port", port_file.read_text(),
                                   "--steps", str(STEPS)])
            receiver.wait(timeout=60)
        finally:
            if receiver.poll() is None:
                receiver.kill()
                receiver.wait(timeout=10)
    assert receiver.returncode == 0, (out / "receiver.log").read_text()[-4000:]
    ranks = [json.loads((out / f"export_rank{r}.json").read_text()) for r in range(2)]
    return {"out": out, "root": root, "ranks": ranks, "receiver": read_jsonl(log)}


@pytest.mark.parametrize("stage", ("zero3", "zero2"))
def test_served_weights_are_what_the_forward_used(run, stage):
    for rank in run["ranks"]:
        r = rank["served"][stage]
        assert r["names"] == r["param_names"] == sorted(r["forward_used"], key=r["names"].index)
        assert len(r["names"]) == 25 and r["shapes_ok"]
        assert r["equal_to_forward"], "a served weight differs from what the trainer's forward used"
        assert r["dtypes"] == ["torch.bfloat16"]


def test_zero3_gathers_one_bf16_parameter_at_a_time(run):
    for rank in run["ranks"]:
        r = rank["served"]["zero3"]
        assert r["max_full_params_held"] == 1 and r["others_held"] == [], "more than one full parameter held at once"
        assert r["persistent"], "the check covers persistent (always gathered) parameters too"
        assert r["n_collectives"] > 0
        assert all(c.endswith(":torch.bfloat16") for c in r["collectives"]), r["collectives"]


def test_zero2_reads_in_place_without_communicating(run):
    for rank in run["ranks"]:
        r = rank["served"]["zero2"]
        assert r["zero_copy"] and r["n_collectives"] == 0, r["collectives"]


@pytest.mark.parametrize("stage", ("zero3", "zero2"))
def test_export_loads_in_transformers_with_the_trainers_logits(run, stage):
    e = run["ranks"][0]["served"][stage]["export"]
    assert e["weights_equal"], "the loaded weights differ from the served weights"
    assert e["loaded_dtype"] == e["logits_dtype"] == "torch.bfloat16"
    assert e["logits_equal"], f"logits differ by up to {e['logits_max_abs_diff']}"
    assert e["version"] == e["global_steps"] == 2
    if stage == "zero3":  # sharded: the index file maps each tensor
        assert len(e["files"]) > 1 and all(f.startswith("model-0000") for f in e["files"])
        assert (run["root"] / "zero3_export" / "model.safetensors.index.json").exists()
    else:
        assert e["files"] == ["model.safetensors"]
    manifest = json.loads((run["root"] / f"{stage}_export" / "faircast_export.json").read_text())
    assert manifest["fair_cast"] == {"mode": "stochastic", "seed": 1234, "step": 2}
    assert not [p.name for p in run["root"].iterdir() if p.name.startswith(f".{stage}_export")], "temp dir left"


def sessions(run) -> dict[str, list[dict]]:
    by_session: dict[str, list[dict]] = {}
    for record in run["receiver"]:
        if "session" in record:
            by_session.setdefault(SESSIONS[record["session"]], []).append(record)
    return by_session


@pytest.mark.parametrize("session", SESSIONS)
def test_receiver_process_serves_the_trainers_weights_bitwise(run, session):
    received = sessions(run)[session]
    assert not [r for r in received if "error" in r], received
    for rank in run["ranks"]:
        sent = rank["sync"][session]
        assert sent["can_delta"]
        assert [u["version"] for u in sent["updates"]] == [r["version"] for r in received]
        assert [u["kind"] for u in sent["updates"]] == ["dense"] + ["delta"] * (len(sent["updates"]) - 1)
        for u, r in zip(sent["updates"], received):
            assert u["digest"] == r["digest"], f"{session} version {u['version']}: receiver's weights differ"
            # what the sender carried is what the receiver wrote (a parameter sent whole: all its elements)
            assert (u["elements"], u["params"]) == (r["changed"], r["params"])
        # greedy tokens of the receiver's own HF model after the last update = the trainer's served model
        assert received[-1]["tokens"] == sent["tokens"] and len(sent["tokens"]) == 8
    assert run["receiver"][-1] == {"done": True}


def test_the_receiver_started_from_other_weights(run):
    first = run["receiver"][0]
    assert first["initial_digest"] != run["receiver"][1]["digest"]
    assert first["initial_tokens"] != run["ranks"][0]["sync"]["zero3/nearest"]["tokens"]


def test_weights_really_moved_between_syncs(run):
    for session in SESSIONS:
        digests = [u["digest"] for u in run["ranks"][0]["sync"][session]["updates"]]
        assert len(set(digests)) == len(digests), f"{session}: a step left the served weights unchanged"


@pytest.mark.parametrize("mode", MODES)
def test_delta_carries_exactly_the_changed_elements(run, mode):
    updates = run["ranks"][0]["sync"][f"zero3/{mode}"]["updates"]
    dense = updates[0]
    assert dense["changed"] == TOTAL and dense["bytes"] >= 2 * TOTAL
    for u in updates[1:]:
        # what the cast changed in the served shards is what the delta carried
        assert u["changed"] == u["cast_changed"], u
        assert 0 < u["bytes"] < dense["bytes"]


@pytest.mark.parametrize("session", SESSIONS)
def test_deltas_read_the_casts_change_marks(run, session):
    """With Fair Cast attached the delta's changes come from the casts' change marks, 1 bit per shard
    element on each rank, not from a 2-byte copy of the bits sent (the counts themselves are checked
    against consecutive snapshots by the test below)."""
    for rank in run["ranks"]:
        for u in rank["sync"][session]["updates"][1:]:
            assert u["tracking"] == "marks", u
            # this rank's half of the model at 1 bit per element, each flat shard's bitmap in whole words
            assert 0 < u["tracking_bytes"] <= TOTAL // 2 // 8 + 4 * 64, u


@pytest.mark.parametrize("session", SESSIONS)
def test_one_walk_per_sync_gathers_each_sent_parameter_once_and_only_what_changed(run, session):
    """Per sync, ZeRO-3 gathers (bf16 all-gathers traced below the product) = the parameters the walk
    sent that ZeRO-3 did not hold in full: every one for a dense sync, only the changed ones for a
    delta; the changed set and each parameter's changed count = consecutive served snapshots compared
    element by element (DeepSpeed's own gather, outside the sync)."""
    for rank in run["ranks"]:
        sent = rank["sync"][session]
        names, gathered = sent["names"], set(sent["gathered"])
        assert bool(gathered) == session.startswith("zero3/")
        for u in sent["updates"]:
            walked = [n for n, _ in u["walked"]]
            if u["kind"] == "dense":
                assert walked == names
            else:
                changed = {n: k for n, k in u["oracle_changed"].items() if k}
                assert walked == [n for n in names if n in changed], f"{session} v{u['version']}"
                assert dict(u["walked"]) == changed and u["changed"] == sum(changed.values())
                assert u["params"] == len(changed)
            # one gather per sent parameter ZeRO-3 did not hold in full (at the first sync, before any forward,
            # the persistent ones too); never one for a parameter the walk skipped
            assert u["traced_gathers"] == u["expected_gathers"], u
            assert len([n for n in walked if n in gathered]) <= u["traced_gathers"] <= len(walked)
            if session.startswith("zero3/"):
                assert u["traced_gathers"] > 0
    # not vacuous: some delta of this session left unchanged parameters out (and so ungathered)
    updates = run["ranks"][0]["sync"][session]["updates"]
    assert any(u["kind"] == "delta" and u["params"] < len(run["ranks"][0]["sync"][session]["names"]) for u in updates)


def test_bytes_per_step_table(run, capsys):
    rows = ["| mode | dense sync (bytes) | delta sync, mean bytes/step | changed elements/step | delta/dense |",
            "|---|---|---|---|---|"]
    for mode in MODES:
        updates = run["ranks"][0]["sync"][f"zero3/{mode}"]["updates"]
        dense, deltas = updates[0], updates[1:]
        mean = sum(u["bytes"] for u in deltas) / len(deltas)
        changed = sum(u["changed"] for u in deltas) / len(deltas)
        rows.append(f"| {mode} | {dense['bytes']} | {mean:.0f} | {changed:.0f} ({100 * changed / TOTAL:.2f}%) | "
                    f"{mean / dense['bytes']:.3f} |")
    table = "\n".join(rows)
    (run["out"] / "bytes_per_step.md").write_text(table + "\n")
    with capsys.disabled():
        print(f"\nweight sync bytes per step, tiny Qwen3 ({TOTAL} params), ZeRO-3 on 2 ranks, AdamW lr 3e-6, "
              f"{STEPS} steps:\n{table}")
    bytes_by_mode = {m: run["ranks"][0]["sync"][f"zero3/{m}"]["updates"][1:] for m in MODES}
    # fresh noise every step moves more served weights than nearest or dither
    assert sum(u["bytes"] for u in bytes_by_mode["stochastic"]) > sum(u["bytes"] for u in bytes_by_mode["nearest"])
    assert sum(u["bytes"] for u in bytes_by_mode["stochastic"]) > sum(u["bytes"] for u in bytes_by_mode["dither"])


def inspect(*args: str) -> tuple[int, str]:
    """`faircast-ds inspect ARGS` as users run it (a new process)."""
    proc = subprocess.run([sys.executable, "-m", "faircast_ds.tools.cli", "inspect", *map(str, args)], capture_output=True,
                          text=True, env=cpu_env(), cwd=ROOT, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr if proc.returncode > 1 else proc.stdout


def inspect_json(capsys, *args: str) -> dict:
    """The same command in this process, its --json output parsed."""
    from faircast_ds.tools import cli

    capsys.readouterr()
    assert cli.main(["inspect", *map(str, args), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# per module type of the tiny Qwen3 (2 layers, hidden 32, intermediate 64, 4 heads x 8, 2 kv heads)
TYPE_ELEMENTS = {"lm_head.weight": 3232, "model.embed_tokens.weight": 3232, "model.norm.weight": 32,
                 "model.layers.*.mlp.up_proj.weight": 4096, "model.layers.*.mlp.gate_proj.weight": 4096,
                 "model.layers.*.mlp.down_proj.weight": 4096, "model.layers.*.self_attn.q_proj.weight": 2048,
                 "model.layers.*.self_attn.o_proj.weight": 2048, "model.layers.*.self_attn.k_proj.weight": 1024,
                 "model.layers.*.self_attn.v_proj.weight": 1024, "model.layers.*.self_attn.q_norm.weight": 16,
                 "model.layers.*.self_attn.k_norm.weight": 16, "model.layers.*.input_layernorm.weight": 64,
                 "model.layers.*.post_attention_layernorm.weight": 64}


def test_inspect_checkpoint_reports_residuals_per_module_type(run, capsys):
    report = inspect_json(capsys, run["root"] / "ckpt" / "step3")
    expected = run["ranks"][0]["inspect"]
    assert (report["mode"], report["step"], report["world_size"], report["zero_stage"]) == ("error_feedback", 3, 2, 3)
    assert {g: r["elements"] for g, r in report["groups"].items()} == TYPE_ELEMENTS
    assert report["total"]["elements"] == TOTAL and report["total"]["params"] == 25
    # the same statistic computed from the live engine's residual and served shards
    assert report["total"]["mean_abs_residual_spacings"] == pytest.approx(expected["mean_abs_residual_spacings"],
                                                                           rel=1e-9)
    assert 0.05 < report["total"]["mean_abs_residual_spacings"] < 0.5
    by_layer = inspect_json(capsys, run["root"] / "ckpt" / "step3", "--by", "layer")
    assert sorted(by_layer["groups"]) == ["lm_head", "model.embed_tokens", "model.layers.0", "model.layers.1",
                                          "model.norm"]
    assert by_layer["groups"]["model.layers.1"]["elements"] == 9296


def test_inspect_export_with_its_checkpoint(run, tmp_path, capsys):
    export, ckpt = run["root"] / "ef_export", run["root"] / "ckpt" / "step3"
    report = inspect_json(capsys, export, "--checkpoint", ckpt)
    expected = run["ranks"][0]["inspect"]
    assert report["integrity"] == "ok" and report["version"] == 3 and report["missing_masters"] == []
    assert report["fair_cast"] == {"mode": "error_feedback", "seed": 1234, "step": 3}
    assert report["total"]["dtypes"] == {"BF16": TOTAL}
    assert report["groups"]["model.layers.*.mlp.up_proj.weight"]["shapes"] == {
        f"model.layers.{i}.mlp.up_proj.weight": [64, 32] for i in (0, 1)}
    assert report["total"]["mean_abs_master_minus_served_spacings"] == pytest.approx(
        expected["mean_abs_master_minus_served_spacings"], rel=1e-9)
    rc, text = inspect(export, "--checkpoint", ckpt)  # the command's text output
    assert rc == 0 and "sha256 ok" in text and "101x32" in text, text
    assert "mean |master - served| (bf16 spacings)" in text and text.splitlines()[0].startswith("export ")
    # a damaged export is reported (exit 1), not summarized as if it were fine
    damaged = tmp_path / "damaged"
    shutil.copytree(export, damaged)
    weights = damaged / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x40
    weights.write_bytes(bytes(data))
    from faircast_ds.tools import cli

    capsys.readouterr()
    assert cli.main(["inspect", str(damaged)]) == 1
    text = capsys.readouterr().out
    assert "MISMATCH" in text and "model.safetensors" in text
