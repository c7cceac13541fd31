"""The planner chooses the batch shape at a fixed global batch (hybrid/planning/batch.py)."""
import json
from dataclasses import replace

import pytest

from hybrid.api import plan as api_plan
from hybrid.planning.batch import micro_batch_options
from hybrid.families.catalogue import load_catalogue
from hybrid.cli.main import main
from hybrid.config.cluster import Cluster
from hybrid.planning.planner import judge, plan
from hybrid.model.sources import resolve_model
from hybrid.config.spec import TrainSpec

CAT = load_catalogue()
NODE = Cluster.build(1, 8, "h100-80gb")
LLAMA3 = resolve_model("llama3-8b").profile


def _plan(gb, **kw):
    return plan(LLAMA3, TrainSpec(seq_len=8192, global_batch=gb), NODE, CAT, search_checkpointing=True, **kw)


@pytest.mark.unit
@pytest.mark.slow
def test_every_row_trains_the_global_batch_with_its_own_shape():
    p = _plan(64)
    shapes = set()
    for c in p.candidates:
        assert c.batch is not None and c.batch.global_batch == 64
        if c.memory is None:
            continue
        assert c.spec.micro_batch * c.spec.gradient_accumulation * c.parallel.dp_size == 64, c.label
        assert (c.spec.micro_batch, c.spec.gradient_accumulation) == (c.batch.micro_batch,
                                                                     c.batch.gradient_accumulation)
        if c.pipeline is not None:
            assert c.pipeline.micro_batches == c.spec.gradient_accumulation
        if c.fits:
            assert c.batch.max_micro_batch >= c.batch.micro_batch
        shapes.add((c.spec.micro_batch, c.spec.gradient_accumulation))
    assert len(shapes) > 3                      # the shape is each layout's, not one for all
    assert p.chosen.fits and p.global_batch == 64
    row = p.to_dict()["strategies"][0]["batch"]
    assert set(row) >= {"micro_batch", "gradient_accumulation", "max_micro_batch"}


