"""`hybrid estimate | plan | compare | measure | tune | demo | export`: parse, call, print.
Bad input exits 2 with one line that names the value and the fix."""
from __future__ import annotations

import argparse
import json
import sys

from ..errors import HybridError


def _common(p: argparse.ArgumentParser, search: bool = False) -> None:
    """The job's options (hybrid/config/options.py) as flags, in their --help groups; `search`: the
    command searches what is not given (plan, tune), which the help says."""
    from ..config.options import OPTIONS

    groups = {"": p}
    for o in OPTIONS.values():
        if o.flag_per_command:
            continue
        if o.group not in groups:
            groups[o.group] = p.add_argument_group(o.group)
        kw: dict = {"help": o.help_text(search)}
        if o.positional:
            kw["nargs"] = "?"
        elif o.kind == "bool":
            kw["action"] = "store_true"
        elif o.kind == "list":
            kw.update(action="append", default=list(o.default))
        else:
            kw["default"] = o.default if o.fill else None
            if o.kind in ("int", "float"):
                kw["type"] = int if o.kind == "int" else float
            elif o.kind == "onoff":
                kw["choices"] = ("on", "off")
            elif o.listed:
                kw["choices"] = o.choices
        groups[o.group].add_argument(o.flag, **kw)


def _job(args):
    from ..config.spec import check_precision, default_precision
    from ..config.options import lora_of_options, or_default
    from ..config.jobfile import cluster_of
    from ..model.sources import resolve_model
    from ..config.spec import TrainSpec, default_seq_len

    src = resolve_model(args.model, args.params)
    if (args.method == "measured" and not _cuda()) or args.gpu == "cpu":
        # measured on CPU ranks (or --gpu cpu): this machine's CPU, 2 ranks unless told, no CUDA context
        from ..config.cluster import cpu_spec
        per_node = args.gpus_per_node or 2
        cluster = cluster_of(vars(args), gpus_per_node=per_node, gpu=cpu_spec(args.nodes * per_node))
    else:
        cluster = cluster_of(vars(args))
    seq = args.seq_len if args.seq_len is not None else default_seq_len(src.profile.max_positions)
    precision = args.precision or default_precision(cluster)
    check_precision(precision, cluster)
    from ..planning.batch import global_batch_of
    gb = global_batch_of(args.global_batch, args.global_batch_tokens, seq, args.gradient_accumulation)
    spec = TrainSpec(micro_batch=or_default("micro_batch", args.micro_batch), seq_len=seq, precision=precision,
                     gradient_accumulation=or_default("gradient_accumulation", args.gradient_accumulation),
                     global_batch=gb, compile=bool(args.compile), float8=bool(args.float8),
                     float8_recipe=or_default("float8_recipe", args.float8_recipe), optimizer=args.optimizer,
                     fault_tolerant=bool(args.fault_tolerant),
                     activation_checkpointing=or_default("activation_checkpointing", args.activation_checkpointing),
                     attention=args.attention, loss=args.loss,
                     moe_imbalance=or_default("moe_imbalance", args.moe_imbalance),
                     lora=lora_of_options(vars(args)))
    from ..estimation.float8 import check_float8
    check_float8(spec, cluster)
    if spec.lora is not None and args.method != "analytic":
        raise HybridError(f"--method {args.method} runs the model without adapters; --lora-rank is estimated by "
                          "--method analytic (docs/finetuning.md), or pass a PEFT model to hybrid.plan")
    if args.compile and args.method == "traced":
        from ..measure.traced import UNTRACED          # the trace's own refusal, before anything runs
        raise HybridError(UNTRACED["compile"])
    return src, cluster, spec


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _estimator(args, src, cluster):
    """None for analytic; else the traced or measured estimate of each layout, with progress."""
    if args.method == "analytic":
        return None
    if args.implementation == "transformers":
        try:
            import transformers  # noqa: F401
        except ImportError:
            raise HybridError("--implementation transformers needs transformers: pip install 'hybrid[hf]'") from None
    from ..measure.method import RunEstimator
    return RunEstimator(args.method, src, cluster, args.implementation != "hybrid", args.strategies_dir,
                        Progress("tracing" if args.method == "traced" else "measuring"))


class Progress:
    """One stderr line per candidate with a bar of how many are done: `hybrid: [####------] 4/10
    tracing fsdp (shard 64) ... 1.2s`, begun when the candidate starts and ended when it is done."""

    WIDTH = 20

    def __init__(self, verb: str):
        self.verb, self.total, self.done = verb, 0, 0

    def expect(self, total: int) -> None:
        self.total, self.done = total, 0

    def begin(self, what: str) -> None:
        self.done += 1
        total = max(self.total, self.done)
        filled = self.WIDTH * self.done // total
        print(f"hybrid: [{'#' * filled}{'-' * (self.WIDTH - filled)}] {self.done}/{total} {self.verb} {what} ...",
              end="", file=sys.stderr, flush=True)

    def end(self, result: str) -> None:
        print(f" {result}", file=sys.stderr, flush=True)


