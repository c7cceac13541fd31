"""nn.Module (real, meta or fake), preset, HF config or bare count -> ModelProfile.

The profile is everything the memory model needs to know about a model: counts (tied weights once),
bytes by dtype, the repeated block that is the natural wrap/shard unit, and transformer dimensions
when they can be read. torch is imported only when a module has to be built or walked.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from math import ceil

from ..errors import HybridError
from .presets import DecoderConfig, from_hf_config
from ..units import parse_count


BNB_BLOCK = 256
"""Elements per quantisation block of bitsandbytes' 8-bit optimizers: one fp32 absmax per block
(bitsandbytes/optim/optimizer.py, Optimizer2State.init_state: `blocksize = 256`)."""
BNB_MIN_8BIT = 4096
"""bitsandbytes keeps tensors with fewer elements than this in fp32 states (its `min_8bit_size` default)."""


@dataclass(frozen=True)
class OptimShapes:
    """What the shape-dependent optimizers' state depends on, summed over the trainable tensors."""

    block_matrices: int
    """Elements of the blocks' 2-D matrices: what Muon keeps a momentum for (torch.optim.Muon takes
    only 2-D parameters; embeddings, head, vectors and stacked 3-D experts run under AdamW)."""
    largest_matrix: tuple[int, int]
    """(rows, cols) of the largest of those: the whole matrix Muon's Newton-Schulz step orthogonalises."""
    small: int
    """Elements of tensors under BNB_MIN_8BIT, which bitsandbytes' 8-bit AdamW keeps in fp32."""
    quant_blocks: int
    """BNB_BLOCK-element blocks of the other tensors: one fp32 absmax per block and state."""
    tensors: int = 0
    """Trainable tensors: torch's AdamW and Adafactor keep a 0-dim fp32 `step` for each."""
    matrices: int = 0
    """Of those, the blocks' 2-D matrices (Muon's, which keeps no step)."""

    @classmethod
    def of(cls, shapes, in_blocks) -> "OptimShapes":
        """From (shape, inside a block) pairs of the trainable tensors, each unique tensor once."""
        shapes, in_blocks = list(shapes), list(in_blocks)
        n = [_numel(s) for s in shapes]
        mats = [tuple(s) for s, b in zip(shapes, in_blocks) if b and len(s) == 2]
        return cls(block_matrices=sum(r * c for r, c in mats),
                   largest_matrix=max(mats, key=lambda m: m[0] * m[1], default=(0, 0)),
                   small=sum(k for k in n if k < BNB_MIN_8BIT),
                   quant_blocks=sum(ceil(k / BNB_BLOCK) for k in n if k >= BNB_MIN_8BIT),
                   tensors=len(n), matrices=len(mats))

    def scaled(self, frac: float, split: bool = False) -> "OptimShapes":
        """A share holding `frac` of the elements: of the tensors too (a pipeline stage), or of each
        tensor (`split`: a tensor-parallel share). The matrix Muon gathers stays whole (its
        Newton-Schulz step needs the full matrix)."""
        count = 1 if split else frac
        return OptimShapes(round(self.block_matrices * frac), self.largest_matrix, round(self.small * frac),
                           round(self.quant_blocks * frac), round(self.tensors * count), round(self.matrices * count))


def _numel(shape) -> int:
    n = 1
    for k in shape:
        n *= k
    return n


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
    optim_shapes: OptimShapes | None = None
    """What Muon's and 8-bit AdamW's state depend on; None if shapes unknown (a bare count)."""
    tied_groups: tuple[tuple[str, ...], ...] = ()
    """Names that share one parameter, e.g. (('embed.weight', 'lm_head.weight'),)."""
    decoder: DecoderConfig | None = None
    """Transformer dimensions when known; without them activations are reported as unknown."""
    activation_bytes_per_sample: int | None = None
    """For other models with `example_inputs`: bytes autograd saves per sample in fp32, counted
    by a shape-only forward on the meta device (see probe_activations)."""
    source: str = "module"
    """preset | hf-config | module | params."""
    quantized_params: int = 0
    """Frozen elements stored quantised (a QLoRA base's block linears, model/lora.py); 0: none."""
    quantized_bytes: int = 0
    """Their bytes as stored: packed values and quantisation constants."""
    grouped_experts: bool = False
    """The MoE experts are transformers' grouped_mm ones (runs_grouped_experts): they multiply in their
    weights' dtype, outside autocast (Family.autocast_experts_problem). A preset or config.json MoE with a
    transformers model_type is built so (transformers 5's default experts_implementation)."""

    @property
    def max_positions(self) -> int | None:
        return self.decoder.max_positions if self.decoder else None

    @property
    def active_params(self) -> int:
        """Parameters one token's computation uses: all but the routed experts it is not sent to
        (an MoE decoder's published 'active' count); a multimodal model's text decoder only. A model
        without a readable decoder: all of them."""
        return self.decoder.active_params if self.decoder is not None else self.params

    @property
    def active_non_embedding_params(self) -> int:
        """active_params without the input embedding, a lookup (gpt-oss's model card counts this way;
        Meta's and DeepSeek's count the embeddings)."""
        d = self.decoder
        if d is None:
            return self.params
        return self.active_params - d.vocab * d.hidden * (0 if d.tied else 1)

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("name", "params", "trainable_params", "param_bytes",
                                           "buffer_bytes", "block_class", "num_blocks", "block_params",
                                           "root_params", "largest_layer_params", "largest_param",
                                           "factored_state", "activation_bytes_per_sample", "source",
                                           "quantized_params", "quantized_bytes")}
        d["active_params"] = self.active_params
        d["active_non_embedding_params"] = self.active_non_embedding_params
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
        optim_shapes=_closed_shapes(cfg), decoder=cfg, source=source,
        grouped_experts=cfg.moe and cfg.hf_model_type is not None)      # sources._decoder_builder: transformers'


