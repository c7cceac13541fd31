"""Printing a Plan: breakdown tables, the ranked comparison, and the memory plot (thin)."""
from __future__ import annotations

from typing import Any

from ..estimation.memory.breakdown import CATEGORIES
from ..layout.layout import DIMENSIONS
from ..units import fmt_bytes

Plan = Candidate = Any
"""planning.candidate's values, duck-typed: a Plan prints itself through this module, so this
module does not import candidate back."""

_COLS = CATEGORIES + ("total",)


def _header(p: Plan) -> list[str]:
    s = p.spec
    lines = _spec_lines(p)
    if s.compile:
        lines[0] += ", torch.compile (per block, and the loss)"
    return lines


def _counts(model) -> str:
    """'N params', and for a mixture of experts the parameters a token uses beside it."""
    if model.active_params != model.params:
        return f"{model.params:,} params ({model.active_params:,} active)"
    return f"{model.params:,} params"


def _loss(s) -> str:
    """The loss kind where it is not eager's whole logits (the line stays as it was otherwise)."""
    return "" if s.loss == "eager" else f", {s.loss} loss"


def _spec_lines(p: Plan) -> list[str]:
    s = p.spec
    if s.global_batch is not None:
        return [f"model {p.model.name}: {_counts(p.model)}; global batch {s.global_batch} x seq {s.seq_len}, "
                f"{s.precision}, {s.optimizer}, activation checkpointing {s.activation_checkpointing}, "
                f"attention {s.attention}{_loss(s)}",
                f"global batch {s.global_batch} sequences per step in every row{_implied(p)} = micro-batch x "
                "accumulation x data-parallel ranks (batch: micro-batch x accumulation, and the largest micro-batch "
                "that fits)",
                f"cluster {p.cluster.describe()}; memory method {p.method}", *_speed(p), ""]
    return [f"model {p.model.name}: {_counts(p.model)}; micro-batch {s.micro_batch} x seq {s.seq_len}, "
            f"{s.precision}, {s.optimizer}, activation checkpointing {s.activation_checkpointing}, "
            f"attention {s.attention}{_loss(s)}",
            f"global batch {p.global_batch} sequences = micro-batch {s.micro_batch} x accumulation "
            f"{s.gradient_accumulation} x {p.dp_size} data-parallel ranks",
            f"cluster {p.cluster.describe()}; memory method {p.method}", *_speed(p), ""]


def _implied(p: Plan) -> str:
    """Where the global batch came from when --global-batch was not given (planner.implied_batch)."""
    if not getattr(p, "batch_implied", False):
        return ""
    s = p.spec
    return (f" (micro-batch {s.micro_batch} x accumulation {s.gradient_accumulation} x {p.cluster.world_size} GPUs; "
            "--global-batch sets another)")


def _speed(p: Plan) -> list[str]:
    """The header lines of a plan made with a calibration file, and of its goodput figures."""
    out = [f"speed {p.calibration.describe()}"] if getattr(p, "calibration", None) is not None else []
    rel = getattr(p, "reliability", None)
    return out + ([rel.describe(p.cluster.world_size)] if rel is not None else [])


def _mem(c: Candidate, col: str) -> str:
    if c.memory is None:
        return "-"
    return fmt_bytes(c.memory.total if col == "total" else getattr(c.memory, col))


def _width(cands) -> int:
    """The strategy column fits the longest label (at least 28 wide)."""
    return max([28] + [len(c.label) + 1 for c in cands])


def _fits(c: Candidate) -> str:
    """The table's fits column: the candidate's verdict, yes / no for fits / OOM."""
    return {"fits": "yes", "OOM": "no"}.get(c.verdict, c.verdict)


def breakdown_table(cands: list[Candidate], chosen: Candidate | None = None) -> str:
    """Every memory category per candidate (estimate, compare), and the phase of the step where
    that peak happens (forward, head, loss, blocks = backward through the blocks, step)."""
    w = _width(cands)
    head = (f" {'strategy':<{w}}{'shard':>6}" + "".join(f"{c[:11]:>12}" for c in _COLS)
            + f"  {'peak in':<8}{'fits':>7}")
    lines = [head, "-" * len(head)]
    for c in cands:
        mark = "*" if c is chosen else " "
        phase = (c.memory.phase or "-") if c.memory else "-"
        lines.append(f"{mark}{c.label:<{w}}{c.shard_size:>6}" + "".join(f"{_mem(c, k):>12}" for k in _COLS)
                     + f"  {phase:<8}{_fits(c):>7}")
    return "\n".join(lines)


