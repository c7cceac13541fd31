"""Float8 training of the blocks' linears, as torchtitan's float8 converter applies torchao's.

torchao's `convert_to_float8_training` swaps each nn.Linear for a Float8Linear (tensorwise
scaling: one amax and scale per tensor, cast to e4m3 right before the matmul) and, under FSDP2,
wraps its weight so the all-gather moves float8 (`enable_fsdp_float8_all_gather`). torchtitan
applies it when the model is built, before parallelisation, leaves the output head in bf16
(`filter_fqns = ["output"]`) and runs it behind torch.compile, which fuses the amax and cast
kernels into their neighbours. What it changes in the estimate: hybrid/estimation/float8.py.

The mxfp8 recipe (TrainSpec.float8_recipe) is torchao's MX training instead: `quantize_` with
MXLinearConfig's "mxfp8_cublas" recipe swaps each nn.Linear for an MXLinear (one e8m0 scale per
32 elements along each matmul's reduction dim, cuBLAS's MXFP8 GEMM through torch._scaled_mm), as
torchtitan's MX converter does; it needs a Blackwell GPU (sm_100) and CUDA, and has no float8
all-gather, so FSDP gathers the bf16 weights.
"""
from __future__ import annotations

from ..errors import HybridError
from ..estimation.float8 import HEAD_NAMES


def apply_float8(model, spec, fsdp: bool, emulate: bool = False) -> int:
    """Convert the blocks' linears with torchao (tensorwise; float8 all-gather when `fsdp`),
    in place; returns how many were converted. emulate: torchao's CPU emulation, for tests."""
    if not getattr(spec, "float8", False):
        return 0
    if getattr(spec, "float8_recipe", "tensorwise") == "mxfp8":
        return apply_mxfp8(model, emulate)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise HybridError("float8 needs torchao: pip install 'hybrid[float8]'") from None
    import torch
    if not emulate and not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)):
        raise HybridError("float8 needs a CUDA GPU with float8 tensor cores (sm_89 or newer: H100, H200); "
                          "run without float8 here")
    config = Float8LinearConfig.from_recipe_name("tensorwise")
    if fsdp or emulate:
        import dataclasses
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=fsdp, emulate=emulate)

    def convert(mod, fqn: str) -> bool:
        # float8 matmuls need both dims divisible by 16 (torchao's and torchtitan's filter)
        return (fqn.split(".")[-1] not in HEAD_NAMES and mod.in_features % 16 == 0
                and mod.out_features % 16 == 0)
    before = sum(1 for m in model.modules() if type(m).__name__ == "Float8Linear")
    convert_to_float8_training(model, config=config, module_filter_fn=convert)
    return sum(1 for m in model.modules() if type(m).__name__ == "Float8Linear") - before


def _convertible(mod, fqn: str) -> bool:
    # float8/MX matmuls need both dims divisible by 16 (MX: by its block of 32 along the reduction)
    return fqn.split(".")[-1] not in HEAD_NAMES and mod.in_features % 32 == 0 and mod.out_features % 16 == 0


def apply_mxfp8(model, emulate: bool = False) -> int:
    """torchao's MX training (mxfp8, cuBLAS) on the blocks' linears, in place; returns how many were
    converted. emulate: torchao's emulated MX GEMM, for tests on CPU."""
    try:
        from torchao.prototype.mx_formats import MXLinearConfig
        from torchao.quantization import quantize_
    except ImportError:
        raise HybridError("the mxfp8 recipe needs torchao 0.13 or newer with its MX formats: "
                          "pip install 'hybrid[float8]'") from None
    import torch
    if not emulate:
        if getattr(torch.version, "hip", None):
            raise HybridError("the mxfp8 recipe is CUDA-only (cuBLAS's MXFP8 GEMM); on ROCm use "
                              "float8_recipe='tensorwise'")
        if not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (10, 0)):
            raise HybridError("the mxfp8 recipe needs a Blackwell GPU (sm_100: B200, B300, GB200, GB300); "
                              "use float8_recipe='tensorwise' on Hopper and Ada")
    config = MXLinearConfig.from_recipe_name("mxfp8_emulated" if emulate else "mxfp8_cublas")
    before = sum(1 for m in model.modules() if type(m).__name__ == "MXLinear")
    quantize_(model, config=config, filter_fn=lambda mod, fqn: isinstance(mod, torch.nn.Linear)
              and _convertible(mod, fqn))
    return sum(1 for m in model.modules() if type(m).__name__ == "MXLinear") - before
