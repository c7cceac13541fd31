"""The estimate's inputs as torch and the libraries on it see them, in one process: DeepSpeed's own
estimators, modules built on the meta device, this machine's devices, and the environment
auto_wrap and DeepSpeed set (the torch tier: torch imported, no process group)."""
import pytest

from hybrid.config.cluster import Cluster, detect
from hybrid.errors import HybridError
from hybrid.estimation.memory.analytic import estimate
from hybrid.model.sources import resolve_model
from hybrid.config.spec import TrainSpec
from tests.estimation.test_analytic import CAT, PAPER
from tests.estimation.test_calibration import ROOT, _tune_job

pytestmark = pytest.mark.torch


def test_deepspeed_own_estimators_agree():
    """DeepSpeed's estimate_zero2/zero3_model_states_mem_needs count what its code allocates."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    prof = resolve_model("llama2-7b").profile
    _, ds2 = estimate_zero2_model_states_mem_needs(prof.params, 8, 8, cpu_offload=False)
    assert estimate(CAT["zero2"], prof, TrainSpec(), PAPER).model_states == pytest.approx(ds2, rel=1e-6)
    _, ds3, largest = estimate_zero3_model_states_mem_needs(
        prof.params, prof.largest_layer_params, 8, 8, cpu_offload=False, cpu_offload_params=False)
    ours = estimate(CAT["zero3"], prof, TrainSpec(), PAPER)
    # DeepSpeed: 18P/N + 4 x largest layer. Ours: 20P/N (the 16-bit grad partition buffer too) plus
    # params below the persistence threshold kept whole; the gathered largest layer is in buffers.
    assert ours.model_states == pytest.approx(ds3 - largest + 2 * prof.params / 64, rel=0.001)
    assert ours.buffers >= 2 * prof.largest_layer_params


def test_public_estimate_takes_a_name_a_profile_or_a_module():
    import hybrid
    from hybrid.model.decoder import build_decoder
    cl = Cluster.build(1, 8, "h100-80gb")
    by_name = hybrid.estimate("tiny-llama", "fsdp", cl, TrainSpec(2, 64))
    by_module = hybrid.estimate(build_decoder("tiny-llama", device="meta"), "fsdp", cl, TrainSpec(2, 64))
    assert by_name.total == by_module.total > 0


@pytest.mark.parametrize("name", ["zero2-offload", "zero3-offload", "zero3-offload-params"])
def test_offload_states_are_where_deepspeed_keeps_them(name):
    """Per-GPU model states under CPU offload equal DeepSpeed's own cold estimators: ZeRO-2 keeps
    only the 16-bit params on the GPU (2P; the gradient partition is on the host), ZeRO-3 its
    16-bit param partition (2P/N, none with offload_param) beside the gathered largest layer."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    from hybrid.families.deepspeed import bucket_sizes, persistent_params

    prof = resolve_model("llama2-7b").profile
    s = CAT[name]
    ours = estimate(s, prof, TrainSpec(), PAPER)
    if s.config.stage == 2:
        _, ds = estimate_zero2_model_states_mem_needs(prof.params, 8, 8, cpu_offload=True)
        assert ours.model_states == pytest.approx(ds, rel=1e-6)
        assert ours.grads == 0 and ours.cpu > 16 * prof.params / 64
    else:
        _, ds, largest = estimate_zero3_model_states_mem_needs(
            prof.params, prof.largest_layer_params, 8, 8, cpu_offload=True, cpu_offload_params=s.config.offload_params)
        # ours keeps the params under the persistence threshold whole; the gathered layer is in buffers
        small = 0 if s.config.offload_params else (2 * persistent_params(prof, bucket_sizes(s, prof.decoder.hidden)[2])
                                                    * (1 - 1 / 64))
        assert ours.model_states == pytest.approx(ds - largest + small, rel=1e-6, abs=8)
        assert ours.buffers >= 2 * prof.largest_layer_params


def test_host_counts_follow_the_libraries():
    from hybrid.families.deepspeed import bucket_sizes
    from hybrid.families.host import ipg_buckets, param_tensors
    cands, prof, cl = _tune_job()
    model, _ = resolve_model(str(ROOT / "benchmarks" / "tune_decoder")).build(device="meta")
    real = [p.numel() for p in model.parameters()]            # a tied head appears once
    assert list(param_tensors(prof)) == real and sum(real) == prof.params
    llama = resolve_model("tiny-llama")
    m, _ = llama.build(device="meta")
    assert list(param_tensors(llama.profile)) == [p.numel() for p in m.parameters()]
    # DeepSpeed reduces a bucket before the gradient that would overflow it: 3 small, 1 big, 2 small
    assert ipg_buckets([10, 10, 10, 100, 10, 10], 50) == 3
    # counted by torch.profiler on 4 gloo ranks (one step, benchmarks/tune_cpu.py's job): ddp 1
    # bucket; fsdp 2 x 5 all-gathers + 5 reduce-scatters; zero3 52 all-gathers, 35 reduce-scatters
    # and the norm's all-reduce
    from hybrid.estimation.calibration import host_counts
    one = {(c.label, c.shard_size): c for c in cands}
    got = host_counts([one[("ddp", 1)], one[("fsdp", 4)], one[("zero3", 4)]], prof, cl, "collective_overhead")
    assert got == [1, 15, 88]
    assert ipg_buckets(param_tensors(prof), bucket_sizes(one[("zero3", 4)].strategy, 256)[0]) == 35


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU path")
def test_detect_cpu(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    c = detect()
    assert (c.nodes, c.gpus_per_node) == (2, 2)
    assert c.gpu.name == "cpu" and not c.gpu.is_cuda and c.gpu.cuda_context_bytes == 0
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(HybridError, match="WORLD_SIZE=4 is not a multiple of LOCAL_WORLD_SIZE=3"):
        detect()


def test_auto_wrap_sets_expandable_segments_only_where_nobody_did(monkeypatch):
    import torch
    from hybrid.auto import enable_expandable_segments
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    env = {}
    assert enable_expandable_segments(env) and env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    mine = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}
    assert not enable_expandable_segments(mine) and mine == {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not enable_expandable_segments(env := {}) and env == {}  # CPU ranks: nothing to set


def test_deepspeed_builds_its_ops_in_this_environment(tmp_path):
    """torch's default extension cache is per user, shared by every venv (an op another venv's torch
    built is rebuilt); inside a writable venv we use <venv>/torch_extensions unless the user set one."""
    from hybrid.runtime.backends.deepspeed import extension_cache
    env, venv = {}, str(tmp_path)
    assert extension_cache(env, prefix=venv, base_prefix="/usr") == f"{venv}/torch_extensions"
    assert env == {"TORCH_EXTENSIONS_DIR": f"{venv}/torch_extensions"}
    mine = {"TORCH_EXTENSIONS_DIR": "/scratch/ext"}
    assert extension_cache(mine, prefix=venv, base_prefix="/usr") == "/scratch/ext"
    assert extension_cache(none := {}, prefix="/usr", base_prefix="/usr") is None and none == {}
    # a read-only environment (a shared install): torch's own default, where the build can write
    assert extension_cache(ro := {}, prefix="/nonexistent/.venv", base_prefix="/usr") is None and ro == {}