def ranking_table(cands: list[Candidate], chosen: Candidate | None = None) -> str:
    """Fitting candidates fastest first, then the rest with the reason they were rejected."""
    w = _width(cands)
    # at a global batch each layout's batch shape is its own (hybrid/planning/batch.py): a column says it
    bw = max([0] + [len(c.batch.describe()) + 2 for c in cands if c.batch is not None])
    bcol = (lambda c: f"{c.batch.describe() if c.batch and c.memory else '-':>{bw}}") if bw else (lambda c: "")
    head = (f" {'strategy':<{w}}{'shard':>6}" + (f"{'batch':>{bw}}" if bw else "")
            + f"{'per GPU':>11}{'fits':>7}{'step s':>9}{'tok/s/GPU':>11}{'MFU':>7}{GOODPUT_HEAD}  note")
    lines = [head, "-" * (len(head) + 30)]
    for c in cands:
        mark = "*" if c is chosen else " "
        if c.memory is None:
            lines.append(f"{mark}{c.label:<{w}}{c.shard_size:>6}{bcol(c)}{'-':>11}{'n/a':>7}{'':>9}{'':>11}{'':>7}"
                         f"{_goodput_cols(c)}  {c.reason}")
            continue
        cost = c.cost
        roomy = c.fits and not c.tight
        note = c.memory.describe_largest() + c.layout.pipeline_note(bubble=True) if roomy else c.reason
        lines.append(f"{mark}{c.label:<{w}}{c.shard_size:>6}{bcol(c)}{fmt_bytes(c.memory.total):>11}"
                     f"{_fits(c):>7}{cost.seconds:>9.3f}{cost.tokens_per_s_per_gpu:>11,.0f}"
                     f"{cost.mfu:>7.1%}{_goodput_cols(c)}  {note}")
    return "\n".join(lines)


GOODPUT_HEAD = f"{'ckpt s':>8}{'every':>7}{'goodput':>9}"
"""The ranking's goodput columns: seconds a save blocks training, the Young/Daly interval, and the
useful tokens/s per GPU after failures, restarts and checkpoints (hybrid/planning/goodput.py)."""


def _goodput_cols(c: Candidate) -> str:
    g = c.goodput
    if g is None:
        return f"{'':>8}{'':>7}{'':>9}"
    from .goodput import fmt_duration
    return f"{g.checkpoint_s:>8.1f}{fmt_duration(g.interval_s):>7}{g.tokens_per_s_per_gpu:>9,.0f}"


def _notes(p: Plan, rows: list[Candidate] | None = None) -> list[str]:
    shown = rows if rows is not None else list(p.candidates)
    notes = sorted({n for c in shown if c.memory for n in c.memory.notes})
    return [f"note: {n}" for n in notes]


def best_per_strategy(p: Plan) -> list[Candidate]:
    """Each strategy's best candidate: the chosen one, else its fastest fitting variant, else its
    smallest; in the plan's order."""
    best: dict[str, Candidate] = {}
    for c in p.candidates:                      # fitting first (fastest first), then by memory
        if c.name not in best or c is p.chosen:
            best[c.name] = c
    return [c for c in p.candidates if best.get(c.name) is c]


def top_rows(p: Plan, top: int) -> list[Candidate]:
    """The best `top` candidates, the best of each family (its fastest fitting, else its smallest)
    and the choice, in the plan's order."""
    keep = {id(c) for c in p.candidates[:top]}
    seen: set[str] = set()
    for c in p.candidates:                      # fitting first (fastest first), then by memory
        if c.strategy.family not in seen and c.memory is not None:
            seen.add(c.strategy.family)
            keep.add(id(c))
    if p.chosen is not None:
        keep.add(id(p.chosen))
    return [c for c in p.candidates if id(c) in keep]


