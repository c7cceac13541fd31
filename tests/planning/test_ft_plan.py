"""--fault-tolerant in the plan: torchft's all-reduce of the gradients across replica groups and the
quorum per step are priced, and the layouts torchft cannot run are not applicable, with the reason."""
import json
from dataclasses import replace

import pytest

from hybrid.cli.main import main
from hybrid.config.cluster import Cluster
from hybrid.config.spec import TrainSpec
from hybrid.estimation.cost.step import QUORUM_S, step_cost
from hybrid.families.catalogue import load_catalogue
from hybrid.layout.layout import Layout
from hybrid.model.sources import resolve_model
from hybrid.planning.planner import judge

pytestmark = pytest.mark.unit

CAT = load_catalogue()
H100_64 = Cluster.build(8, 8, "h100-80gb")
PROF = resolve_model("llama2-7b").profile
SPEC = TrainSpec(1, 4096)
FT = replace(SPEC, fault_tolerant=True)


def test_torchft_adds_the_ring_all_reduce_of_the_gradient_shard_across_groups_and_the_quorum():
    hsdp = Layout.of(CAT["hsdp"], H100_64, SPEC, shard_size=8)          # 8 replica groups of one node each
    cost = step_cost(hsdp, PROF, FT, H100_64)
    # Patarasuk & Yuan's ring all-reduce over R = 8 groups, one rank of each, one NIC per ring:
    # 2 (R - 1) / R of the fp32 gradient shard (P / 8 elements) at the NIC, plus log2(R) latencies
    g, R = H100_64.gpu, 8
    ring = 2 * (R - 1) / R * 4 * PROF.trainable_params / 8 / g.inter_node_bw + 3 * g.inter_node_latency
    assert cost.fault_tolerance_s == pytest.approx(ring + QUORUM_S, rel=1e-9)
    assert cost.to_dict()["fault_tolerance_s"] == cost.fault_tolerance_s
    assert "fault_tolerance_s" not in step_cost(hsdp, PROF, SPEC, H100_64).to_dict()


def test_the_groups_all_reduce_is_not_hidden_and_replaces_hsdps_own():
    for shard in (8, 16, 32):
        hsdp = Layout.of(CAT["hsdp"], H100_64, SPEC, shard_size=shard)
        plain, ft = step_cost(hsdp, PROF, SPEC, H100_64), step_cost(hsdp, PROF, FT, H100_64)
        fsdp_in_a_group = step_cost(Layout.of(CAT["fsdp"], Cluster.build(shard // 8, 8, "h100-80gb"), SPEC), PROF,
                                    SPEC, Cluster.build(shard // 8, 8, "h100-80gb"))
        # inside a group FSDP runs as on a cluster of that group alone; torchft's part comes on top
        assert ft.seconds == pytest.approx(fsdp_in_a_group.seconds + ft.fault_tolerance_s, rel=1e-9)
        assert ft.seconds > plain.seconds
        assert ft.exposed_comm_s == pytest.approx(fsdp_in_a_group.exposed_comm_s + ft.fault_tolerance_s - QUORUM_S,
                                                  rel=1e-9)


@pytest.mark.parametrize("name, kw, words", [
    ("zero3", {}, "reduces its gradients inside its own library"),
    ("fsdp", {}, "dp_replicate 1 is one replica group"),
    ("hsdp", {"shard_size": 8, "pp": 2}, "pipeline"),
])
def test_layouts_torchft_cannot_run_are_not_applicable(name, kw, words):
    c = judge(Layout.of(CAT[name], H100_64, SPEC, **kw), PROF, FT, H100_64)
    assert not c.fits and c.reason.startswith("not applicable: --fault-tolerant") and words in c.reason


def test_plan_fault_tolerant_json_prices_every_applicable_row(capsys):
    assert main(["plan", "llama2-7b", "--nodes", "8", "--seq-len", "4096", "--fault-tolerant", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["spec"]["fault_tolerant"] is True
    fits = [r for r in out["strategies"] if r["fits"]]
    assert fits and all(r["fault_tolerance_s"] > QUORUM_S for r in fits)
    assert all(r["parallel"]["dp_replicate"] > 1 for r in fits)
    assert out["chosen_candidate"]["parallel"]["dp_replicate"] > 1
