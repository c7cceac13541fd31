"""AppliedPlan: what parallelize applies, decided first; the estimate reads the same value."""
from dataclasses import replace

import pytest

from hybrid.config.cluster import Cluster
from hybrid.config.spec import TrainSpec
from hybrid.errors import HybridError
from hybrid.estimation.memory.analytic import estimate
from hybrid.estimation.shares import shares
from hybrid.families.catalogue import load_catalogue
from hybrid.families.fsdp import FSDPConfig
from hybrid.layout.applied import applied_plan
from hybrid.layout.layout import Layout
from hybrid.model.sources import resolve_model

CAT = load_catalogue()
TWO = Cluster.build(1, 2, "h100-80gb")


@pytest.mark.unit
def test_ddp_over_tensor_parallel_groups_is_fsdp2_units_kept_gathered():
    spec = TrainSpec(1, 256)
    plain = applied_plan(Layout.of(CAT["ddp"], TWO, spec), "hybrid", spec.precision)
    assert (plain.wrap, plain.units, plain.reshards, plain.autocast) == ("ddp", "buckets", None, True)
    over_tp = applied_plan(Layout.of(CAT["ddp"], TWO, spec, tp=2), "transformers", spec.precision)
    assert (over_tp.wrap, over_tp.units, over_tp.reshards, over_tp.autocast) == ("fsdp", "blocks+root", False, False)
    assert over_tp.sequence_parallel and over_tp.loss_parallel and over_tp.tp == 2
    assert "tp 2 + sequence parallel + loss parallel" in over_tp.describe()
    with pytest.raises(HybridError, match="not for this module: use tp=1"):
        applied_plan(Layout.of(CAT["ddp"], TWO, spec, tp=2), "module")


@pytest.mark.unit
def test_the_estimate_prices_ddp_over_tp_as_the_fsdp2_wrap_that_runs():
    """Before, ddp+tp2 was priced as torch's DDP under autocast (fp32 weights with an autocast
    cache, bucketed gradients) while the runtime ran fully_shard(reshard_after_forward=False)."""
    src = resolve_model("tiny-llama")
    spec = TrainSpec(1, 256)
    lay = Layout.of(CAT["ddp"], TWO, spec, tp=2)
    sh = shares(src.profile, lay, spec)
    assert sh.applied.wrap == "fsdp" and sh.sequence_parallel and sh.loss_parallel
    through = replace(CAT["fsdp"], name="ddp-through-fsdp2", config=FSDPConfig(reshard_after_forward=False))
    priced = CAT["ddp"].family_obj.priced_strategy(CAT["ddp"], sh.applied)
    assert priced.family == "fsdp" and priced.config == through.config
    a = estimate(lay, src.profile, spec, TWO)
    b = estimate(replace(lay, dp=through), src.profile, spec, TWO)
    assert a.tensors == b.tensors and a.params == b.params and a.activations == b.activations
