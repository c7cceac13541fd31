"""nn.Module (real, meta or fake), preset, HF config or bare count -> ModelProfile.

The profile is everything the memory model needs to know about a model: counts (tied weights once),
bytes by dtype, the repeated block that is the natural wrap/shard unit, and transformer dimensions
when they can be read. torch is imported only when a module has to be built or walked.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ..errors import HybridError
from .presets import DecoderConfig, from_hf_config
from ..units import parse_count


@dataclass(frozen=True)
class ModelProfile:
    name: str
    params: int
    """Unique parameter elements (a tied embedding / LM head counted once)."""
    trainable_params: int
    """Of those, the ones with requires_grad."""
    param_bytes: int
    """Bytes of the parameters as the model was built (its dtypes), unique storage once."""
    dtype_bytes: tuple[tuple[str, int], ...] = ()
    """(dtype name, bytes) pairs: how the parameter bytes split by dtype."""
    buffer_bytes: int = 0
    """Registered buffers (persistent or not), e.g. rotary frequencies."""
    block_class: str | None = None
    """Class name of the repeated unit (HF `_no_split_modules`, else the class repeated in a
    ModuleList); None when the model has no repeated unit and is wrapped whole."""
    num_blocks: int = 0
    block_params: int = 0
    """Parameters of the largest unit."""
    root_params: int = 0
    """Parameters outside every unit (embeddings, final norm, head)."""
    largest_layer_params: int = 0
    """Most parameters owned directly by one module (DeepSpeed's 'largest layer')."""
    largest_param: int = 0
    """Elements of the largest single parameter tensor."""
    factored_state: int | None = None
    """Adafactor-like optimizer state elements (rows + cols per matrix); None if shapes unknown."""
    tied_groups: tuple[tuple[str, ...], ...] = ()
    """Names that share one parameter, e.g. (('embed.weight', 'lm_head.weight'),)."""
    decoder: DecoderConfig | None = None
    """Transformer dimensions when known; without them activations are reported as unknown."""
    activation_bytes_per_sample: int | None = None
    """For other models with `example_inputs`: bytes autograd saves per sample in fp32, counted
    by a shape-only forward on the meta device (see probe_activations)."""
    source: str = "module"
    """preset | hf-config | module | params."""

    @property
    def max_positions(self) -> int | None:
        return self.decoder.max_positions if self.decoder else None

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("name", "params", "trainable_params", "param_bytes",
                                           "buffer_bytes", "block_class", "num_blocks", "block_params",
                                           "root_params", "largest_layer_params", "largest_param",
                                           "factored_state", "activation_bytes_per_sample", "source")}
        d["dtype_bytes"] = dict(self.dtype_bytes)
        d["tied_groups"] = [list(g) for g in self.tied_groups]
        d["decoder"] = self.decoder.to_dict() if self.decoder else None
        return d


