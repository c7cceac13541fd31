"""Float8 training in the estimate: which linears torchao converts and where it can run (pure).

Two recipes (TrainSpec.float8_recipe): tensorwise (torchao.float8's Float8Linear, one scale per
tensor; Ada, Hopper, Blackwell and ROCm MI300+) at the GPU's fp8 peak, and mxfp8 (torchao's MX
recipe: MXLinear, one e8m0 scale per 32 elements, cuBLAS's MXFP8 GEMM; Blackwell only) at its
MXFP8 peak; each refused in one line where the GPU lacks it (check_float8). MXLinear's autograd
function (torchao/prototype/mx_formats/mx_linear.py, mx_mm) also saves the high-precision input
and weight, so the memory terms are tensorwise's; its casts differ (cost/elementwise.py).

What it changes in the estimate (read from torchao/float8/float8_linear.py): its autograd
function saves `input_hp` and `weight_hp_t`, the high-precision input and weight, as nn.Linear
does, so the saved activations are those of the compiled bf16 block (torchtitan's Llama 3.1 8B:
77.0 GiB compiled, 76.8 GiB compiled + float8; benchmarks/public_runs.yaml); the float8 casts
are transient, and the amax/scale buffers are one scalar per tensor. The matmuls of the
converted linears run at the GPU's float8 peak (hybrid/estimation/cost/step.py), and the casts add elementwise
traffic (hybrid/estimation/cost/elementwise.py).
"""
from __future__ import annotations

from ..errors import HybridError

HEAD_NAMES = ("lm_head", "output")
"""Linears left in bf16, as torchtitan's float8 filter_fqns leaves its `output` head."""


def float8_peak(gpu, spec) -> float:
    """The dense peak the job's float8 recipe runs its matmuls at (0: none): the fp8 peak for
    tensorwise, the MXFP8 peak (block-scaled tensor cores) for mxfp8."""
    if not getattr(spec, "float8", False):
        return 0.0
    return gpu.mxfp8_flops if getattr(spec, "float8_recipe", "tensorwise") == "mxfp8" else gpu.fp8_flops


def check_float8(spec, cluster) -> None:
    """One line when the job asks for a float8 recipe the GPU cannot run: float8 without float8
    tensor cores; mxfp8 without block-scaled ones (before Blackwell), or on ROCm (torchao's MX recipe
    calls cuBLAS's MXFP8 GEMM, CUDA only). Never a recipe chosen for the user: this checks theirs."""
    if not getattr(spec, "float8", False):
        return
    g = cluster.gpu
    if not g.fp8_flops:
        raise HybridError(f"--float8 needs float8 tensor cores (Ada, Hopper, Blackwell, MI300 or newer); {g.name} "
                          "has none: drop --float8, or plan for --gpu h100 / h200 / b200")
    if getattr(spec, "float8_recipe", "tensorwise") != "mxfp8":
        return
    if g.stack == "rocm":
        raise HybridError(f"--float8-recipe mxfp8 is CUDA-only (torchao's MX recipe runs cuBLAS's MXFP8 GEMM), and "
                          f"{g.name} runs ROCm: use --float8-recipe tensorwise (torchao's float8 runs on MI300 and "
                          "newer), or drop --float8")
    if not g.mxfp8_flops:
        raise HybridError(f"--float8-recipe mxfp8 needs Blackwell's block-scaled tensor cores (b200, b300, gb200, "
                          f"gb300); {g.name} has none: use --float8-recipe tensorwise, or plan for --gpu b200")


def linear_params(d) -> int:
    """Elements of the block linears float8 converts (every block matrix; the head stays bf16)."""
    return d.block_matmul_params
