"""Float8 training in the estimate: which linears torchao converts and where it can run (pure).

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


def check_float8(spec, cluster) -> None:
    """One line when the job asks for float8 on a GPU without float8 tensor cores."""
    if getattr(spec, "float8", False) and not cluster.gpu.fp8_flops:
        raise HybridError(f"--float8 needs float8 tensor cores (H100, H200 or newer); {cluster.gpu.name} has none: "
                          "drop --float8, or plan for --gpu h100-80gb / h200-141gb")


def linear_params(d) -> int:
    """Elements of the block linears float8 converts (every block matrix; the head stays bf16)."""
    return d.block_matmul_params