def _plan(args, strategies=None, search=False):
    """search: let the planner try every shard size and checkpointing setting (plan); else one
    candidate per strategy at its default shard size and the given checkpointing."""
    from ..families.catalogue import get_strategy, load_catalogue
    from ..planning.planner import plan

    src, cluster, spec = _job(args)
    cat = load_catalogue(args.strategies_dir)
    for name in strategies or ():
        get_strategy(name, cat)
    # unpinned: plan searches (None), estimate and compare run 1; memory methods that run the job
    # run the degrees layout.METHOD_REACH says
    tp, pp, cp, ep = ((None if search else 1) if v is None else v for v in (args.tp, args.pp, args.cp, args.ep))
    from ..planning.reach import method_degrees
    method_degrees(args.method, {"tp": tp, "pp": pp, "cp": cp, "ep": ep})     # a degree it cannot run: first
    from ..estimation.calibration import resolve
    return plan(src.profile, spec, cluster, cat, args.shard_size, strategies=strategies, tp=tp, pp=pp, ep=ep,
                schedule=args.schedule, calibration=resolve(args.calibration), cp=cp,
                micro_batch=args.micro_batch if spec.global_batch is not None or search else None,
                hold_batch=search,
                estimator=_estimator(args, src, cluster), method=args.method,
                search_checkpointing=search and args.activation_checkpointing is None and args.method == "analytic",
                efficiency=args.efficiency, search_shards=search,
                reliability=_reliability(args)), src


def _reliability(args):
    """The goodput figures of --mtbf-gpu-hours, --storage-bandwidth and --async-checkpoint."""
    from ..planning.goodput import Reliability, parse_bandwidth
    given = {"mtbf_gpu_hours": args.mtbf_gpu_hours, "async_checkpoint": bool(args.async_checkpoint),
             "storage_bandwidth": None if args.storage_bandwidth is None else parse_bandwidth(args.storage_bandwidth)}
    return Reliability(**{k: v for k, v in given.items() if v is not None})


def cmd_estimate(args) -> int:
    from ..planning.report import format_estimate

    p, _ = _plan(args, [args.strategy])
    print(json.dumps(p.to_dict(), indent=2) if args.json else format_estimate(p))
    return 0


def cmd_plan(args) -> int:
    from ..planning.report import format_plan

    _writable_file(args.output, "--output")
    if args.top < 1:
        raise HybridError(f"--top must be a positive number of rows, got {args.top}; --all shows every candidate")
    p, src = _plan(args, args.strategy and [args.strategy], search=True)
    if args.emit:
        from ..handoff.emit import emit, emit_notes
        text, c = emit(args.emit, p, src.profile, args.strategy, getattr(args, "emit_for", "engine"))
        if p.chosen is not None and c is not p.chosen:
            print(f"hybrid: emitted {c.label} ({c.parallel.describe()}), the fastest {args.emit} layout that fits; "
                  f"the plan's choice is {p.chosen.label}, which {args.emit} does not run", file=sys.stderr)
        for line in emit_notes(args.emit, c, getattr(args, "emit_for", "engine"), p.cluster):
            print(line, file=sys.stderr)
        if p.cluster.expandable_segments and args.emit != "torchtitan":    # the torchtitan command sets it
            from ..handoff.base import alloc_conf_var
            print(f"hybrid: the plan assumes {alloc_conf_var(p.cluster)}=expandable_segments:True (as auto_wrap sets "
                  "it): export it where this job runs, or plan with --expandable-segments off", file=sys.stderr)
        if args.output:
            try:
                with open(args.output, "w") as f:
                    f.write(text)
            except OSError as e:
                raise HybridError(f"cannot write --output {args.output!r}: {e.strerror or e}") from None
            print(f"hybrid: wrote {args.emit} settings to {args.output}", file=sys.stderr)
        else:
            print(text)
        return 0
    print(json.dumps(p.to_dict(), indent=2) if args.json else format_plan(p, top=None if args.all_rows else args.top))
    return 0


def cmd_compare(args) -> int:
    from ..planning.report import format_compare, plot_compare

    names = [s.strip() for s in args.strategies.split(",")] if args.strategies else None
    _writable_file(args.plot, "--plot")
    p, _ = _plan(args, names)
    print(json.dumps(p.to_dict(), indent=2) if args.json else format_compare(p))
    if args.plot:
        plot_compare(p, args.plot)
        print(f"hybrid: wrote {args.plot}", file=sys.stderr)
    return 0


