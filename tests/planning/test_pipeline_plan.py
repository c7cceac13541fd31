"""Pipeline parallelism, the pure part: schedules, in-flight counts, bubble, stage split, planning."""
import json

import pytest

from hybrid.families.catalogue import load_catalogue
from hybrid.cli.main import main
from hybrid.config.cluster import Cluster
from hybrid.errors import HybridError
from hybrid.layout.pipeline import StageSplit, balanced_split, bubble, even_split, in_flight, rank_actions
from hybrid.planning.planner import plan
from hybrid.model.sources import resolve_model
from hybrid.estimation.shares import stage_of, stage_share
from hybrid.config.spec import TrainSpec

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_in_flight_is_the_schedules_peak(schedule):
    for pp, m in ((2, 4), (4, 8), (4, 4), (8, 16)):
        for rank in range(pp):
            live = peak = 0
            for kind, _, _ in rank_actions(schedule, pp, m, rank):
                live += 1 if kind == "F" else -1
                peak = max(peak, live)
            assert peak == in_flight(schedule, pp, m, rank)


def test_bubble_and_interleaving():
    assert bubble("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert bubble("interleaved", 4, 8, 2) == pytest.approx(3 / 19)
    assert bubble("1f1b", 1, 8) == 0.0


def test_stage_shares_add_up_to_the_model():
    prof = resolve_model("llama2-7b").profile
    for blocks in ((16, 16), (12, 20), (8, 8, 8, 8)):
        lay = StageSplit(len(blocks), "1f1b", 8, blocks)
        shares = [stage_share(prof, lay, r) for r in range(lay.pp)]
        stages = [stage_of(prof, lay, r) for r in range(lay.pp)]
        assert sum(s.params for s in shares) == prof.params
        assert stages[0].first and stages[-1].last and stages[0].in_flight == lay.pp


def test_balanced_split_evens_out_the_largest_stage():
    assert sum(balanced_split(32, [5.0, 0.0, 0.0, 9.0], [1.0, 1.0, 1.0, 1.0])) == 32
    n = balanced_split(32, [5.0, 0.0, 0.0, 9.0], [1.0, 1.0, 1.0, 1.0])
    assert max(f + k for f, k in zip([5, 0, 0, 9], n)) <= 13 and n[3] < n[1]
    assert even_split(10, 4) == (2, 3, 3, 2)


def test_pinned_pipeline_plans_and_rejects():
    prof, cl = resolve_model("llama3-70b").profile, Cluster.build(16, 8, "h100-80gb")
    p = plan(prof, TrainSpec(1, 8192, activation_checkpointing="full", gradient_accumulation=8), cl,
             strategies=["fsdp"], tp=8, pp=4, schedule="1f1b")
    c = p.chosen
    assert c.parallel.shape == (4, 1, 4, 1, 8) and c.pipeline.schedule == "1f1b"
    assert sum(c.pipeline.blocks) == 80 and len(c.stage_memory) == 4
    assert c.memory.total == max(m.total for m in c.stage_memory) and c.cost.bubble_s > 0
    with pytest.raises(HybridError, match="--pp 3 is not a valid pipeline degree"):
        plan(prof, TrainSpec(1, 8192), cl, pp=3)
    one = plan(prof, TrainSpec(1, 8192), cl, strategies=["fsdp"], tp=8, pp=4, schedule="1f1b").candidates[0]
    assert "1f1b needs at least pp = 4 micro-batches" in one.reason


def test_pipeline_json_row_has_every_stage(capsys):
    assert main(["plan", "llama3-70b", "--nodes", "16", "--seq-len", "8192", "--gradient-accumulation", "8",
                 "--pp", "4", "--tp", "8", "--strategy", "fsdp", "--schedule", "1f1b", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["strategies"][0]
    assert row["parallel"]["pp"] == 4 and len(row["pipeline"]["stages"]) == 4
    assert {s["in_flight"] for s in row["pipeline"]["stages"]} == {4, 3, 2, 1}


def test_deepspeed_and_bad_schedules_say_why(capsys):
    cat = load_catalogue()
    p = plan(resolve_model("llama2-7b").profile, TrainSpec(1, 4096, gradient_accumulation=4), Cluster.build(2, 8),
             cat, strategies=["zero3"], pp=2)
    assert "do not run pipeline stages" in p.candidates[0].reason
    assert main(["plan", "gpt2", "--schedule", "zigzag"]) == 2
    assert "invalid choice" in capsys.readouterr().err