def format_plan(p: Plan, summary: bool = False, top: int | None = None) -> str:
    """summary: one row per strategy (its best shard size and checkpointing) instead of all;
    top: the best `top` rows plus the best of each family and the choice (top_rows)."""
    rows = best_per_strategy(p) if summary else (top_rows(p, top) if top else list(p.candidates))
    out = _header(p) + [ranking_table(rows, p.chosen)]
    if len(rows) < len(p.candidates) and not summary:
        out.append(f"({len(rows)} of {len(p.candidates)} candidates: the best {top}, the best of each family and the "
                   "choice; --all shows every one, --top N the best N)")
    out.append("")
    c = p.chosen
    if c:
        verdict = "fastest that fits" if c.memory.activations is not None else \
            "chosen by auto_wrap on its model states alone (activations unknown)"
        if c.tight:
            verdict = ("nothing fits with the allocator's full reserve; fastest that fits tightly (it runs on "
                       "the allocator's retries)")
        best = p.fastest
        if best is not None and best is not c and best.rank_time < c.rank_time:
            whose = "the calibration's" if p.calibration is not None else "the model's"
            verdict = (f"within {whose} error ({p.tie:.1%}) of {best.label} (predicted "
                       f"{c.rank_time / best.rank_time - 1:.1%} slower) and simpler; "
                       "measure with hybrid tune")
        shape = (f"micro-batch {c.batch.micro_batch} x accumulation {c.batch.gradient_accumulation} x "
                 f"{c.parallel.dp_size} data-parallel ranks, " if c.batch is not None else "")
        out.append(f"chosen: {c.label} ({c.parallel.describe()}): {verdict}, {shape}"
                   f"{c.cost.seconds:.3f} s/step, {c.cost.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, "
                   f"MFU {c.cost.mfu:.1%}; {c.reason}")
        faster = [t for t in p.candidates if t.tight and t.cost.time_per_token < c.cost.time_per_token]
        if faster and not c.tight:
            t = min(faster, key=lambda x: x.cost.time_per_token)
            out.append(f"tight and faster: {t.label} ({t.parallel.describe()}), {t.cost.tokens_per_s_per_gpu:,.0f} "
                       f"tokens/s per GPU (+{c.cost.time_per_token / t.cost.time_per_token - 1:.0%}): it fits only "
                       "when the allocator frees its cache, so it is not chosen; to run it anyway, pass its "
                       "--strategy and --activation-checkpointing")
        out += _goodput_lines(p)
        out += [line for dim in WHY for line in _why(p, dim)]
        out += lora_lines(p, c)
    elif p.missing:
        states = [x for x in p.candidates if x.fits]
        best = min(states, key=lambda x: x.cost.time_per_token)
        out.append(f"nothing chosen: {', '.join(p.missing)} unknown, so no layout is known to fit; the model states "
                   f"fit with {len(states)} layout(s), fastest {best.label} ({best.parallel.describe()}, "
                   f"{best.cost.seconds:.3f} s/step). Give a preset, a config.json or a module instead of --params "
                   "to choose")
    else:
        out.append(f"nothing fits in {fmt_bytes(p.cluster.capacity_bytes)} per GPU")
        if p.suggestions:
            out.append("smallest changes that would fit: " + "; ".join(p.suggestions))
    return "\n".join(out + _notes(p, [c] if c else rows))


def _goodput_lines(p: Plan) -> list[str]:
    """The chosen layout's checkpoints and goodput, and why goodput changed the choice where it did."""
    c, g = p.chosen, p.chosen.goodput
    if g is None:
        return []
    from .goodput import fmt_duration
    out = [f"goodput of {c.label}: a save blocks {g.checkpoint_s:.1f} s ({fmt_bytes(g.write_bytes)} written per rank), "
           f"one every {fmt_duration(g.interval_s)} ({g.interval_s:.0f} s, Young/Daly); a restart takes "
           f"{g.restart_s:.0f} s (relaunch + load {g.load_s:.1f} s); {g.fraction:.1%} of the time trains: "
           f"{g.tokens_per_s_per_gpu:,.0f} useful tokens/s per GPU"]
    s = getattr(p, "by_speed", None)
    if s is not None and s.goodput is not None:
        sg = s.goodput
        out.append(f"why {c.label} by goodput: on step time alone the choice is {s.label} "
                   f"({s.cost.tokens_per_s_per_gpu:,.0f} tokens/s per GPU against {c.cost.tokens_per_s_per_gpu:,.0f}), "
                   f"but it keeps {sg.fraction:.1%} of its time after failures (save {sg.checkpoint_s:.1f} s, "
                   f"restart {sg.restart_s:.0f} s) against {g.fraction:.1%}: {sg.tokens_per_s_per_gpu:,.0f} "
                   f"useful tokens/s per GPU against {g.tokens_per_s_per_gpu:,.0f}")
    return out