def cmd_tune(args) -> int:
    """Plan, then measure the best layouts here: in this process under torchrun, else on
    nodes x gpus-per-node ranks spawned on this machine."""
    import os

    from ..estimation.calibration import resolve
    if args.method != "analytic":
        raise HybridError(f"tune plans analytically and then measures; --method {args.method} does not apply")
    for flag, v, low in (("--top", args.top, 1), ("--steps", args.steps, 1), ("--warmup", args.warmup, 1)):
        if not low <= v <= 10**4:
            raise HybridError(f"{flag} must be between {low} and 10000, got {v}")
    from ..planning.reach import method_degrees
    method_degrees("tune", {"tp": args.tp, "pp": args.pp, "cp": args.cp, "ep": args.ep})
    _writable_file(args.save_calibration, "--save-calibration")
    resolve(args.calibration)                           # a bad file fails here, before any rank starts
    cuda = _cuda()
    args.method = "measured"                            # _job: this machine's CPU as the 'GPU' off CUDA
    opts = {k: v for k, v in vars(args).items() if k != "func"}
    src, _, spec = _job(args)
    opts.update(spec=spec, progress=Progress("measuring"))
    if "WORLD_SIZE" in os.environ:                      # under torchrun: this process is one rank
        from .tune_ranks import run_cli
        out = run_cli(opts)
        from ..runtime.mesh import shutdown
        shutdown()
    else:
        import torch

        from ..runtime.launch import run_ranks
        from .tune_ranks import run_cli
        if src.build is None or src.ref is None:
            raise HybridError(f"{src.profile.name} is a bare parameter count: tune needs a model to run")
        per_node = args.gpus_per_node or (torch.cuda.device_count() if cuda else 2)
        world = args.nodes * per_node
        local = torch.cuda.device_count() if cuda else 8
        if world > local:
            raise HybridError(f"tune runs {world} ranks on this machine without torchrun, which has {local}; "
                              "launch it with torchrun on the cluster, or use fewer --nodes/--gpus-per-node")
        opts["gpus_per_node"] = per_node
        from ..config.cluster import detect
        from .tune_ranks import tune_plan
        tune_plan(opts, detect(args.gpu_memory, world, per_node))    # what no rank could run: refused before any runs
        out = run_ranks(world, run_cli, opts, local_world=per_node, quiet=True, timeout_s=6 * 3600)[0]
    if out is not None:
        text, data = out
        print(json.dumps(data, indent=2) if args.json else text)
        if args.save_calibration and data["calibration"] is not None:
            print(f"hybrid: wrote {args.save_calibration}", file=sys.stderr)
    return 0


def cmd_demo(args) -> int:
    from .demo import run
    if args.steps < 4:
        raise HybridError(f"--steps must be at least 4 (2 are measured, the rest train), got {args.steps}")
    if args.nproc < 2 or args.nproc % 2:
        raise HybridError(f"--nproc must be even and at least 2 (two simulated nodes), got {args.nproc}")
    return run(args.steps, train=not args.no_train, nproc=args.nproc)


def cmd_export(args) -> int:
    from ..ckpt.export import export

    files = export(args.checkpoint, args.out, args.dtype, args.max_shard_size, overwrite=args.overwrite)
    print(f"hybrid: wrote {len(files)} files to {args.out}: {', '.join(files)}")
    return 0


TOP_ROWS = 12
"""`hybrid plan` table rows by default: the best 12, plus the best of each family and the choice."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad input as one line (no usage block) and exit code 2."""

    def error(self, message: str):
        raise HybridError(f"{message} (see `{self.prog} --help`)")


def _join_negative_values(argv: list[str]) -> list[str]:
    """`--gpu-memory -5GB` reaches the value check (which names the rule) instead of argparse
    taking '-5GB' for an unknown option."""
    out: list[str] = []
    for tok in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and len(tok) > 1 and tok[0] == "-" \
                and (tok[1].isdigit() or tok[1] == "."):
            out[-1] = f"{out[-1]}={tok}"
        else:
            out.append(tok)
    return out