def _closed_shapes(cfg: DecoderConfig) -> OptimShapes:
    """OptimShapes of a decoder shape: every block's tensors, then the root's (tied weights once)."""
    block, root = cfg.block_matrices(), cfg.root_matrices()
    return OptimShapes.of(block * cfg.layers + root, [True] * (len(block) * cfg.layers) + [False] * len(root))


TP_DEGREES = (1, 2, 4, 8)
"""Tensor-parallel degrees the planner tries (inside one scale-up domain, up to 8 as Megatron-LM and
torchtitan recipes do; on NVL72 8 spans two 4-GPU trays)."""


def tp_problem(profile: ModelProfile, tp: int) -> str | None:
    """Why tensor parallelism cannot split this model `tp` ways as the runtime runs it (one line
    naming the fix), or None: the rule the runtime checks (hybrid/model/tp_plan.py), asked of the
    profile's decoder: hybrid's llama-style closed forms, or a decoder read from a transformers
    module with its base_model_tp_plan; heads and key/value heads divisible by tp; dense MLPs
    (MoE experts are split by ep)."""
    from .tp_plan import decoder_problem
    return decoder_problem(profile.decoder, tp, profile.name)


def tp_degrees(profile: ModelProfile, gpus_per_node: int) -> list[int]:
    """tp that divides `gpus_per_node` (the GPUs of one scale-up domain: Cluster.domain) and that the
    runtime can apply to this model (tp_problem); [1] for a model it cannot split."""
    return [t for t in TP_DEGREES if t == 1 or (gpus_per_node % t == 0 and tp_problem(profile, t) is None)]


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
    q_elems, q_bytes = quantized_storage(params)
    for p in params:
        dtype_bytes[str(p.dtype).replace("torch.", "")] += p.numel() * p.element_size()
    cls, blocks = find_blocks(text_decoder(module))
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    block_sizes = [sum(p.numel() for p in b.parameters()) for b in blocks]
    own = [sum(p.numel() for p in m.parameters(recurse=False)) for m in module.modules()]
    factored = sum((p.shape[-2] + p.shape[-1]) * (p.numel() // (p.shape[-2] * p.shape[-1]))
                   if p.dim() >= 2 else p.numel() for p in params)
    packed = sum(p.numel() for p in params if quantized_elements(p))
    return ModelProfile(
        name=name or type(module).__name__,
        params=sum(p.numel() for p in params) - packed + q_elems, quantized_params=q_elems, quantized_bytes=q_bytes,
        trainable_params=sum(p.numel() for p in params if p.requires_grad),
        param_bytes=sum(dtype_bytes.values()), dtype_bytes=tuple(sorted(dtype_bytes.items())),
        buffer_bytes=sum(b.numel() * b.element_size() for b in module.buffers()),
        block_class=cls, num_blocks=len(blocks), block_params=max(block_sizes, default=0),
        root_params=sum(p.numel() for p in params if id(p) not in in_blocks),
        largest_layer_params=max(own, default=0), largest_param=max(p.numel() for p in params),
        factored_state=factored,
        optim_shapes=OptimShapes.of([tuple(p.shape) for p in params if p.requires_grad],
                                    [id(p) in in_blocks for p in params if p.requires_grad]),
        tied_groups=tuple(tuple(g) for g in groups.values() if len(g) > 1),
        decoder=decoder_of(module), source="module", grouped_experts=runs_grouped_experts(module))


def runs_grouped_experts(module) -> bool:
    """Whether the module's MoE experts are transformers' grouped_mm ones: its config's
    `_experts_implementation` is grouped_mm (transformers 5's default) and it holds experts of
    `@use_experts_implementation` (they carry `has_gate`). Our decoder's experts loop in autocast's dtype."""
    if getattr(getattr(module, "config", None), "_experts_implementation", None) != "grouped_mm":
        return False
    return any(hasattr(m, "has_gate") for m in module.modules())


def text_decoder(module):
    """A multimodal model's language model (what is planned: its blocks are the units), else the module."""
    for owner in (module, getattr(module, "model", None)):
        lm = getattr(owner, "language_model", None)
        if lm is not None and hasattr(lm, "parameters"):
            return lm
    return module


def quantized_elements(p) -> int:
    """Weights a bitsandbytes-quantised parameter stands for (Params4bit packs two per byte and
    keeps the shape in its quant_state; Int8Params one per byte), 0 for an ordinary parameter."""
    kind = type(p).__name__
    state = getattr(p, "quant_state", None)
    if kind == "Params4bit" and state is not None:
        return math.prod(state.shape)
    if kind == "Int8Params" and str(p.dtype) == "torch.int8":
        return p.numel()
    return 0


def quantized_storage(params) -> tuple[int, int]:
    """(weights, bytes) of the quantised parameters: the packed values and every tensor of their
    quantisation state (absmax, the nested state's absmax and code, the code, the offset; Int8Params'
    row scales SCB), each storage once."""
    seen: dict[int, int] = {}
    elements = 0
    for p in params:
        n = quantized_elements(p)
        if not n:
            continue
        elements += n
        state = getattr(p, "quant_state", None)
        tensors = [p]
        if state is not None:
            nested = getattr(state, "state2", None)
            tensors += [state.absmax, state.code, getattr(state, "offset", None)]
            tensors += [nested.absmax, nested.code] if nested is not None else []
        tensors.append(getattr(p, "SCB", None))
        for t in tensors:
            if t is not None and hasattr(t, "untyped_storage"):
                st = t.untyped_storage()
                seen[st.data_ptr() or id(st)] = st.nbytes()
    return elements, sum(seen.values())


def decoder_of(module) -> DecoderConfig | None:
    """The module's transformer shape: our decoder's config; for a transformers model the closed
    form of the architectures we know it by (llama, mistral, gpt2, mixtral, qwen3_moe, olmoe: their
    formulas are held byte-exact to the built modules), else its anatomy read block by block from
    the module itself (hybrid/model/anatomy.py); None when there is no readable repeated block."""
    cfg = getattr(module, "config", None)
    if isinstance(cfg, DecoderConfig):
        return cfg
    if cfg is not None and hasattr(cfg, "to_dict"):
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        return from_hf_config(text.to_dict()) or read_decoder(module, text)
    return None


_NOT_REBUILT = ("transformers_version", "_name_or_path", "architectures", "dtype", "torch_dtype", "auto_map")


def read_decoder(module, cfg) -> DecoderConfig | None:
    """A transformers decoder's shape read from the built module: every block's anatomy, with a
    representative layer's figures in the scalar fields (see DecoderConfig.stack)."""
    import json

    from .anatomy import Unreadable, read_layers
    from .presets import _rope_theta
    from .tp_plan import HFPlan
    emb = module.get_input_embeddings() if hasattr(module, "get_input_embeddings") else None
    w = getattr(emb, "weight", None)
    if w is None or w.dim() != 2:
        return None
    _, blocks = find_blocks(text_decoder(module))
    if not blocks:
        return None
    vocab, hidden = int(w.shape[0]), int(w.shape[1])
    try:
        layers = read_layers(blocks, cfg, hidden)
    except (Unreadable, AttributeError, TypeError, IndexError):
        return None
    head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    tied = head is not None and getattr(head, "weight", None) is w
    moe = [ly.mlp for ly in layers if ly.mlp.moe]
    dense = [ly.mlp.ffn for ly in layers if not ly.mlp.moe]
    attn = max((ly.attention for ly in layers), key=lambda a: a.heads * a.head_dim)
    windows = [a.window or a.chunk for a in (ly.attention for ly in layers) if a.window or a.chunk]
    d = cfg.to_dict()
    hf = {k: v for k, v in d.items() if k not in _NOT_REBUILT}
    max_pos = d.get("max_position_embeddings") or d.get("n_positions") or 4096
    return DecoderConfig(
        "llama", vocab, hidden, len(layers), attn.heads, max(dense) if dense else moe[0].moe_ffn,
        min(int(max_pos), 1 << 30), kv_heads=attn.kv_heads, tied=tied,
        norm_eps=float(d.get("rms_norm_eps") or d.get("layer_norm_eps") or 1e-5), rope_theta=_rope_theta(d),
        hf_model_type=d.get("model_type"), sliding_window=min(windows) if windows else None,
        head_size=attn.head_dim, qk_norm=attn.qk_norm if attn.qk_norm in ("head", "full") else None,
        experts=moe[0].experts if moe else 0, top_k=moe[0].top_k if moe else 0,
        moe_ffn=moe[0].moe_ffn if moe else 0, stack=layers, hf_json=json.dumps(hf, default=str, sort_keys=True),
        tp_plan=HFPlan.of(module))


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