def _ep_cause(c: Candidate, best: Candidate) -> str:
    ep = c if "ep" in c.layout.used() else best
    return (f"; at ep {ep.ep} the all-to-alls take {ep.cost.all_to_all_s:.3f} s and the busiest rank's extra "
            f"expert compute {ep.cost.straggler_s:.3f} s of its {ep.cost.seconds:.3f} s step")


WHY = {
    # dimension: (said when the chosen layout does not use it too, the rival named when it does, why none fits
    # (None: the best rival's reason), the tie's words, the cost behind the choice)
    "cp": (False, "without it", "(recomputation and tp do not divide the sequence's activations enough)",
           " (fewer pipeline, then tensor-parallel ranks before context-parallel ones)", None),
    "ep": (True, "without expert parallelism", None, "", _ep_cause),
}
"""The "why" line of each dimension the planner searches beside data parallelism."""


def _why(p: Plan, dim: str) -> list[str]:
    """Why the chosen layout splits `dim` (or, where WHY says so, why it does not): the best fitting
    layout on the other side of degree 1 and its speed, or that none fits there. Nothing when the
    degree was pinned (no rival)."""
    c = p.chosen
    both, without, no_fit, tie, cause = WHY[dim]
    if c is None:
        return []
    uses = dim in c.layout.used()
    n, name = getattr(c.parallel, dim), DIMENSIONS[dim]
    other = [x for x in p.candidates if (dim in x.layout.used()) != uses]
    if not other or not (uses or both):
        return []
    what = without if uses else f"with {name}"
    # rivals of the chosen one's class: a layout that fits only tightly is no rival of one with room
    fitting = [x for x in other if x.fits and (c.tight or not x.tight)]
    if not fitting:
        if no_fit is not None:
            return [f"why {dim} {n}: no layout without {name} fits {no_fit}"]
        rivals = [x for x in other if x.memory is not None]
        least = min(rivals, key=lambda x: x.memory.needed, default=None)
        return [f"why {dim} {n}: no layout {what} fits (the best, {least.label}, {least.reason})"] if least else []
    best = min(fitting, key=lambda x: x.cost.time_per_token)
    gain = best.cost.time_per_token / c.cost.time_per_token - 1
    why = cause(c, best) if cause else ""
    head = (f"why {dim} {n}: the best layout {what}, {best.label}, runs {best.cost.tokens_per_s_per_gpu:,.0f} "
            "tokens/s per GPU")
    if gain >= 0:
        return [f"{head} ({gain:.1%} slower){why}"]
    return [f"{head} ({-gain:.1%} faster, within the model's error): the tie goes to the simpler layout{tie}{why}"]


def lora_lines(p: Plan, c: Candidate | None) -> list[str]:
    """How a LoRA job fits: the adapters and their states, the frozen base's bytes (quantised and
    not), the chosen layout's share of it, and what the MFU counts. Empty without LoRA."""
    lora, m, s = p.spec.lora, p.model, p.spec
    if lora is None:
        return []
    from ..families.placement import frozen_bytes
    from ..model.lora import adapted_per_block
    d = m.decoder
    names, per_block = adapted_per_block(d, lora) if d is not None and m.source != "module" else ([], 0)
    where = f" on {', '.join(names)} ({per_block} linears per block, {d.layers} blocks)" if names else ""
    frozen = m.params - m.trainable_params
    state = 4 + 4 + s.bytes.state * (2 if s.optimizer == "adamw" else 1 if s.optimizer == "sgd" else 0)
    out = [f"fine-tuning: LoRA r{lora.rank}{where}: adapters {m.trainable_params:,} params "
           f"({m.trainable_params / m.params:.2%}), each with an fp32 master, gradient and {s.optimizer} state"
           f"{f' ({state} B/param)' if s.optimizer in ('adamw', 'sgd') else ''}"]
    base = frozen_bytes(m, s)
    plain = frozen - m.quantized_params
    dtype = {2: "bf16" if "bf16" in s.precision else "fp16", 4: "fp32"}[s.frozen_bytes]
    line = f"frozen base {frozen:,} params, {fmt_bytes(base)}"
    if m.quantized_params:
        line += (f": {m.quantized_params:,} block-linear weights in {lora.quantize} "
                 f"({8 * m.quantized_bytes / m.quantized_params:.3f} bits each with its quantisation constants, "
                 f"{fmt_bytes(m.quantized_bytes)}) and {plain:,} in {dtype} ({fmt_bytes(plain * s.frozen_bytes)})")
    else:
        line += f" in {dtype} (no fp32 master: nothing updates it)"
    out.append(line)
    if c is not None and c.memory is not None and c.memory.cpu and not c.memory.params:
        out.append(f"{c.label} ({c.parallel.describe()}) keeps the parameters, sharded, in host memory "
                   f"({fmt_bytes(c.memory.cpu)} per rank with the optimizer state) and gathers each block to the GPU")
    elif c is not None and c.memory is not None:
        out.append(f"{c.label} ({c.parallel.describe()}) holds {fmt_bytes(c.memory.params)} of parameters per GPU "
                   f"(the frozen base {'sharded with the adapters' if c.memory.params < base * 0.9 else 'whole'}"
                   f"{'; its all-gathers carry the frozen base too' if c.memory.params < base * 0.9 else ''}), "
                   f"{fmt_bytes(c.memory.optimizer)} of optimizer state")
    out.append("MFU counts 4 FLOPs per frozen weight and token (its forward and its input's gradient) and 6 per "
               "adapter weight; the frozen weights' gradients are never computed and not counted")
    return out


