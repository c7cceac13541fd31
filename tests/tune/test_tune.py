"""hybrid tune and auto_wrap(tune=...): short trials on 2 CPU ranks (the full six-strategy run on 4
ranks is benchmarks/tune_cpu.py)."""
import json

import pytest
import torch

from hybrid.estimation.calibration import load
from hybrid.cli.main import main
from hybrid.runtime.launch import run_ranks

pytestmark = pytest.mark.gloo
SMALL = ["tiny-gpt", "--gpus-per-node", "2", "--micro-batch", "2", "--seq-len", "64", "--activation-checkpointing",
         "none", "--tp", "1", "--steps", "2", "--warmup", "2", "--implementation", "hybrid"]


def test_tune_reports_oom_over_the_cap_runs_the_rest_and_calibrates(tmp_path, capsys):
    # 2 ranks: ddp keeps ~4.7 MiB of live tensors, fsdp ~3.7 MiB: a 4.3 MiB cap is OOM for ddp only
    cal = tmp_path / "cal.yaml"
    code = main(["tune", *SMALL, "--strategies", "ddp,fsdp", "--top", "2", "--gpu-memory", f"{int(4.3 * 2**20)}B",
                 "--json", "--save-calibration", str(cal)])
    out = capsys.readouterr().out
    assert code == 0
    r = json.loads(out)
    trials = {t["name"]: t for t in r["trials"]}
    assert trials["ddp"]["status"] == "oom" and "measured peak" in trials["ddp"]["detail"]
    assert trials["fsdp"]["status"] == "ok" and trials["fsdp"]["measured_step_s"] > 0
    assert trials["fsdp"]["measured_allocated_bytes"] <= 4.3 * 2**20
    assert r["chosen"] == "fsdp"                        # the only one measured to run within the cap
    c = load(str(cal))
    assert c.gpu == "cpu" and [t.layout for t in c.trials] == ["fsdp"] and c.fitted == ("efficiency",)
    assert c.trials[0].repredicted_s == pytest.approx(c.trials[0].measured_s, rel=0.01)


def _failing_rank(world_rank_fails):
    from hybrid.config.cluster import detect
    from hybrid.runtime.mesh import init_distributed
    from hybrid.measure.traced import optimizer_factory
    from hybrid.planning.planner import plan
    from hybrid.model.sources import resolve_model
    from hybrid.config.spec import TrainSpec
    from hybrid.tune.trials import tune

    runtime = init_distributed()
    src = resolve_model("tiny-gpt")
    spec = TrainSpec(2, 64, precision="fp32")
    p = plan(src.profile, spec, detect(), strategies=["ddp", "fsdp"], tp=1, pp=1)
    built = []

    def make_model():
        built.append(1)
        if runtime.rank == world_rank_fails and len(built) == 1:
            raise RuntimeError("boom")                  # this rank only, first trial only
        return src.build(device=runtime.device, prefer_hf=False)[0]

    r = tune(p, make_model, optimizer_factory(spec), runtime, p.cluster, top=2, steps=1, warmup=1, fit=False)
    return [(p.candidates[t.index].name, t.status, t.detail) for t in r.trials], r.chosen.name


def test_a_trial_failing_on_one_rank_fails_alone_and_nothing_hangs():
    results = run_ranks(2, _failing_rank, 1, timeout_s=300)
    assert results[0] == results[1]                     # the same verdicts on every rank
    trials, chosen = results[0]
    assert trials[0][1] == "failed" and trials[0][2] == "rank 1: RuntimeError: boom"
    assert trials[1][1] == "ok" and chosen == trials[1][0]


def _wrap_tuned():
    from hybrid import auto_wrap
    from hybrid.model.decoder import build_decoder

    torch.manual_seed(0)
    model = build_decoder("tiny-gpt")
    w = auto_wrap(model, micro_batch=2, seq_len=64, activation_checkpointing="none", tp=1, pp=1, tune=1,
                  verbose=False)
    loss = w.train_step(torch.randint(0, 512, (2, 64)))
    return w.chosen.label, w.plan.chosen.label, loss


def test_auto_wrap_tune_wraps_with_the_measured_choice():
    results = run_ranks(2, _wrap_tuned, timeout_s=300)
    assert results[0] == results[1]
    chosen, plan_chosen, loss = results[0]
    assert chosen == plan_chosen and loss > 0


def test_tune_rows_name_their_candidate_with_the_plan_rows_keys(capsys):
    """One candidate key set across plan and tune JSON: a trial row carries the plan row's keys and
    values (name, family, shard_size, parallel, activation_checkpointing); `layout` stays, deprecated."""
    plan_args = SMALL[:SMALL.index("--steps")]
    assert main(["plan", *plan_args, "--json"]) == 0
    plan_rows = json.loads(capsys.readouterr().out)["strategies"]
    assert main(["tune", *SMALL, "--strategies", "ddp,fsdp", "--top", "2", "--json"]) == 0
    trials = json.loads(capsys.readouterr().out)["trials"]
    assert len(trials) == 2
    keys = {"name", "family", "shard_size", "parallel", "activation_checkpointing"}
    for t in trials:
        [row] = [r for r in plan_rows if (r["name"], r["shard_size"], r["parallel"]) ==
                 (t["name"], t["shard_size"], t["parallel"])]
        assert keys <= set(row) and {k: t[k] for k in keys} == {k: row[k] for k in keys}
        assert set(t) & set(row) == keys and t["layout"] == t["name"]


def test_tune_trials_train_the_global_batch_the_plan_rows_hold(capsys):
    """Every trial trains the plan's one global batch (here implied: micro-batch 1 x accumulation 1 x
    2 GPUs), each layout at its plan row's micro-batch and accumulation (tp 2: one data-parallel rank,
    2 micro-batches): measured tokens/s per GPU x step time x GPUs = global batch x sequence."""
    job = ["tiny-llama", "--gpus-per-node", "2", "--micro-batch", "1", "--seq-len", "64", "--activation-checkpointing",
           "none", "--tp", "2", "--strategy", "fsdp", "--implementation", "hybrid"]
    assert main(["plan", *job, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    rows = {(r["name"], r["parallel"]["tp"]): r["batch"] for r in plan["strategies"] if r.get("batch")}
    assert main(["tune", *job[:-4], "--strategies", "fsdp", "--implementation", "hybrid", "--top", "1",
                 "--steps", "1", "--warmup", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["global_batch"] == plan["global_batch"] == 2
    [t] = [t for t in r["trials"] if t["status"] == "ok"]
    held = rows[(t["name"], t["parallel"]["tp"])]
    assert (t["micro_batch"], t["gradient_accumulation"], t["global_batch"]) == \
        (held["micro_batch"], held["gradient_accumulation"], 2) == (1, 2, 2)
    tokens = t["measured_tokens_per_s_per_gpu"] * t["measured_step_s"] * r["world_size"]
    assert tokens == pytest.approx(r["global_batch"] * r["seq_len"], rel=1e-9)
