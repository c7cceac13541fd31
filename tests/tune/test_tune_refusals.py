"""hybrid tune refuses what no rank could run before it starts any: one process, no process group."""
import pytest
import torch

from hybrid.cli.main import main

JOB = ["tune", "tiny-llama", "--nodes", "1", "--gpus-per-node", "2", "--seq-len", "64", "--steps", "1", "--warmup", "1"]


@pytest.mark.torch
@pytest.mark.skipif(torch.cuda.is_available(), reason="offload and --gpu refusals are a CPU machine's")
@pytest.mark.parametrize("flags,line", [
    (["--strategies", "zero2-offload"],
     "no layout can run this job: zero2-offload offloads GPU memory to the host, which needs CUDA; CPU ranks run in "
     "host memory already (use the same strategy without offload)"),
    (["--strategies", "zero2-offload,zero3-offload"],
     "no layout can run this job: zero2-offload offloads GPU memory to the host, which needs CUDA"),
    (["--gpu", "h100-80gb"], "tune measures the accelerators it runs on (cpu), not --gpu h100-80gb"),
])
def test_tune_refuses_a_job_no_rank_can_run_in_the_plans_line_before_any_rank_starts(monkeypatch, capsys, flags,
                                                                                      line):
    import hybrid.runtime.launch as launch

    def start(*args, **kwargs):
        raise AssertionError("hybrid tune started its ranks")
    monkeypatch.setattr(launch, "run_ranks", start)
    assert main(JOB + flags) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"hybrid: error: {line}"), err
