"""layout/program.py against torch's own schedule: the order ScheduleInterleaved1F1B computes for every
rank (its pipeline_order, built by torch from stages on a fake process group) is the order rank_actions
gives and the trace runs."""
import pytest

pytestmark = pytest.mark.fakepg

V = 2
"""Local stages per rank (pipeline.VIRTUAL)."""


def torch_interleaved(pp: int, m: int):
    """torch's ScheduleInterleaved1F1B for rank 0's V stages of pp * V on a fake process group of pp ranks (it
    computes every rank's order), or the error it raises for m micro-batches."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=pp)
    try:
        stages = [PipelineStage(torch.nn.Linear(2, 2), k * pp, pp * V, torch.device("cpu")) for k in range(V)]
        try:
            return ScheduleInterleaved1F1B(stages, m)
        except (ValueError, RuntimeError) as e:
            return e
    finally:
        dist.destroy_process_group()


def split(pp: int, m: int):
    from hybrid.layout.pipeline import StageSplit
    return StageSplit(pp, "interleaved", m, (1,) * (pp * V), V)


@pytest.mark.parametrize("pp,m", [(2, 2), (2, 4), (4, 4), (4, 8), (2, 6)])
def test_interleaved_order_is_torchs(pp, m):
    from hybrid.layout.pipeline import rank_actions
    from hybrid.layout.program import backward_moments
    order = torch_interleaved(pp, m).pipeline_order
    for rank in range(pp):
        torch_order = [(a.computation_type.value, a.stage_index, a.microbatch_index) for a in order[rank]
                       if a is not None]
        assert rank_actions("interleaved", pp, m, rank, V) == torch_order, rank
        # each backward holds its own chunk-micro-batch and every one forwarded and not yet differentiated
        moments = backward_moments(split(pp, m), rank)
        assert len(moments) == m * V and moments[-1].live == 1 and moments[0].done == frozenset()
        # every stage but the first receives its input: all of a later rank's chunk-micro-batches, not
        # rank 0's of stage 0 (in flight at its first backward, beside its own of stage pp)
        assert all(b.received == b.live for b in moments) if rank else moments[0].received < moments[0].live


@pytest.mark.parametrize("pp,m", [(2, 3), (4, 10), (4, 25), (4, 24), (8, 100)])
def test_interleaved_micro_batch_counts_are_the_ones_torch_takes(pp, m):
    """From pp micro-batches up, pipeline.interleaved_problem refuses exactly the counts torch's
    ScheduleInterleaved1F1B refuses (a planned layout torch would refuse was a KeyError in the program:
    hybrid plan llama3-8b --global-batch 100). Below pp it refuses what torch would build, as the planner runs
    gpipe there in place of 1f1b (pipeline.schedules_for)."""
    from hybrid.layout.pipeline import interleaved_problem
    from hybrid.layout.program import backward_moments
    takes = not isinstance(torch_interleaved(pp, m), Exception)
    assert (interleaved_problem(pp, m) is None) == takes, (pp, m, interleaved_problem(pp, m))
    if takes:
        for rank in range(pp):
            assert len(backward_moments(split(pp, m), rank)) == m * V
