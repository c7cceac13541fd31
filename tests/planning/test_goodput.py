"""Goodput in the plan: checkpoint bytes and seconds, the Young/Daly interval, failures and restarts
(hybrid/planning/goodput.py), held to published figures, to Daly's model optimised numerically, and
to torch.distributed.checkpoint's own save planner."""
import json
import math
import shlex
from pathlib import Path

import pytest

from hybrid.cli.main import main
from hybrid.config.cluster import Cluster
from hybrid.config.spec import TrainSpec
from hybrid.families.catalogue import load_catalogue
from hybrid.layout.layout import Layout
from hybrid.model.sources import resolve_model
from hybrid.planning.goodput import (MTBF_GPU_HOURS, Reliability, checkpoint_bytes, daly_fraction, daly_interval,
                                     parse_bandwidth, state_bytes)
from hybrid.planning.planner import plan

CAT = load_catalogue()

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.unit
def test_the_default_failure_rate_is_llama3s_one_interruption_every_three_hours():
    # arXiv 2407.21783: 419 unexpected interruptions in 54 days on 16,384 H100s ("one every ~3 hours")
    hours = Reliability().job_mtbf_s(16384) / 3600
    assert hours == pytest.approx(54 * 24 / 419) and 3.0 < hours < 3.2
    assert MTBF_GPU_HOURS == pytest.approx(50677, abs=1)


@pytest.mark.unit
@pytest.mark.parametrize("delta,mtbf,restart", [(5.0, 11000.0, 600.0), (60.0, 3600.0, 300.0), (300.0, 2000.0, 0.0)])
def test_dalys_interval_is_the_optimum_of_dalys_model(delta, mtbf, restart):
    """The closed form against a brute-force maximum of the useful fraction over the interval."""
    tau = daly_interval(delta, mtbf)
    grid = [tau * (0.2 + 0.001 * k) for k in range(3000)]
    best = max(grid, key=lambda t: daly_fraction(t, delta, restart, mtbf))
    assert daly_fraction(tau, delta, restart, mtbf) == pytest.approx(daly_fraction(best, delta, restart, mtbf),
                                                                      rel=1e-3)
    assert abs(tau / best - 1) < 0.1


@pytest.mark.unit
def test_young_is_the_first_order_limit_and_no_failures_is_no_loss():
    assert daly_interval(1.0, 1e8) == pytest.approx(math.sqrt(2 * 1e8), rel=1e-3)
    assert daly_interval(10.0, 4.0) == 4.0                       # delta >= 2M: checkpoint every M
    assert daly_fraction(100.0, 0.0, 0.0, 1e12) == pytest.approx(1.0, abs=1e-6)
    # a checkpoint of delta every tau with no failures costs delta / (tau + delta)
    assert daly_fraction(100.0, 5.0, 0.0, 1e12) == pytest.approx(100 / 105, rel=1e-6)


@pytest.mark.unit
def test_bandwidth_parsing_and_its_errors():
    assert parse_bandwidth("10GB/s") == 1e10
    assert parse_bandwidth("2.5 GiB/s") == 2.5 * 1024**3
    assert parse_bandwidth("800MB/s") == 8e8
    for bad in ("10GB", "fast", "0GB/s", "-1GB/s"):
        with pytest.raises(Exception, match="storage-bandwidth"):
            parse_bandwidth(bad)


def _layout(name, cluster, spec, **kw):
    return Layout.of(CAT[name], cluster, spec, **kw)


