"""What each memory method runs (layout.METHOD_REACH) and the planner's estimator interface
(measure/method.RunEstimator): the CLI and the planner never ask a layout's dimensions themselves."""
import json

import pytest

from hybrid.cli.main import main
from hybrid.errors import HybridError
from hybrid.planning.reach import METHOD_REACH, method_degrees


@pytest.mark.unit
def test_unpinned_degrees_are_searched_by_analytic_and_one_elsewhere():
    free = {"tp": None, "pp": None, "cp": None, "ep": None}
    assert method_degrees("analytic", free) == free
    assert method_degrees("traced", free) == {"pp": 1, "tp": 1, "cp": 1, "ep": 1}
    assert method_degrees("measured", {"tp": 1, "pp": 1, "cp": None, "ep": 1}) == {"pp": 1, "tp": 1, "cp": 1, "ep": 1}


@pytest.mark.unit
def test_pinned_degrees_a_method_runs_are_kept():
    assert method_degrees("traced", {"pp": 2, "tp": 4, "cp": None, "ep": None}) == {"pp": 2, "tp": 4, "cp": 1, "ep": 1}
    assert method_degrees("traced", {"cp": 8, "ep": 2}) == {"pp": 1, "tp": 1, "cp": 8, "ep": 2}
    assert method_degrees("analytic", {"tp": 8, "pp": 4, "cp": 2, "ep": 8})["ep"] == 8
    assert method_degrees("measured", {"tp": 2, "cp": 2, "ep": 2}) == {"pp": 1, "tp": 2, "cp": 2, "ep": 2}


@pytest.mark.unit
@pytest.mark.parametrize("method,degrees,match", [
    ("measured", {"pp": 2}, r"--method measured runs pp 1 only; use --method traced or analytic for --pp 2"),
    ("traced", {"tp": 2}, r"--method traced runs tp 1 only \(traced: with --pp\); use --method analytic for --tp 2"),
    ("traced", {"tp": 2, "pp": 1}, r"--method traced runs tp 1 only"),
])
def test_a_pinned_degree_the_method_cannot_run_names_the_methods_that_can(method, degrees, match):
    with pytest.raises(HybridError, match=match):
        method_degrees(method, degrees)


@pytest.mark.unit
def test_every_method_names_only_known_dimensions():
    from hybrid.layout.layout import DIMENSIONS
    for reach in METHOD_REACH.values():
        assert set(reach) <= set(DIMENSIONS) and set(reach.values()) <= {"search", "pinned", *DIMENSIONS}


@pytest.mark.unit
def test_the_cli_refuses_a_degree_the_method_cannot_run(capsys):
    assert main(["plan", "llama2-7b", "--nodes", "2", "--method", "traced", "--tp", "2", "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip().endswith("use --method analytic for --tp 2")


@pytest.mark.fakepg
def test_traced_pipeline_rank_runs_through_the_planners_estimator(capsys):
    """--method traced --pp 2: the planner estimates both pipeline ranks analytically and the
    estimator traces the busiest one's stage in its own process (measure/stages.traced_rank)."""
    code = main(["estimate", "tiny-llama", "--strategy", "fsdp", "--nodes", "2", "--gpus-per-node", "2", "--pp", "2",
                 "--gradient-accumulation", "2", "--seq-len", "64", "--method", "traced", "--implementation", "hybrid",
                 "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    row = json.loads(out)["strategies"][0]
    assert row["parallel"]["pp"] == 2 and len(row["pipeline"]["stages"]) == 2
    assert any(n.startswith("traced pp rank ") for n in row["notes"]), row["notes"]
    assert "tracing fsdp+pp2 (shard 2)" in err


@pytest.mark.gloo
def test_measure_runs_through_the_planners_estimator(capsys):
    """`hybrid measure` (estimate --method measured): the estimator runs the job on 2 CPU ranks, here
    at tp 2 (the layout parallelize applies), and notes what ran; the progress line shows the layout."""
    code = main(["measure", "tiny-llama", "--strategy", "ddp", "--tp", "2", "--seq-len", "32", "--implementation",
                 "hybrid", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    row = json.loads(out)["strategies"][0]
    assert row["per_gpu"]["total"] > 0 and "measured on hybrid's own implementation (hybrid)" in row["notes"]
    assert row["parallel"]["tp"] == 2 and "measuring ddp+tp2 (shard 1)" in err, err


@pytest.mark.fakepg
def test_traced_ddp_buffers_do_not_grow_with_the_world(capsys):
    """DDP's traced buffers are its gradient buckets, whatever the world size: reading the mesh's cp
    degree must not slice sub-meshes inside the tracker (their rank tensors grew with the world)."""
    buffers = []
    for per_node in (2, 8):
        assert main(["estimate", "tiny-llama", "--strategy", "ddp", "--gpus-per-node", str(per_node), "--seq-len",
                     "64", "--method", "traced", "--implementation", "hybrid", "--json"]) == 0
        buffers.append(json.loads(capsys.readouterr().out)["strategies"][0]["per_gpu"]["buffers"])
    assert buffers[0] == buffers[1] > 0, buffers


@pytest.mark.unit
def test_a_rejected_pipeline_candidate_keeps_its_stage_split():
    """A layout whose stage estimate is not applicable (host offload on CPU ranks) still shows its
    pipeline: every label its +ppN, and where the split needs no estimate (interleaved: even chunks)
    the JSON its pipeline entry, the split being made before any rank is estimated."""
    from hybrid import Cluster
    from hybrid.families.catalogue import load_catalogue
    from hybrid.config.cluster import cpu_spec
    from hybrid.planning.planner import plan
    from hybrid.model.sources import resolve_model
    from hybrid.config.spec import TrainSpec

    p = plan(resolve_model("llama3.2-1b").profile, TrainSpec(1, 256, gradient_accumulation=4),
             Cluster.build(2, 2, cpu_spec(4)), load_catalogue(), strategies=["fsdp-offload"], pp=2)
    rejected = [c for c in p.candidates if c.memory is None]
    assert len(rejected) == len(p.candidates) and all("+pp2" in c.label for c in rejected), [c.label for c in rejected]
    interleaved = [c for c in rejected if c.layout.schedule == "interleaved"]
    assert interleaved and all(c.to_dict()["pipeline"]["virtual_stages"] == 2 for c in interleaved)
