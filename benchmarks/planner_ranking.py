"""Does the cost model rank strategies the way real step times do? Calibrated on this machine.

    .venv/bin/python benchmarks/planner_ranking.py [--steps 12]

On 4 CPU ranks (gloo, two simulated nodes of 2): (1) probe all-reduce / all-gather /
reduce-scatter at a few sizes and fit bandwidth and latency; (2) time the model's forward+backward
on every rank at once with no communication to calibrate compute; (3) time real training steps
of each strategy; (4) predict them with hybrid.estimation.cost.step using the fitted numbers and compare the
rankings (Kendall tau). Writes benchmarks/results/planner_ranking.md.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from hybrid.runtime.launch import run_ranks
from hybrid.model.presets import DecoderConfig

CFG = DecoderConfig("llama", 4096, 384, 4, 6, 1024, 256, kv_heads=6, tied=True)
MB, SEQ, WORLD, PER_NODE = 2, 128, 4, 2
STRATEGIES = ["ddp", "fsdp", "hsdp", "fsdp-grad-op", "zero1", "zero2", "zero3", ("fsdp", "full"), ("ddp", "full")]
OUT = Path(__file__).parent / "results" / "planner_ranking.md"


def _median_time(fn, reps):
    import torch.distributed as dist
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    t = torch.tensor(statistics.median(times))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def probe_and_train(steps):
    import torch.distributed as dist

    from hybrid import auto_wrap
    from hybrid.runtime.mesh import init_distributed
    from hybrid.model.decoder import build_decoder
    from hybrid.model.profile import profile_module
    from hybrid.estimation.cost.step import model_flops_per_token
    init_distributed()
    world = dist.get_world_size()
    # (1) collectives: bytes moved per rank vs seconds
    probes = []
    for numel in (2**18, 2**20, 2**22):
        x = torch.randn(numel)
        out = torch.empty(numel * world)
        shard = torch.empty(numel // world)
        probes.append((2 * (world - 1) / world * 4 * numel, _median_time(lambda: dist.all_reduce(x), 5)))
        probes.append(((world - 1) / world * 4 * numel * world,
                       _median_time(lambda: dist.all_gather_into_tensor(out, x), 5)))
        probes.append(((world - 1) / world * 4 * numel, _median_time(lambda: dist.reduce_scatter_tensor(shard, x), 5)))
    # memory copies (what packing into communication buffers costs here)
    a, b = torch.randn(2**22), torch.empty(2**22)
    copy_bw = 2 * 4 * 2**22 / _median_time(lambda: b.copy_(a), 5)
    # (2) compute alone, every rank at once
    model = build_decoder(CFG, seed=0)
    ids = torch.randint(0, CFG.vocab, (MB, SEQ))

    def compute():
        model(ids, labels=ids).loss.backward()
    compute_s = _median_time(compute, steps)
    flops = model_flops_per_token(profile_module(model), SEQ) * MB * SEQ
    # (3) real steps
    measured = {}
    for item in STRATEGIES:
        name, ckpt = (item, "none") if isinstance(item, str) else item
        w = auto_wrap(build_decoder(CFG, seed=0), strategy=name, precision="fp32", micro_batch=MB, seq_len=SEQ,
                      activation_checkpointing=ckpt, shard_size=PER_NODE if name == "hsdp" else None, verbose=False)

        def step():
            loss = w(ids, labels=ids).loss
            w.backward(loss)
            w.step()
            w.zero_grad()
        step()
        measured[f"{name}" + ("" if ckpt == "none" else f"+ac:{ckpt}")] = (name, ckpt, _median_time(step, steps))
    return probes, copy_bw, compute_s, flops, measured


def fit_link(probes):
    """Least squares t = latency + bytes / bandwidth."""
    n = len(probes)
    mx = sum(b for b, _ in probes) / n
    my = sum(t for _, t in probes) / n
    slope = sum((b - mx) * (t - my) for b, t in probes) / sum((b - mx) ** 2 for b, _ in probes)
    return max(my - slope * mx, 0.0), 1.0 / slope


def kendall_tau(xs, ys):
    n, s = len(xs), 0
    for i in range(n):
        for j in range(i + 1, n):
            s += (1 if (xs[i] - xs[j]) * (ys[i] - ys[j]) > 0 else -1 if (xs[i] - xs[j]) * (ys[i] - ys[j]) < 0 else 0)
    return s / (n * (n - 1) / 2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    start = time.time()
    probes, copy_bw, compute_s, flops, measured = run_ranks(WORLD, probe_and_train, args.steps,
                                                             local_world=PER_NODE)[0]
    latency, bw = fit_link(probes)

    import hybrid.estimation.cost.step as cost
    from hybrid.layout.layout import Layout
    from hybrid.families.catalogue import load_catalogue
    from hybrid.config.cluster import Cluster, GPUSpec
    from hybrid.model.profile import profile_decoder
    from hybrid.config.spec import TrainSpec
    cost.LATENCY_INTRA = cost.LATENCY_INTER = latency / 2   # one fitted start-up cost, log2(4) = 2 steps
    # fp32 runs at half the bf16 peak in the cost model: the measured fp32 rate is that half
    gpu = GPUSpec("cpu-gloo", 8 * 1024**3, 2 * flops / compute_s, bw, bw, cuda_context_bytes=0, is_cuda=False,
                  mem_bw=copy_bw, comm_overlap=0.0)
    cluster = Cluster(nodes=WORLD // PER_NODE, gpus_per_node=PER_NODE, gpu=gpu)
    cat = load_catalogue()
    prof = profile_decoder(CFG, "bench")
    rows = []
    for label, (name, ckpt, seconds) in measured.items():
        s = cat[name]
        n = PER_NODE if name == "hsdp" else s.shard_size(cluster)
        spec = TrainSpec(MB, SEQ, precision="fp32", activation_checkpointing=ckpt)
        pred = cost.step_cost(Layout.of(s, cluster, spec, shard_size=n), prof, spec, cluster, efficiency=1.0).seconds
        rows.append((label, seconds, pred))
    tau = kendall_tau([r[1] for r in rows], [r[2] for r in rows])
    lines = ["# Planner ranking on this machine", "",
             f"`.venv/bin/python benchmarks/planner_ranking.py` ({(time.time() - start) / 60:.1f} min), "
             f"{WORLD} CPU ranks (gloo, 2 simulated nodes), {prof.params:,}-param decoder, fp32, "
             f"micro-batch {MB} x {SEQ}.", "",
             f"Fitted: link {bw / 1e9:.2f} GB/s, latency {latency * 1e3:.2f} ms per collective, memory copies "
             f"{copy_bw / 1e9:.1f} GB/s; compute "
             f"{flops / compute_s / 1e9:.1f} GFLOP/s per rank; comm_overlap 0 (ranks share the cores).", "",
             "| strategy | measured s/step | predicted s/step | measured rank | predicted rank |",
             "|---|---|---|---|---|"]
    by_m = sorted(rows, key=lambda r: r[1])
    by_p = sorted(rows, key=lambda r: r[2])
    for r in by_m:
        lines.append(f"| {r[0]} | {r[1]:.3f} | {r[2]:.3f} | {by_m.index(r) + 1} | {by_p.index(r) + 1} |")
    lines += ["", f"Kendall tau (measured vs predicted order): **{tau:.2f}**"]
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
