"""The model's error as the tie band, and calibration files: fit, strict reading, use by plan."""
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from hybrid.estimation.calibration import MODEL_ERROR, calibrate, load, predict, save
from hybrid.cli.main import main
from hybrid.config.cluster import Cluster, cpu_spec
from hybrid.errors import HybridError
from hybrid.planning.planner import plan
from hybrid.model.sources import resolve_model
from hybrid.config.spec import TrainSpec

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
GPT2_NODE = ["gpt2", "--nodes", "1", "--gpus-per-node", "8", "--gpu", "a100-80gb", "--seq-len", "1024",
             "--micro-batch", "8"]


@pytest.mark.slow
def test_model_error_is_the_corpus_leave_one_out_median():
    import public_runs
    assert public_runs.model_error() == pytest.approx(MODEL_ERROR, abs=0.0005)


def test_gpt2_on_one_node_picks_ddp_and_says_why(capsys):
    assert main(["plan", *GPT2_NODE, "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["chosen"] == "ddp" and p["chosen_candidate"]["activation_checkpointing"] == "none"
    assert main(["plan", *GPT2_NODE]) == 0
    chosen = [x for x in capsys.readouterr().out.splitlines() if x.startswith("chosen:")][0]
    assert f"within the model's error ({MODEL_ERROR:.1%}) of fsdp-grad-op" in chosen
    assert "measure with hybrid tune" in chosen


@pytest.mark.parametrize("argv", [GPT2_NODE, ["llama2-7b", "--nodes", "8"], ["llama3-70b", "--nodes", "8",
                                                                            "--seq-len", "8192"]])
@pytest.mark.slow
def test_the_chosen_line_calls_nothing_fastest_that_is_not(capsys, argv):
    assert main(["plan", *argv]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [x for x in lines if x.startswith(("*", " ")) and "yes" in x]
    chosen = [x for x in lines if x.startswith("chosen:")][0]
    if not rows[0].startswith("*"):                     # a faster row is listed above the choice
        assert "fastest" not in chosen and "within the model's error" in chosen
    else:
        assert "fastest that fits" in chosen


def _cpu_plan(calibration=None):
    cl = Cluster(1, 4, cpu_spec(4))
    return plan(resolve_model("tiny-gpt").profile, TrainSpec(2, 64, precision="fp32"), cl,
                strategies=["ddp", "zero1", "zero3", "fsdp", "hsdp"], tp=1, pp=1, search_shards=True,
                calibration=calibration), cl


def test_fit_recovers_known_figures_and_plans_use_them(tmp_path, capsys):
    p, cl = _cpu_plan()
    cands = [c for c in p.candidates if c.fits]
    truth = replace(cl, gpu=replace(cl.gpu, efficiency=0.07, intra_node_bw=0.8e9, mem_bw=3e9))
    measured = predict(cands, p.model, truth)          # what a cluster with these figures would run
    cal = calibrate(cands, p.model, cl, measured, [int(c.memory.allocated * 1.1) for c in cands], {"model": "x"})
    assert cal.efficiency == pytest.approx(0.07, rel=0.01)
    assert cal.intra_node_bw == pytest.approx(0.8e9, rel=0.01) and "intra_node_bw" in cal.fitted
    assert "inter_node_bw" not in cal.fitted           # one node: no trial crosses a NIC
    assert cal.error < 0.01 and cal.memory_ratio == pytest.approx(1.1, rel=0.01)
    path = tmp_path / "cal.yaml"
    save(cal, str(path))
    back = load(str(path))
    assert back.efficiency == cal.efficiency and back.trials == cal.trials
    p2, _ = _cpu_plan(back)
    assert p2.tie == cal.error and p2.cluster.gpu.efficiency == cal.efficiency
    one = calibrate(cands[:1], p.model, cl, measured[:1], [1])
    assert one.error < 1e-6 and one.tie == MODEL_ERROR      # one trial, one figure: no residual to go by
    for c in p2.candidates:                            # re-predicted step times are the measured ones
        if c in cands or any(c.label == d.label and c.shard_size == d.shard_size for d in cands):
            want = measured[[(d.label, d.shard_size) for d in cands].index((c.label, c.shard_size))]
            assert c.cost.seconds == pytest.approx(want, rel=0.01)


def _write(tmp_path, **over):
    p, cl = _cpu_plan()
    cands = [c for c in p.candidates if c.fits][:2]
    cal = calibrate(cands, p.model, cl, predict(cands, p.model, cl), [int(c.memory.allocated) for c in cands])
    data = {**cal.to_dict(), **over}
    path = tmp_path / "cal.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path), cal


def test_plan_reads_the_calibration_from_the_flag_the_env_and_the_job_file(tmp_path, capsys, monkeypatch):
    # an a100 calibration with half the catalogue's efficiency
    path, cal = _write(tmp_path, gpu="a100-80gb", efficiency=0.31)
    assert main(["plan", *GPT2_NODE, "--calibration", path]) == 0
    out = capsys.readouterr().out
    assert f"speed calibrated by {path} on 2 trials" in out
    monkeypatch.setenv("HYBRID_CALIBRATION", path)
    assert main(["estimate", *GPT2_NODE, "--strategy", "ddp", "--json"]) == 0
    slow = json.loads(capsys.readouterr().out)["strategies"][0]["step_time_s"]
    monkeypatch.delenv("HYBRID_CALIBRATION")
    job = tmp_path / "job.yaml"
    job.write_text(f"calibration: {path}\n")
    assert main(["estimate", *GPT2_NODE, "--strategy", "ddp", "--json", "--config", str(job)]) == 0
    assert json.loads(capsys.readouterr().out)["calibration"] == path
    assert main(["estimate", *GPT2_NODE, "--strategy", "ddp", "--json"]) == 0
    fast = json.loads(capsys.readouterr().out)["strategies"][0]["step_time_s"]
    assert slow > 1.5 * fast                           # compute dominates: half the efficiency


@pytest.mark.parametrize("over,match", [
    ({"gpu": "a100-80gb", "efficiency": 1.5}, "efficiency must be in"),     # CPU ranks' may exceed 1
    ({"efficiency": "fast"}, "efficiency must be a positive number"),
    ({"mem_bw": -1}, "mem_bw must be a positive number"),
    ({"fitted": ["speed"]}, "fitted must be a list of"),
    ({"trials": []}, "trials must be a non-empty list"),
    ({"trials": [{"layout": "ddp"}]}, r"trials\[0\] must have exactly the keys"),
    ({"version": 9}, r"version 9 is not 2 \(or 1\)"),
    ({"extra": 1}, "unknown key 'extra'"),
])
def test_bad_calibration_files_are_one_line(tmp_path, capsys, over, match):
    path, _ = _write(tmp_path, **over)
    with pytest.raises(HybridError, match=match):
        load(path)
    assert main(["plan", "gpt2", "--calibration", path]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and path in err[0]


def test_a_calibration_for_another_gpu_is_refused(tmp_path):
    path, _ = _write(tmp_path)                         # measured on this machine's CPU ranks
    with pytest.raises(HybridError, match="was measured on 'cpu' but this plan is for 'h100-80gb'"):
        plan(resolve_model("gpt2").profile, TrainSpec(1, 128), Cluster(), calibration=load(path))


def test_not_yaml_and_not_a_mapping(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1\n")
    with pytest.raises(HybridError, match="not valid YAML"):
        load(str(bad))
    bad.write_text("- 1\n")
    with pytest.raises(HybridError, match="a calibration file is a mapping"):
        load(str(bad))


@pytest.mark.parametrize("flags,match", [
    (["--top", "0"], "--top must be between 1 and 10000, got 0"),
    (["--steps", "-1"], "--steps must be between 1 and 10000, got -1"),
    (["--pp", "2"], "tune runs pp 1 layouts for now, got --pp 2"),
    (["--method", "traced"], "--method traced does not apply"),
    (["--save-calibration", "/nonexistent/dir/cal.yaml"], "directory '/nonexistent/dir' does not exist"),
    (["--calibration", "/nonexistent.yaml"], "calibration file '/nonexistent.yaml' does not exist"),
])
def test_tune_refuses_bad_options_before_any_rank_starts(capsys, flags, match):
    assert main(["tune", "tiny-gpt", *flags]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and match in err


def _tune_job():
    """The job of benchmarks/tune_cpu.py: its six layouts on 4 CPU ranks."""
    cl = Cluster(1, 4, replace(cpu_spec(4), memory_bytes=2**30))
    prof = resolve_model(str(ROOT / "benchmarks" / "tune_decoder")).profile
    p = plan(prof, TrainSpec(4, 256, precision="fp32", activation_checkpointing="none"), cl,
             strategies=["ddp", "zero1", "zero2", "zero3", "fsdp", "hsdp"], tp=1, pp=1, search_shards=True)
    return [c for c in p.candidates if c.memory is not None], prof, cl


def test_fit_recovers_known_host_overheads_per_call_and_per_tensor():
    cands, prof, cl = _tune_job()
    truth = replace(cl, gpu=replace(cl.gpu, efficiency=0.6, collective_overhead=4e-3, tensor_overhead=3e-4))
    measured = predict(cands, prof, truth)
    cal = calibrate(cands, prof, cl, measured, [1] * len(cands))
    assert {"collective_overhead", "tensor_overhead"} <= set(cal.fitted)
    assert cal.collective_overhead == pytest.approx(4e-3, rel=0.01)
    assert cal.tensor_overhead == pytest.approx(3e-4, rel=0.01)
    assert cal.efficiency == pytest.approx(0.6, rel=0.01) and cal.error < 0.001
    # the counts are the regressors, kept with each trial: more calls where DeepSpeed buckets
    calls = {t.layout: t.calls for t in cal.trials}
    assert calls["ddp"] < calls["fsdp"] < calls["zero1"] < calls["zero3"]
    # and the uncalibrated catalogue prices no host work: plans without a calibration are unchanged
    assert all(c.cost.host_s == 0 for c in cands)


def test_calibration_files_keep_the_host_terms_and_old_files_still_load(tmp_path, capsys):
    cands, prof, cl = _tune_job()
    truth = replace(cl, gpu=replace(cl.gpu, efficiency=0.6, collective_overhead=4e-3, tensor_overhead=3e-4))
    cal = calibrate(cands, prof, cl, predict(cands, prof, truth), [1] * len(cands), {"model": "x"})
    path = tmp_path / "cal.yaml"
    save(cal, str(path))
    raw = yaml.safe_load(path.read_text())
    assert raw["version"] == 2 and raw["collective_overhead"] == cal.collective_overhead
    assert all(set(t) >= {"calls", "tensors", "residual"} for t in raw["trials"])
    back = load(str(path))
    assert back.trials == cal.trials and back.tensor_overhead == cal.tensor_overhead
    assert [t.residual for t in back.trials] == pytest.approx([t["residual"] for t in raw["trials"]])
    # a version 1 file (no host terms, no counts) loads as no host work, and plans say they used it
    old = {k: v for k, v in raw.items() if k not in ("collective_overhead", "tensor_overhead")}
    old["version"] = 1
    old["fitted"] = [f for f in old["fitted"] if not f.endswith("overhead")]
    old["trials"] = [{k: v for k, v in t.items() if k not in ("calls", "tensors", "residual")} for t in old["trials"]]
    path.write_text(yaml.safe_dump(old))
    v1 = load(str(path))
    assert v1.collective_overhead == 0 and v1.tensor_overhead == 0 and v1.trials[0].calls is None
    argv = ["plan", str(ROOT / "benchmarks" / "tune_decoder"), "--gpu", "cpu", "--gpus-per-node", "4",
            "--gpu-memory", "1GiB", "--micro-batch", "4", "--seq-len", "256", "--precision", "fp32",
            "--activation-checkpointing", "none", "--tp", "1", "--pp", "1", "--calibration", str(path)]
    assert main(argv) == 0
    assert f"speed calibrated by {path} on {len(cands)} trials" in capsys.readouterr().out
    old["collective_overhead"] = 0.001                  # a version 2 key in a version 1 file
    path.write_text(yaml.safe_dump(old))
    with pytest.raises(HybridError, match="unknown key 'collective_overhead' in a version 1 file"):
        load(str(path))