def format_estimate(p: Plan) -> str:
    out = _header(p) + [breakdown_table(list(p.candidates)), ""]
    for c in p.candidates:
        knobs = ", ".join(f"{k}={v}" for k, v in c.strategy.knobs().items())
        out.append(f"{c.name}: {c.strategy.description} [{c.strategy.family}: {knobs}]")
        line = f"{c.label} (shard size {c.shard_size}): {c.reason}"
        if c.batch is not None and c.memory is not None:
            line += f"; batch {c.batch.describe()} (micro-batch x accumulation)"
        if c.cost:
            line += (f"; predicted {c.cost.seconds:.3f} s/step, {c.cost.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, "
                     f"MFU {c.cost.mfu:.1%}")
        out.append(line)
        if c.memory and c.memory.cpu:
            out.append(f"host memory per rank: {fmt_bytes(c.memory.cpu)}")
    out += lora_lines(p, p.candidates[0] if len(p.candidates) == 1 else None)
    return "\n".join(out + _notes(p))


def format_compare(p: Plan) -> str:
    return "\n".join(_header(p) + [breakdown_table(list(p.candidates), p.chosen), "",
                                   ranking_table(list(p.candidates), p.chosen)] + _notes(p))


def plot_compare(p: Plan, path: str) -> None:
    """Stacked bars of per-GPU memory by category, the capacity as a line, and predicted
    throughput beside each bar."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cands = [c for c in p.candidates if c.memory is not None]
    gib = 1024**3
    colors = {"params": "#4C72B0", "grads": "#55A868", "optimizer": "#C44E52", "activations": "#8172B2",
              "temporaries": "#CCB974", "buffers": "#64B5CD", "overhead": "#8C8C8C"}
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(max(8, 0.9 * len(cands) + 6), 5.5),
                                  gridspec_kw={"width_ratios": [3, 1.4]})
    xs = range(len(cands))
    bottom = [0.0] * len(cands)
    for cat in CATEGORIES:
        vals = [(getattr(c.memory, cat) or 0) / gib for c in cands]
        ax.bar(xs, vals, bottom=bottom, color=colors[cat], label=cat)
        bottom = [b + v for b, v in zip(bottom, vals)]
    cap = p.cluster.capacity_bytes / gib
    ax.axhline(cap, color="black", linestyle="--", linewidth=1)
    ax.text(-0.4, cap, f"capacity {cap:.0f} GiB", va="bottom", ha="left", fontsize=8)
    ax.set_xticks(list(xs), [f"{c.label}\nx{c.shard_size}" for c in cands], rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("GiB per GPU")
    ax.set_title(f"{p.model.name} on {p.cluster.nodes}x{p.cluster.gpus_per_node} {p.cluster.gpu.name} "
                 f"(seq {p.spec.seq_len}, mb {p.spec.micro_batch}, {p.method})", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    tput = [c.cost.tokens_per_s_per_gpu if c.cost and c.fits else 0 for c in cands]
    ax2.barh([c.label for c in cands], tput,
             color=["#DDDDDD" if not c.fits else "#CCB974" if c.tight else "#55A868" for c in cands])
    ax2.invert_yaxis()
    ax2.set_xlabel("predicted tokens/s per GPU (fitting only; tight in yellow)")
    ax2.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
