"""Materialising a model built on the meta device: each rank allocates its tensors on its device
and initialises them, after the layout has sharded them."""
from __future__ import annotations

import torch
import torch.nn as nn


def has_meta(model: nn.Module) -> bool:
    return any(t.device.type == "meta" for t in (*model.parameters(), *model.buffers()))


@torch.no_grad()
def materialize(model: nn.Module, device) -> None:
    """Allocate a model built on the meta device and initialise it: its own init_weights()
    (transformers models and ours), else every module's reset_parameters(). FSDP calls this after
    sharding, so each rank only ever allocates its shards."""
    if not has_meta(model):
        return
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in model.modules():
        for name, p in m._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((m, name))
    model.to_empty(device=device)
    for places in owners.values():           # meta -> real makes new Parameters: tie them again
        first = getattr(places[0][0], places[0][1])
        for m, name in places[1:]:
            setattr(m, name, first)
    if hasattr(model, "init_weights"):
        model.init_weights()
    else:
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()


def move(module: nn.Module, device, dtype=None) -> None:
    """module.to(device, dtype), unless every tensor is on the device and every floating parameter in
    `dtype` already (buffers such as rotary frequencies may stay fp32, as FSDP's place leaves them): a
    no-op .to() still swaps each tensor (torch 2.13 Module._apply), which fails on the fake tensors a
    traced run's tracker holds."""
    there = all(t.device == torch.device(device) for t in [*module.parameters(), *module.buffers()])
    if there and (dtype is None or all(p.dtype == dtype for p in module.parameters() if p.is_floating_point())):
        return
    module.to(device=device, dtype=dtype)