@pytest.mark.unit
def test_bytes_per_rank_follow_what_each_family_holds():
    prof = resolve_model("llama2-7b").profile
    spec = TrainSpec(1, 4096)
    whole = state_bytes(prof, spec)
    assert whole == prof.params * 4 + 2 * prof.trainable_params * 4       # fp32 masters + AdamW's two moments
    cl = Cluster.build(8, 8, "h100-80gb")
    for name, held in (("fsdp", whole // 64), ("zero1", whole // 64), ("ddp", whole)):
        write, read = checkpoint_bytes(_layout(name, cl, spec), prof, spec)
        assert write == pytest.approx(whole / 64, rel=1e-6), name         # one copy over the world
        assert read == pytest.approx(held, rel=1e-6), name                # what load reads into
    hsdp = _layout("hsdp", cl, spec, shard_size=8)
    assert checkpoint_bytes(hsdp, prof, spec) == pytest.approx((whole / 64, whole / 8), rel=1e-6)


@pytest.mark.unit
@pytest.mark.slow
def test_the_405b_plan_on_16k_gpus_shows_checkpoints_interval_and_goodput(capsys):
    """The text of the same plan, its ckpt s, every and goodput columns and its failure line, is
    docs/goodput.md's block (tests/test_readme.py re-runs it); here its JSON."""
    assert "a failure every 3.1h on 16,384 GPUs" in (ROOT / "docs" / "goodput.md").read_text()
    assert main(shlex.split("plan llama3.1-405b --nodes 2048 --gpus-per-node 8 --json")) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["mtbf_gpu_hours"] == pytest.approx(MTBF_GPU_HOURS) and data["storage_bandwidth"] > 0
    rows = [r for r in data["strategies"] if r["per_gpu"] is not None]
    for r in rows:
        assert r["checkpoint_s"] > 0 and r["checkpoint_interval_s"] >= r["step_time_s"]
        assert 0 < r["goodput_tokens_per_s_per_gpu"] < r["tokens_per_s_per_gpu"]
        # the interval is whole steps
        steps = r["checkpoint_interval_s"] / r["step_time_s"]
        assert steps == pytest.approx(round(steps), abs=1e-6)


@pytest.mark.unit
def test_goodput_changes_the_choice_and_says_why():
    """On slow storage and with frequent failures a ddp replica reads the whole state back at every
    restart while fsdp reads a shard: the tie on step time goes to ddp, useful tokens to fsdp."""
    prof = resolve_model("gpt2").profile
    spec = TrainSpec(8, 1024)
    cl = Cluster.build(256, 8, "h100-80gb")
    fast = plan(prof, spec, cl, strategies=["ddp", "fsdp"], tp=1, pp=1)
    slow = plan(prof, spec, cl, strategies=["ddp", "fsdp"], tp=1, pp=1,
                reliability=Reliability(mtbf_gpu_hours=2000, storage_bandwidth=parse_bandwidth("20MB/s")))
    ddp = next(c for c in slow.candidates if c.name == "ddp")
    fsdp = next(c for c in slow.candidates if c.name == "fsdp")
    assert ddp.goodput.load_s > 10 * fsdp.goodput.load_s
    assert fast.chosen.name == "ddp" and slow.by_speed is not None and slow.by_speed.name == "ddp"
    assert slow.chosen.name == "fsdp" and fsdp.goodput.tokens_per_s_per_gpu > ddp.goodput.tokens_per_s_per_gpu
    from hybrid.planning.report import format_plan
    assert "why fsdp by goodput: on step time alone the choice is ddp" in format_plan(slow)


@pytest.mark.unit
def test_async_saves_block_for_the_staging_copy_only():
    prof = resolve_model("llama3-8b").profile
    cl = Cluster.build(64, 8, "h100-80gb")
    sync = plan(prof, TrainSpec(1, 4096), cl, strategies=["fsdp"], tp=1, pp=1)
    asyn = plan(prof, TrainSpec(1, 4096), cl, strategies=["fsdp"], tp=1, pp=1,
                reliability=Reliability(async_checkpoint=True))
    s, a = sync.chosen.goodput, asyn.chosen.goodput
    assert a.checkpoint_s < s.checkpoint_s / 10 and a.write_s == s.write_s
    assert a.interval_s >= a.write_s and a.fraction > s.fraction


@pytest.mark.torch
@pytest.mark.parametrize("replicas,shards", [(4, 1), (2, 2), (1, 4)])
def test_bytes_written_per_rank_match_dcps_save_planner(replicas, shards):
    """torch's own save planner on the real model and AdamW state: each rank's local plan as DCP
    builds it, de-duplicated as DCP does (dedup_save_plans), against checkpoint_bytes."""
    import torch
    from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
    from torch.distributed.checkpoint.default_planner import create_default_local_save_plan

    src = resolve_model("tiny-llama")
    model, _ = src.build(device="cpu")
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()                                     # AdamW allocates its state at the first step
    full = {f"model.{n}": p.detach() for n, p in model.named_parameters()}
    full |= {f"optim.{n}.{k}": v for n, p in model.named_parameters() for k, v in opt.state[p].items() if v.dim()}
    world = replicas * shards
    plans = []
    for rank in range(world):          # rank holds shard rank % shards of every tensor (dim 0), as FSDP does
        k = rank % shards
        local = {f"{name}#{k}": t.chunk(shards)[k].clone() if shards > 1 else t for name, t in full.items()}
        plans.append(create_default_local_save_plan(local, rank == 0))
    plans = dedup_save_plans(plans)
    torch_max = max(sum(i.tensor_storage_size() or 0 for i in pl.items) for pl in plans)
    largest = max(t.numel() * t.element_size() for t in full.values())
    spec = TrainSpec(1, 8, precision="fp32")
    cl = Cluster.build(1, world, "h100-80gb")
    lay = _layout("hsdp", cl, spec, shard_size=shards) if 1 < shards < world else \
        _layout("fsdp" if shards == world else "ddp", cl, spec)
    write, held = checkpoint_bytes(lay, src.profile, spec)
    assert sum(t.numel() * t.element_size() for t in full.values()) == state_bytes(src.profile, spec)
    assert abs(write - torch_max) <= largest // max(shards, 1), (write, torch_max)
    assert held == pytest.approx(state_bytes(src.profile, spec) / shards, rel=1e-3)
