"""The cross-check matrix's cells, in one place: tests/measure/test_matrix.py holds each to its bound and
benchmarks/matrix_accuracy.py prints the same cells' gaps. One 2-rank cluster (1 x 2 h100-80gb) for
every cell; each pair is (analytic, traced) live-tensor bytes at the peak of one rank."""
from __future__ import annotations

from hybrid.config.cluster import Cluster
from hybrid.config.spec import TrainSpec
from hybrid.estimation.memory.analytic import estimate
from hybrid.families.catalogue import load_catalogue
from hybrid.layout.layout import Layout
from hybrid.layout.pipeline import stage_cluster
from hybrid.measure.stages import traced_stage_estimate
from hybrid.measure.traced import traced_estimate
from hybrid.model.presets import DecoderConfig
from hybrid.planning.stages import staged

CAT = load_catalogue()
TWO = Cluster.build(1, 2, "h100-80gb")

DENSE = [  # (strategy, tp, cp, checkpointing, transformers): tiny-llama at 2 x 256 tokens
    ("ddp", 1, 1, "none", False), ("ddp", 1, 1, "full", True), ("fsdp", 1, 1, "none", True),
    ("fsdp", 1, 1, "full", False), ("zero2", 1, 1, "none", False), ("fsdp", 1, 2, "none", False),
    ("ddp", 1, 2, "none", False), ("fsdp", 2, 1, "none", True), ("ddp", 2, 1, "full", False),
]
PIPELINE = [  # (strategy, checkpointing, pp rank): tiny-llama at pp 2 (one block a stage), 1f1b, 2 micro-batches
    (s, ac, r) for s in ("fsdp", "ddp") for ac in ("none", "full") for r in (0, 1)
]
EXPERT = [  # (model, checkpointing): fsdp at ep 2 (two of the 4 experts a rank), 2 x 64 tokens
    (m, ac) for m in ("mixtral", "qwen3_moe", "ours") for ac in ("none", "full")
]


LIVE = [  # (strategy, tp, cp, ep, model, transformers): fp32, 2 x 64 tokens, traced and run on 2 gloo ranks
    ("fsdp", 1, 1, 1, "tiny-llama", False), ("ddp", 1, 1, 1, "tiny-llama", True),
    ("fsdp", 2, 1, 1, "tiny-llama", True), ("ddp", 2, 1, 1, "tiny-llama", False),
    ("fsdp", 1, 2, 1, "tiny-llama", False), ("ddp", 1, 2, 1, "tiny-llama", False),
    ("fsdp", 1, 1, 2, "ours", False), ("fsdp", 1, 1, 2, "mixtral", True),
]


def live_label(cell) -> str:
    strategy, tp, cp, ep, model, hf = cell
    return f"{strategy} tp {tp} cp {cp} ep {ep} {model} {'transformers' if hf else 'hybrid'}"


def live_source(model: str):
    from hybrid.model.sources import resolve_model
    return resolve_model(model) if model.startswith("tiny-") else moe_source(model)


def live_pairs(cells=LIVE):
    """(traced, live) tensor bytes at the peak of the busiest rank for each cell: every live job in one
    launch of 2 gloo ranks (measure/measured.measured_estimates), each traced on fake tensors here. The
    trace's expert dispatch is balanced (--moe-imbalance 1): a fresh model's live routing nearly is
    (measured: the ep cells' live peak is 0.4% above the balanced trace and 4% under the default 1.25)."""
    from hybrid.measure.measured import Job, measured_estimates
    spec = TrainSpec(2, 64, precision="fp32", moe_imbalance=1.0)
    jobs = [Job.of(live_source(m), CAT[s], spec, TWO, tp=tp, cp=cp, ep=ep, prefer_hf=hf)
            for s, tp, cp, ep, m, hf in cells]
    live = measured_estimates(jobs)
    traced = [traced_estimate(live_source(m), CAT[s], spec, TWO, tp=tp, cp=cp, ep=ep, prefer_hf=hf, fast=False)
              for s, tp, cp, ep, m, hf in cells]
    return [(t.memory.tensors, m.memory.tensors) for t, m in zip(traced, live)]


def dense_family(cell) -> str:
    strategy, tp, cp, ac, hf = cell
    return "tp2" if tp > 1 else "cp2" if cp > 1 else "transformers decoders" if hf else "dense tp1"


def dense_pair(src, strategy, tp, cp, ac, hf):
    spec = TrainSpec(2, 256, activation_checkpointing=ac)
    t = traced_estimate(src, CAT[strategy], spec, TWO, tp=tp, cp=cp, fast=False, prefer_hf=hf)
    a = estimate(Layout.of(CAT[strategy], TWO, spec, tp=tp, cp=cp), src.profile, spec, TWO)
    assert t.implementation == ("transformers" if hf else "hybrid"), t.implementation
    return a.tensors, t.memory.tensors


def pipeline_pair(src, strategy, ac, rank):
    """One pp rank: the planner's stage split (planning/stages.staged), the analytic estimate of that
    rank on its stage's ranks, and its stage traced through torch.distributed.pipelining's PipelineStage in
    the 1f1b order (traced_stage_estimate; a fake process group in this process)."""
    spec = TrainSpec(2, 256, activation_checkpointing=ac, gradient_accumulation=2)
    layout = staged(Layout.of(CAT[strategy], TWO, spec, pp=2, schedule="1f1b"), src.profile, spec, TWO)
    a = estimate(layout, src.profile, spec, stage_cluster(TWO, 2), rank)
    t = traced_stage_estimate(src, CAT[strategy], spec, TWO, None, 1, layout.pipeline, rank)
    return a.tensors, t.memory.tensors


def moe_source(model: str):
    """A 2-block MoE decoder, 4 experts, top 2, vocabulary 512, 64 positions: transformers' Mixtral or
    Qwen3-MoE (query/key norms, head size 32), or our decoder with Mixtral's blocks ("ours")."""
    from hybrid.model.profile import profile_decoder
    from hybrid.model.sources import ModelSource, _decoder_builder
    qwen = model == "qwen3_moe"
    cfg = DecoderConfig("llama", 512, 32, 2, 4, 48, 64, kv_heads=2, hf_model_type=None if model == "ours" else model,
                        experts=4, top_k=2, moe_ffn=48, qk_norm="head" if qwen else None,
                        head_size=32 if qwen else None)
    return ModelSource(profile_decoder(cfg, f"tiny-{model}"), _decoder_builder(cfg), None, cfg)


def expert_pair(model, ac):
    src = moe_source(model)
    spec = TrainSpec(2, 64, activation_checkpointing=ac)
    t = traced_estimate(src, CAT["fsdp"], spec, TWO, ep=2, fast=False, prefer_hf=model != "ours")
    a = estimate(Layout.of(CAT["fsdp"], TWO, spec, ep=2), src.profile, spec, TWO)
    assert t.implementation == ("hybrid" if model == "ours" else "transformers"), t.implementation
    return a.tensors, t.memory.tensors