@pytest.mark.unit
@pytest.mark.slow
def test_max_micro_batch_is_the_largest_that_fits():
    """Judged again independently: the reported largest fits, the next option up does not."""
    p = _plan(64)
    checked = 0
    for c in p.candidates:
        if not c.fits or c.pipeline is not None:
            continue
        per_rank = 64 // c.parallel.dp_size
        opts = micro_batch_options(per_rank)
        top = c.batch.max_micro_batch
        at = lambda mb: judge(c.layout, LLAMA3, replace(c.spec, micro_batch=mb,                    # noqa: E731
                                                         gradient_accumulation=per_rank // mb), NODE)
        assert at(top).fits
        bigger = [mb for mb in opts if mb > top]
        if bigger:
            assert not any(at(mb).fits for mb in bigger), c.label
            checked += 1
    assert checked > 5


@pytest.mark.unit
@pytest.mark.slow
def test_a_layout_whose_ranks_do_not_divide_the_global_batch_is_rejected_with_the_reason():
    p = _plan(12)            # 8 data-parallel ranks do not divide 12; 4 (tp 2) and 2 (tp 4) do
    dp8 = [c for c in p.candidates if c.parallel.dp_size == 8]
    assert dp8 and all(not c.fits and c.memory is None for c in dp8)
    assert "the global batch 12 is not a multiple of this layout's 8 data-parallel ranks" in dp8[0].reason
    assert p.chosen is not None and p.chosen.parallel.dp_size in (1, 2, 4)


@pytest.mark.unit
def test_a_pinned_micro_batch_fixes_the_accumulation():
    p = _plan(64, micro_batch=2, tp=1, pp=1)
    for c in p.candidates:
        if c.memory is not None:
            assert c.spec.micro_batch == 2 and c.spec.gradient_accumulation == 64 // 2 // c.parallel.dp_size
    bad = _plan(64, micro_batch=3, tp=1, pp=1)
    assert "micro-batch 3 does not divide the 8 sequences per data-parallel rank" in bad.candidates[0].reason


@pytest.mark.unit
def test_without_a_global_batch_nothing_is_searched():
    p = plan(LLAMA3, TrainSpec(seq_len=8192, gradient_accumulation=4), NODE, CAT, tp=1, pp=1)
    assert all(c.batch is None and c.spec.micro_batch == 1 for c in p.candidates)
    assert "batch" not in p.to_dict()["strategies"][0] and "global_batch" not in p.to_dict()["spec"]


@pytest.mark.unit
def test_cli_global_batch_tokens_and_job_file_agree(capsys, tmp_path):
    base = ["plan", "llama3-8b", "--gpus-per-node", "8", "--seq-len", "8192", "--json", "--tp", "1", "--pp", "1"]
    assert main(base + ["--global-batch", "64"]) == 0
    by_seqs = json.loads(capsys.readouterr().out)
    assert main(base + ["--global-batch-tokens", str(64 * 8192)]) == 0
    assert json.loads(capsys.readouterr().out) == by_seqs
    job = tmp_path / "job.yaml"
    job.write_text("global_batch: 64\n")
    assert main(base + ["--config", str(job)]) == 0
    assert json.loads(capsys.readouterr().out) == by_seqs
    assert by_seqs["global_batch"] == 64 and by_seqs["spec"]["global_batch"] == 64
    assert api_plan("llama3-8b", cluster=NODE, seq_len=8192, global_batch=64, tp=1, pp=1).to_dict() == by_seqs


@pytest.mark.unit
@pytest.mark.parametrize("extra,message", [
    (["--global-batch", "64", "--gradient-accumulation", "4"],
     "--gradient-accumulation is chosen per layout at a global batch"),
    (["--global-batch", "64", "--global-batch-tokens", "524288"], "give --global-batch (sequences) or"),
    (["--global-batch-tokens", "1000"], "--global-batch-tokens 1000 is not a whole number of 8192-token sequences"),
    (["--global-batch", "0"], "--global-batch must be a positive integer"),
])
def test_bad_global_batch_is_one_line(capsys, extra, message):
    assert main(["plan", "llama3-8b", "--seq-len", "8192", "--json"] + extra) == 2
    out, err = capsys.readouterr()
    assert out == "" and message in err and len(err.strip().splitlines()) == 1


@pytest.mark.unit
@pytest.mark.slow
def test_the_405b_readme_example_trains_one_global_batch_in_every_row():
    p = plan(resolve_model("llama3.1-405b").profile, TrainSpec(seq_len=8192, global_batch=512),
             Cluster.build(16, 8, "h100-80gb"), CAT, search_checkpointing=True)
    assert p.chosen is not None
    assert all(c.spec.micro_batch * c.spec.gradient_accumulation * c.parallel.dp_size == 512
               for c in p.candidates if c.memory is not None)


@pytest.mark.gloo
def test_auto_wrap_feeds_what_the_plan_chose():
    import torch

    from hybrid import auto_wrap
    from hybrid.runtime.mesh import shutdown
    from hybrid.model.decoder import build_decoder
    from tests.runtime.test_backends import TINY
    try:
        w = auto_wrap(build_decoder(TINY, seed=0), precision="fp32", seq_len=16, global_batch=8, verbose=False)
        assert w.micro_batch * w.gradient_accumulation * w.dp_size == 8 == w.global_batch
        assert (w.micro_batch, w.gradient_accumulation) == (w.chosen.batch.micro_batch,
                                                            w.chosen.batch.gradient_accumulation)
        ids = torch.randint(0, TINY.vocab, (w.micro_batch * w.gradient_accumulation, 16))
        loss = w.train_step(ids)
        assert loss == loss and w.optimizer_steps == 1
    finally:
        shutdown()
    with pytest.raises(Exception, match="gradient_accumulation= is chosen per layout"):
        auto_wrap(build_decoder(TINY, seed=0), precision="fp32", seq_len=16, global_batch=8,
                  gradient_accumulation=2, verbose=False)


def _wrap_at_tp2():
    """auto_wrap (strategy auto, tp 2 on these 2 ranks, micro_batch 1 given): the plan's row and what is fed."""
    import torch

    import hybrid
    from hybrid.model.decoder import build_decoder
    from tests.runtime.test_backends import TINY
    w = hybrid.auto_wrap(build_decoder(TINY, seed=0), precision="fp32", micro_batch=1, seq_len=16, tp=2, pp=1,
                         activation_checkpointing="none", verbose=False)
    loss = w.train_step(torch.randint(0, TINY.vocab, (w.micro_batch * w.gradient_accumulation, 16),
                                      generator=torch.Generator().manual_seed(0)))
    row = w.chosen.batch.to_dict() if w.chosen.batch is not None else None
    return (w.chosen.label, w.micro_batch, w.gradient_accumulation, w.dp_size, w.global_batch, row, loss == loss,
            w.optimizer_steps)


@pytest.mark.gloo
def test_auto_wrap_holds_the_implied_global_batch_as_hybrid_plan_does():
    """Without global_batch, strategy auto trains micro-batch x accumulation x the world's GPUs
    (planner.implied_batch) at every layout, as `hybrid plan` holds it: at tp 2 on 2 ranks one
    data-parallel rank takes 2 micro-batches of the given 1 (it took 1 before: half the batch)."""
    from hybrid.runtime.launch import run_ranks
    from tests.runtime.test_backends import TINY
    results = run_ranks(2, _wrap_at_tp2, timeout_s=300)
    assert results[0] == results[1]
    label, mb, ga, dp, gb, row, finite, steps = results[0]
    assert (mb, ga, dp, gb) == (1, 2, 1, 2) and finite and steps == 1
    assert row == {"global_batch": 2, "micro_batch": 1, "gradient_accumulation": 2, "max_micro_batch": 1,
                   "micro_batch_pinned": True}
    from hybrid.config.cluster import Cluster, cpu_spec
    from hybrid.model.profile import profile_decoder
    cpu = Cluster(nodes=1, gpus_per_node=2, gpu=cpu_spec(2))
    p = api_plan(profile_decoder(TINY, "tiny"), cluster=cpu, precision="fp32", micro_batch=1, seq_len=16, tp=2,
                 pp=1, activation_checkpointing="none")
    assert p.chosen.label == label and p.chosen.batch.to_dict() == row


@pytest.mark.unit
@pytest.mark.slow
def test_a_roomy_micro_batch_is_chosen_over_a_faster_tight_one():
    """Review: the search keeps a layout's fitting-with-room shape where it has one, as choose() does."""
    from hybrid.config.cluster import Cluster
    from hybrid.planning.planner import plan
    from hybrid.model.sources import resolve_model
    from hybrid.config.spec import TrainSpec
    prof, cl = resolve_model("llama3-8b").profile, Cluster.build(1, 8, "h100-80gb")
    spec = TrainSpec(1, 8192, global_batch=64)
    searched = plan(prof, spec, cl, search_checkpointing=True)
    at_one = {(c.label, c.shard_size): c
              for c in plan(prof, spec, cl, search_checkpointing=True, micro_batch=1).candidates}
    for c in searched.candidates:
        if c.tight:
            one = at_one[(c.label, c.shard_size)]
            assert not (one.fits and not one.tight), c.label


@pytest.mark.unit
@pytest.mark.slow
def test_a_layout_whose_batch_does_not_divide_is_rejected_not_tight(capsys):
    """A layout rejected before its batch search (100 sequences over 8 data-parallel ranks) is not
    tight: the report once read its missing step time and ended in an AttributeError."""
    assert main(["plan", "llama3-8b", "--global-batch", "100", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["strategies"]
    odd = [r for r in rows if r["reason"].startswith("not applicable: the global batch 100")]
    assert odd and all(r["fits"] is False and r["verdict"] == "n/a" for r in odd)
    assert main(["plan", "llama3-8b", "--global-batch", "100"]) == 0
    assert "chosen:" in capsys.readouterr().out


HELD = [
    "plan llama2-7b --nodes 8 --gpus-per-node 8 --seq-len 4096",                   # tp and pp searched, hsdp widths
    "plan llama3-8b --nodes 2 --gpus-per-node 8 --seq-len 2048 --pp 2",            # a pinned pipeline
    "plan llama3-8b --nodes 2 --gpus-per-node 8 --seq-len 2048 --tp 4 --micro-batch 2",
    "plan llama2-7b --nodes 2 --gpus-per-node 8 --seq-len 2048 --gradient-accumulation 4 --strategy hsdp",
    "plan llama3.1-8b --nodes 1 --gpus-per-node 8 --seq-len 32768",                # cp searched
    "plan llama3-8b --nodes 1 --gpus-per-node 8 --seq-len 2048 --global-batch 64",
    "plan mixtral-8x7b --nodes 8 --gpus-per-node 8 --seq-len 4096",                 # MoE: ep searched
    "plan qwen3-30b-a3b --nodes 2 --gpus-per-node 8 --seq-len 4096 --global-batch 64",
]


@pytest.mark.unit
@pytest.mark.parametrize("command", HELD)
@pytest.mark.slow
def test_every_row_of_a_plan_trains_the_global_batch_its_header_states(capsys, command):
    """tokens/s per GPU x step time x GPUs = global batch x sequence for every row, with or without
    --global-batch (without it: micro-batch x accumulation x the world, each layout at its own shape): dense,
    pp, tp, cp and MoE plans (ep searched)."""
    import shlex
    assert main(shlex.split(command) + ["--all"]) == 0
    table = capsys.readouterr().out
    assert main(shlex.split(command) + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    gb, seq, world = doc["global_batch"], doc["spec"]["seq_len"], doc["world_size"]
    stated = f"global batch {gb} sequences per step in every row"
    assert stated in table, table.splitlines()[:3]
    rows = [r for r in doc["strategies"] if r.get("step_time_s") is not None]
    assert len(rows) > 3 and len({r["parallel"]["dp_replicate"] * r["parallel"]["dp_shard"] for r in rows}) > 1 \
        or "--strategy" in command
    if "mixtral" in command or "a3b" in command:          # the MoE plans hold it for their ep > 1 rows too
        assert any(r["parallel"].get("ep", 1) > 1 for r in rows)
    for r in rows:
        work = r["tokens_per_s_per_gpu"] * r["step_time_s"] * world
        assert work == pytest.approx(gb * seq, rel=0.01), (r["name"], r["parallel"], r.get("batch"))
