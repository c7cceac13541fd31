"""The allocator model, the bus bandwidth of groups across nodes, and the public-runs corpus
replay (benchmarks/public_runs.py): what the calibrated figures are calibrated on."""
import json
import sys
from pathlib import Path

import pytest

from hybrid.cli.main import main
from hybrid.config.cluster import Cluster, allocator_expandable, get_gpu
from hybrid.estimation.cost.links import Links
from hybrid.estimation.memory.breakdown import ALLOCATOR_HEADROOM, EXPANDABLE_HEADROOM

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_expandable_segments_follow_the_users_allocator_setting():
    assert allocator_expandable({}) is True                         # auto_wrap will set it
    assert allocator_expandable({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}) is True
    assert allocator_expandable({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}) is False
    assert allocator_expandable({"PYTORCH_ALLOC_CONF": "expandable_segments:False"}) is False


def _row(capsys, *flags):
    assert main(["estimate", "llama2-7b", "--nodes", "8", "--strategy", "fsdp", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)["strategies"][0]


def test_json_rows_separate_allocated_reserved_and_the_context(capsys):
    ctx = get_gpu("h100-80gb").cuda_context_bytes
    for flags, h in ((("--expandable-segments", "on"), EXPANDABLE_HEADROOM),
                     (("--expandable-segments", "off"), ALLOCATOR_HEADROOM), (("--headroom", "0.5"), 0.5)):
        r = _row(capsys, *flags)
        alloc, res = r["allocated_bytes"], r["reserved_bytes"]
        assert res == pytest.approx(alloc * (1 + h), abs=2)
        assert r["per_gpu"]["total"] == pytest.approx(res + ctx, abs=2)       # total = reserved + context


def test_bad_headroom_is_one_line(capsys):
    assert main(["estimate", "llama2-7b", "--strategy", "fsdp", "--headroom", "-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "headroom" in err[0] and "-1" in err[0]


def test_groups_across_nodes_ride_one_nic_per_local_rank():
    h100 = Cluster.build(8, 8, "h100-80gb")
    links = Links(h100)
    assert links.bw(8) == h100.gpu.intra_node_bw
    assert links.bw(64) == min(h100.gpu.intra_node_bw, 8 * h100.gpu.inter_node_bw)   # 8 NICs side by side
    assert links.across_replicas("all_reduce", 1e9, 8) > links.collective("all_reduce", 1e9, 64)


def test_the_corpus_replays_with_its_sources():
    import public_runs
    sources, points = public_runs.load()
    assert len(points) >= 15 and len({p.raw["source"] for p in points}) >= 5
    for p in points:
        assert p.raw["source"] in sources and p.raw["quote"]
    by_id = {p.id: p for p in points}
    # the two published active/reserved pairs: allocated within 5%; reserved held out: the headroom
    # fitted on the other pair alone (leave-one-out, not the mean ALLOCATOR_HEADROOM takes of both)
    # predicts each one's reserved from our allocated within 20% (it is -16% and +11%: the error to
    # expect of reserved on a run the corpus has not seen, docs/estimation.md)
    pair = ("tt165-fsdp2-full-ac", "tt165-fsdp2-op-sac")
    for pid, other in zip(pair, reversed(pair)):
        p, q = by_id[pid], by_id[other].measured
        m = p.candidate().memory
        assert m.allocated / 2**30 == pytest.approx(p.measured["allocated_gib"], rel=0.05)
        held_out = q["reserved_gib"] / q["allocated_gib"] - 1
        assert m.allocated * (1 + held_out) / 2**30 == pytest.approx(p.measured["reserved_gib"], rel=0.20)
    # the published OOMs are OOM
    for pid in ("tt-docs-llama2-70b-op-b2", "tt-docs-405b-fsdp-oom"):
        assert not by_id[pid].candidate().fits


def test_public_runs_script_runs(tmp_path, monkeypatch):
    import public_runs
    monkeypatch.setattr(public_runs, "OUT", tmp_path / "out.md")
    assert public_runs.main(["--calibrate"]) == 0
    text = (tmp_path / "out.md").read_text()
    assert "fits/OOM verdicts" in text and "leave-one-out" in text and "## Calibration" in text


def test_three_verdicts_fits_tight_oom(capsys):
    """Between what must fit (live tensors + context + floor) and the roomy-GPU total, a candidate
    is tight: it runs on the allocator's retries and says so, with what buys room."""
    r = _row(capsys, "--expandable-segments", "off")
    assert r["verdict"] == "fits" and r["fits"]
    ctx = get_gpu("h100-80gb").cuda_context_bytes
    needed = r["allocated_bytes"] + ctx + r["floor_bytes"]
    assert 0 < r["floor_bytes"] < r["reserved_bytes"] - r["allocated_bytes"]
    between = (needed + r["per_gpu"]["total"]) // 2
    t = _row(capsys, "--expandable-segments", "off", "--gpu-memory", f"{between}B")
    assert t["verdict"] == "tight" and t["fits"]
    assert "tight" in t["reason"] and "frees its cache" in t["reason"] and "expandable_segments:True" in t["reason"]
    o = _row(capsys, "--expandable-segments", "off", "--gpu-memory", f"{needed - 2**20}B")
    assert o["verdict"] == "OOM" and not o["fits"] and "cache given back" in o["reason"]


def test_the_floor_follows_the_allocator():
    """The floor is the split segments' free part: a freed block transient plus part-used segments
    with the default allocator; only part-used pages with expandable segments; none on CPU ranks."""
    from hybrid.estimation.memory.breakdown import LARGE_SEGMENT, fragmentation_floor
    on = Cluster.build(1, 8, "h100-80gb", expandable_segments=True)
    off = Cluster.build(1, 8, "h100-80gb", expandable_segments=False)
    assert fragmentation_floor(off, 2**30) == 2**30 + fragmentation_floor(off, 0)
    assert fragmentation_floor(on, 2**30) == fragmentation_floor(on, 0) <= 6 * LARGE_SEGMENT
    from hybrid.config.cluster import cpu_spec
    assert fragmentation_floor(Cluster(nodes=1, gpus_per_node=2, gpu=cpu_spec(2)), 2**30) == 0


def test_plan_prefers_fits_over_a_faster_tight_layout(capsys):
    """A tight candidate is chosen only when nothing fits with room; a faster tight one is named."""
    from hybrid.planning.planner import plan
    from hybrid.model.presets import get_preset
    from hybrid.model.profile import profile_decoder
    from hybrid.config.spec import TrainSpec
    prof = profile_decoder(get_preset("llama2-13b"), "llama2-13b")
    spec = TrainSpec(micro_batch=2, seq_len=4096)
    cl = Cluster.build(8, 8, "a100-80gb", expandable_segments=False)
    p = plan(prof, spec, cl, strategies=["fsdp"], search_checkpointing=True, tp=1, pp=1)
    tight = [c for c in p.candidates if c.tight]
    assert tight and p.chosen.verdict == "fits"
    assert min(c.cost.time_per_token for c in tight) < p.chosen.cost.time_per_token
    assert "tight and faster: fsdp" in str(p)
    only = plan(prof, spec, cl, strategies=["fsdp"], tp=1, pp=1)      # no checkpointing searched
    assert only.chosen.verdict == "tight" and "fits tightly" in str(only)


@pytest.mark.slow
def test_every_published_run_gets_its_verdict():
    """Done when: every published run that trained is fits or tight, every published OOM is OOM."""
    import public_runs
    _, points = public_runs.load()
    judged = [p for p in points if "fits" in p.measured]
    assert len(judged) >= 25
    for p in judged:
        c = p.candidate()
        assert (c.verdict in ("fits", "tight")) == p.measured["fits"], (p.id, c.verdict)
    assert sum(p.candidate().tight for p in judged) >= 1


def test_allocator_keys_in_a_job_file(tmp_path):
    from hybrid.errors import HybridError
    from hybrid.config.jobfile import wrap_options
    job = tmp_path / "job.yaml"
    job.write_text("nodes: 2\nexpandable_segments: off\nheadroom: 0.2\n")
    _, cluster, _ = wrap_options(str(job))
    assert cluster.expandable_segments is False and cluster.headroom == 0.2
    job.write_text("nodes: 2\nexpandable_segments: yes please\n")
    with pytest.raises(HybridError, match="on or off"):
        wrap_options(str(job))


@pytest.mark.slow
def test_the_catalogue_constants_are_what_the_corpus_calibrates():
    """The hard-coded efficiencies and headrooms are the corpus's fit (within rounding), so a corpus
    or model change that moves them fails here instead of leaving stale figures."""
    import statistics

    import public_runs
    from hybrid.config.cluster import GPUS
    _, points = public_runs.load()
    fitted: dict[str, list[float]] = {}
    for p in points:
        if p.published_tps and p.raw.get("calibrate", True):
            fitted.setdefault(p.cluster.gpu.name, []).append(p.efficiency_to_match(p.candidate()))
    assert set(fitted) == {"a100-80gb", "h100-80gb", "h100-96gb"}
    for gpu, values in fitted.items():
        assert GPUS[gpu].efficiency == pytest.approx(statistics.median(values), abs=0.01), gpu
    pairs = [p.measured for p in points if {"allocated_gib", "reserved_gib"} <= set(p.measured)
             and not p.cluster.expandable_segments]
    assert ALLOCATOR_HEADROOM == pytest.approx(
        statistics.mean(m["reserved_gib"] / m["allocated_gib"] - 1 for m in pairs), abs=0.01)
    es = [p.measured["reserved_gib"] * 2**30 / p.candidate().memory.allocated - 1 for p in points
          if "reserved_gib" in p.measured and p.cluster.expandable_segments]
    assert EXPANDABLE_HEADROOM == pytest.approx(statistics.median(es), abs=0.01)