def _writable_file(path: str | None, flag: str) -> None:
    """Check an output file's directory before any work is done (and before anything is printed)."""
    import os
    if path is None:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise HybridError(f"{flag} {path!r} is a directory; give a file name")
    if not os.path.isdir(parent):
        raise HybridError(f"{flag} {path!r}: directory {parent!r} does not exist")
    if not os.access(parent, os.W_OK):
        raise HybridError(f"{flag} {path!r}: directory {parent!r} is not writable")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hybrid", description="Choose and apply a data-parallel "
                     "strategy from an honest per-GPU memory estimate.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    e = sub.add_parser("estimate", help="memory breakdown of one strategy")
    _common(e)
    e.add_argument("--strategy", required=True, help="catalogue name (see `hybrid plan`)")
    e.set_defaults(func=cmd_estimate)
    p = sub.add_parser("plan", help="every candidate ranked by predicted speed, and the choice")
    _common(p, search=True)
    p.add_argument("--strategy", help="only this catalogue strategy (its shard sizes and checkpointing)")
    from ..families import FAMILIES
    kinds = sorted(f.emits for f in FAMILIES.values() if f.emits)        # the families' own configs
    p.add_argument("--emit", choices=(*kinds, "torchtitan", "accelerate"),
                   help="write the chosen (or --strategy) DeepSpeed JSON config / FSDP2 YAML settings / "
                        "torchtitan 0.3 torchrun command line / Accelerate config YAML")
    p.add_argument("--for", dest="emit_for", choices=("engine", "trainer"), default="engine",
                   help="--emit deepspeed: concrete values for deepspeed.initialize (engine, default) or the "
                        "HF Trainer's \"auto\" form (trainer)")
    p.add_argument("--output", "-o", help="file for --emit (default: stdout)")
    p.add_argument("--top", type=int, default=TOP_ROWS, metavar="N",
                   help=f"rows of the table: the best N candidates, the best of each family and the choice "
                        f"(default {TOP_ROWS}; --json keeps every candidate)")
    p.add_argument("--all", dest="all_rows", action="store_true", help="every candidate in the table")
    p.set_defaults(func=cmd_plan)
    c = sub.add_parser("compare", help="memory by category for each strategy side by side, and a plot")
    _common(c)
    c.add_argument("--strategies", help="comma-separated catalogue names (default: all)")
    c.add_argument("--plot", help="write stacked memory bars and throughput to this PNG")
    c.set_defaults(func=cmd_compare)
    m = sub.add_parser("measure", help="run real steps of one strategy on this machine's ranks and "
                       "report the measured peak (estimate --method measured)")
    _common(m)
    m.add_argument("--strategy", required=True, help="catalogue name")
    m.set_defaults(func=cmd_estimate, method_override="measured")
    t = sub.add_parser("tune", help="plan, then run the best layouts for a few steps here (torchrun, or CPU "
                       "ranks) and choose the measured fastest; fit a calibration")
    _common(t, search=True)
    t.add_argument("--top", type=int, default=3, help="layouts to measure: the K predicted fastest (one per "
                   "strategy), plus the plan's choice (default 3)")
    t.add_argument("--steps", type=int, default=5, help="timed steps per layout (default 5)")
    t.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2; memory is read here)")
    t.add_argument("--strategies", help="comma-separated catalogue names to choose among (default: all)")
    t.add_argument("--save-calibration", help="write the fitted calibration to this YAML file")
    t.set_defaults(func=cmd_tune)
    d = sub.add_parser("demo", help="plan Llama-2-7B, then train a small GPT on 4 CPU ranks via auto_wrap")
    d.add_argument("--steps", type=int, default=60, help="training steps in part 2 (default 60)")
    d.add_argument("--nproc", type=int, default=4, help="CPU ranks (even; default 4 = 2 nodes x 2)")
    d.add_argument("--no-train", action="store_true", help="only the planning part")
    d.set_defaults(func=cmd_demo)
    x = sub.add_parser("export", help="consolidate a checkpoint into safetensors (offline, CPU)")
    x.add_argument("checkpoint", help="a directory written by Wrapped.save")
    x.add_argument("out", help="output directory (HF layout: *.safetensors, index, config.json)")
    x.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), help="cast on export (default: as saved)")
    x.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    x.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    x.set_defaults(func=cmd_export)
    return parser


def _parse(argv: list[str]):
    """Parse; with --config, the job file's values become the subcommand's defaults and the
    command line is parsed again over them (so flags override the file)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "config", None):
        from ..config.jobfile import load_job
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[args.command]
        from ..config.jobfile import JOB_KEYS
        dests = {a.dest for a in sub._actions}
        sub.set_defaults(**load_job(args.config, tuple(k for k in JOB_KEYS if k in dests), sub.prog,
                                    getattr(args, "allow_code", False)))
        args = parser.parse_args(argv)
    from ..config.jobfile import check_args
    check_args(args)
    if getattr(args, "save_config", None):
        from ..config.jobfile import save_job
        save_job(args.save_config, args)
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parse(_join_negative_values(sys.argv[1:] if argv is None else list(argv)))
        if getattr(args, "method_override", None):
            args.method = args.method_override
        return args.func(args)
    except HybridError as e:
        print(f"hybrid: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:           # Ctrl-C: what was being written is already cleaned up
        print("hybrid: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
