"""What a block's own code does, read by running a piece of it once on the meta device (nothing
is computed or allocated): how its norms keep their work, and how its mixture-of-experts layer
routes (the router's nonlinearity, whether it renormalises the top k, whether it computes in fp32,
and whether the shared experts run before it). These are facts of the code, not of the weights'
shapes, so hybrid/model/anatomy.py asks the module rather than a table per `model_type`.
"""
from __future__ import annotations


def norm_kind(norm, hidden: int) -> str:
    """How a norm keeps its work, measured: run once on a meta bf16 input and read what autograd
    saves. LayerNorm keeps mean and rstd; an RMSNorm that multiplies its weight in fp32 (Gemma,
    gpt-oss, OLMo 2) keeps an fp32 normalised copy beside its fp32 input, one that casts back first
    (Llama) a bf16 one."""
    import torch

    if "LayerNorm" in type(norm).__name__ and "RMS" not in type(norm).__name__:
        return "layer"
    tokens = 3      # activations are tokens x hidden: apart from the weight (and 1 + weight), each saved once
    saved: dict[int, int] = {}

    def pack(t):
        if t.dtype == torch.float32 and t.numel() >= tokens * hidden:
            saved[id(t)] = t.numel() * t.element_size()
        return t
    try:
        x = torch.empty(1, tokens, hidden, device="meta", dtype=torch.bfloat16, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _on_meta(norm)(x)
    except Exception:  # noqa: BLE001 - a norm that will not run on meta: the common form
        return "rms"
    return "rms1p" if sum(saved.values()) >= 2 * 4 * tokens * hidden else "rms"


def routing(mlp, hidden: int, experts: int, top_k: int, shared) -> dict | None:
    """How an MoE layer routes, from one forward of it on meta bf16 tokens (the aten ops it runs,
    recorded as they are dispatched): `router` 'softmax' (over every expert, then the top k: Qwen,
    Mixtral), 'sigmoid' (per expert: DeepSeek-V3, Llama 4) or 'topk_softmax' (the top k logits,
    then a softmax over them: gpt-oss); `renorm`, whether the top k weights are divided by their sum
    (a softmax over the top k renormalises by construction); `router_fp32`, whether the router's
    matmul runs in fp32 over bf16 tokens (DeepSeek-V3 upcasts its input and weight); `shared_first`,
    whether the shared expert(s) (`shared`, the module) run before the router's matmul (Qwen2-MoE).
    None where the layer does not run on meta."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    tokens = 5
    seen: list[tuple[str, tuple, object]] = []
    calls: list[str] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                seen.append((func.overloadpacket.__name__, tuple(out.shape), out.dtype))
            return out

    module = _on_meta(mlp, torch.bfloat16)           # grouped_mm runs bf16 only
    handle = None
    if shared is not None:
        twin = dict(zip(mlp.modules(), module.modules())).get(shared, shared)
        handle = twin.register_forward_pre_hook(lambda *_: calls.append(f"shared@{len(seen)}"))
    try:
        x = torch.empty(1, tokens, hidden, device="meta", dtype=torch.bfloat16, requires_grad=True)
        with Record():
            module(x)
    except Exception:  # noqa: BLE001 - a layer that will not run on meta: read from its attributes instead
        return None
    finally:
        if handle is not None:
            handle.remove()
    logits = next((i for i, (op, shape, _) in enumerate(seen) if op in ("mm", "addmm") and shape == (tokens, experts)),
                  None)
    if logits is None:
        return None
    per_expert = {op for op, shape, _ in seen if shape == (tokens, experts)}
    topk_softmax = any(op == "_softmax" and shape == (tokens, top_k) for op, shape, _ in seen) and top_k != experts
    router = "topk_softmax" if topk_softmax else "sigmoid" if "sigmoid" in per_expert else "softmax"
    renorm = topk_softmax or any(op in ("div", "div_") and shape == (tokens, top_k) for op, shape, _ in seen)
    first_shared = min((int(c.split("@")[1]) for c in calls), default=len(seen))
    return dict(router=router, renorm=bool(renorm), router_fp32=seen[logits][2] == torch.float32,
                shared_first=first_shared <= logits)


def _on_meta(module, dtype=None):
    """The module itself when its parameters are on the meta device (in `dtype`, when given), else a
    copy of it on meta whose floating-point tensors are in `dtype` (nothing real is copied)."""
    import copy

    import torch
    tensors = [*module.parameters(), *module.buffers()]
    if all(t.device.type == "meta" and (dtype is None or not t.is_floating_point() or t.dtype == dtype)
           for t in tensors):
        return module

    def twin(t):
        kind = dtype if dtype is not None and t.is_floating_point() else t.dtype
        out = torch.empty_like(t, device="meta", dtype=kind)
        return torch.nn.Parameter(out, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else out
    return copy.deepcopy(module, memo={id(t): twin(t) for t in tensors})