def profile_decoder(cfg: DecoderConfig, name: str, source: str = "preset") -> ModelProfile:
    """Closed-form profile of a decoder shape as built in fp32 (no torch)."""
    largest_layer = max(cfg.vocab * cfg.hidden, cfg.ffn * cfg.hidden + (cfg.ffn if cfg.style == "gpt2" else 0),
                        cfg.experts * cfg.expert_params)      # the experts module owns every expert
    tied = (("embed.weight", "lm_head.weight"),) if cfg.tied else ()
    return ModelProfile(
        name=name, params=cfg.params, trainable_params=cfg.params, param_bytes=4 * cfg.params,
        dtype_bytes=(("float32", 4 * cfg.params),),
        buffer_bytes=4 * (cfg.head_dim // 2) if cfg.style == "llama" else 0,
        block_class="Block", num_blocks=cfg.layers, block_params=cfg.block_params,
        root_params=cfg.root_params, largest_layer_params=largest_layer,
        largest_param=cfg.largest_param, factored_state=cfg.factored_state, tied_groups=tied,
        decoder=cfg, source=source)


TP_DEGREES = (1, 2, 4, 8)
"""Tensor-parallel degrees the planner tries (inside one node of up to 8 GPUs, as Megatron-LM and
torchtitan recipes do)."""


def tp_degrees(profile: ModelProfile, gpus_per_node: int) -> list[int]:
    """tp that divides the GPUs per node and the attention and key/value heads of a llama-style
    decoder (GPT-2's fused qkv has no plan); [1] for anything else."""
    d = profile.decoder
    if d is None or d.style != "llama" or d.moe:          # MoE: experts are split by ep, not tp (yet)
        return [1]
    return [t for t in TP_DEGREES if gpus_per_node % t == 0 and d.heads % t == 0 and d.n_kv_heads % t == 0]


HF_LAYERS = {"llama": "LlamaDecoderLayer", "mistral": "MistralDecoderLayer", "qwen2": "Qwen2DecoderLayer",
             "qwen3": "Qwen3DecoderLayer",
             "gpt2": "GPT2Block", "mixtral": "MixtralDecoderLayer", "olmoe": "OlmoeDecoderLayer",
             "qwen3_moe": "Qwen3MoeDecoderLayer"}
"""transformers' decoder-layer class per model_type, for presets and config.json files (a
module's profile already names the class it found)."""


def transformers_layer_class(profile: ModelProfile) -> str | None:
    """The class a tool wraps (FSDP units, Accelerate's fsdp_transformer_layer_cls_to_wrap): the
    transformers class a preset or config.json stands for (the estimate is built from our own
    Block, but users train the transformers model), else the class we found."""
    mt = profile.decoder.hf_model_type if profile.decoder is not None else None
    if profile.block_class == "Block" and mt in HF_LAYERS:
        return HF_LAYERS[mt]
    return profile.block_class


def profile_params(count: int | str, name: str | None = None) -> ModelProfile:
    """A model known only by its parameter count: model states only, activations unknown."""
    n = parse_count(count)
    return ModelProfile(name=name or f"{n:.3g} params", params=n, trainable_params=n,
                        param_bytes=4 * n, dtype_bytes=(("float32", 4 * n),), source="params")


def find_blocks(module) -> tuple[str | None, list]:
    """The wrap/shard unit: HF `_no_split_modules` when present, else the class (with a forward
    of its own) repeated in the largest ModuleList; nested ModuleLists are looked into. Returns
    (class name, instances), or (None, []) when there is none."""
    import torch.nn as nn

    no_split = getattr(module, "_no_split_modules", None) or ()
    if no_split:
        blocks = [m for m in module.modules() if type(m).__name__ in set(no_split)]
        if blocks:
            return type(blocks[0]).__name__, blocks
    def runs(c) -> bool:     # a container (ModuleList of ModuleLists) has no forward of its own
        return type(c).forward is not nn.Module.forward

    members: dict[str, list] = {}     # class -> its instances held in ModuleLists, model order
    for m in module.modules():
        if isinstance(m, nn.ModuleList):
            for c in m:
                if runs(c):
                    members.setdefault(type(c).__name__, []).append(c)
    best: tuple[int, str | None, list] = (0, None, [])
    for cls, found in members.items():
        if len(found) < 2:
            continue
        size = sum(p.numel() for c in found for p in c.parameters())
        if size > best[0]:
            best = (size, cls, found)
    return best[1], best[2]


def names_by_param(module) -> dict[int, list[str]]:
    """id(parameter) -> every name it has (a tied weight has several), in module order. The one
    place tied parameters are grouped: the same Parameter object under several names (this works
    on meta and fake tensors, where data_ptr() says nothing)."""
    groups: dict[int, list[str]] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(n)
    return groups


def profile_module(module, name: str | None = None) -> ModelProfile:
    """Walk a real, meta or fake nn.Module. Tied parameters are the same Parameter object under
    several names (works on meta, where data_ptr() is 0 for everything)."""
    params = list(module.parameters())
    if not params:
        raise HybridError(f"model {name or type(module).__name__} has no parameters: "
                          "there is nothing to train or shard")
    groups = names_by_param(module)
    dtype_bytes: Counter = Counter()
    for p in params:
        dtype_bytes[str(p.dtype).replace("torch.", "")] += p.numel() * p.element_size()
    cls, blocks = find_blocks(module)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    block_sizes = [sum(p.numel() for p in b.parameters()) for b in blocks]
    own = [sum(p.numel() for p in m.parameters(recurse=False)) for m in module.modules()]
    factored = sum((p.shape[-2] + p.shape[-1]) * (p.numel() // (p.shape[-2] * p.shape[-1]))
                   if p.dim() >= 2 else p.numel() for p in params)
    return ModelProfile(
        name=name or type(module).__name__,
        params=sum(p.numel() for p in params),
        trainable_params=sum(p.numel() for p in params if p.requires_grad),
        param_bytes=sum(dtype_bytes.values()), dtype_bytes=tuple(sorted(dtype_bytes.items())),
        buffer_bytes=sum(b.numel() * b.element_size() for b in module.buffers()),
        block_class=cls, num_blocks=len(blocks), block_params=max(block_sizes, default=0),
        root_params=sum(p.numel() for p in params if id(p) not in in_blocks),
        largest_layer_params=max(own, default=0), largest_param=max(p.numel() for p in params),
        factored_state=factored,
        tied_groups=tuple(tuple(g) for g in groups.values() if len(g) > 1),
        decoder=decoder_of(module), source="module")


def decoder_of(module) -> DecoderConfig | None:
    """The module's transformer shape, read from its config (no walk over the module)."""
    cfg = getattr(module, "config", None)
    if isinstance(cfg, DecoderConfig):
        return cfg
    if cfg is not None and hasattr(cfg, "to_dict"):
        return from_hf_config(cfg.to_dict())
    return None


def build_profile(module, name: str | None = None) -> ModelProfile:
    """The one profile builder (auto_wrap and the CLI): the module's counts and block, and for a
    non-transformer with `example_inputs(batch)`, the activation bytes per sample, probed on a
    meta-device copy (so nothing is computed and the real weights are not touched)."""
    profile = profile_module(module, name)
    if profile.decoder is None and hasattr(module, "example_inputs"):
        import copy
        import dataclasses
        probe = module if _on_meta(module) else copy.deepcopy(module).to("meta")
        profile = dataclasses.replace(profile, activation_bytes_per_sample=probe_activations(probe))
    return profile


def _on_meta(module) -> bool:
    return all(t.device.type == "meta" for t in (*module.parameters(), *module.buffers()))


def probe_activations(module) -> int:
    """Bytes saved for backward per sample, from two shape-only forwards (batch 1 and 2) of a
    meta-device model: the difference cancels everything that does not scale with the batch."""
    import torch

    def saved(batch: int) -> int:
        seen: dict[int, int] = {}
        params = {id(p.untyped_storage()) for p in module.parameters()}

        def pack(t):
            st = t.untyped_storage()
            if id(st) not in params:
                seen[id(st)] = st.nbytes()
            keep.append(st)
            return t
        keep: list = []
        with torch.device("meta"), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            inputs = module.example_inputs(batch)
            module(**inputs)
        return sum(seen.values())
    return max(saved(2) - saved(1), 0)


