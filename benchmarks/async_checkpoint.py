"""How long a checkpoint save blocks the training loop, synchronous vs async (w.save(async_=True)),
for a ~100M-parameter decoder with AdamW on 2 CPU ranks (gloo, FSDP), in one run.

    .venv/bin/python benchmarks/async_checkpoint.py   # writes benchmarks/results/async_checkpoint.md

Blocking time is the wall time of the save() call on the training thread (the slower rank): for a
synchronous save, the whole write and commit; for an async save, DCP's staging copy into host
memory (and the agreement that every rank staged). The async save's write and commit then run in
the background while training steps go on; the table gives the time until it was committed too.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

OUT = Path(__file__).parent / "results" / "async_checkpoint.md"
SEQ, REPEATS = 64, 2


def bench(path: str) -> dict:
    import torch
    import torch.distributed as dist

    from hybrid import auto_wrap
    from hybrid.model.decoder import build_decoder
    from hybrid.model.presets import DecoderConfig
    cfg = DecoderConfig("llama", 32000, 768, 10, 12, 2048, SEQ, kv_heads=12, tied=True)
    w = auto_wrap(build_decoder(cfg, seed=0), optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4), strategy="fsdp",
                  precision="fp32", micro_batch=1, seq_len=SEQ, activation_checkpointing="none", verbose=False)
    params = sum(p.numel() for p in w.state_dict().values())
    ids = torch.randint(0, cfg.vocab, (1, SEQ), generator=torch.Generator().manual_seed(dist.get_rank()))

    def step():
        w.backward(w(ids, labels=ids).loss)
        w.step()
        w.zero_grad()
    step()                                   # optimizer state exists from here on
    out = {"params": params, "sync": [], "async": [], "commit": [], "steps_meanwhile": []}
    for _ in range(REPEATS):
        dist.barrier()
        t = time.perf_counter()
        w.save(path)
        out["sync"].append(time.perf_counter() - t)
        step()
    for _ in range(REPEATS):
        dist.barrier()
        t = time.perf_counter()
        w.save(path, async_=True)
        out["async"].append(time.perf_counter() - t)
        n = 0
        while w._saver.future is not None and not w._saver.future.done():   # train while it writes
            step()
            n += 1
        w.wait_for_checkpoint()
        out["commit"].append(time.perf_counter() - t)
        out["steps_meanwhile"].append(n)
    w.close()
    out["bytes"] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
    return out


def main() -> None:
    from hybrid.runtime.launch import run_ranks
    os.environ.setdefault("HYBRID_TIMEOUT", "600")     # a synchronous save's collectives wait for the slower writer
    tmp = tempfile.mkdtemp(prefix="hybrid-async-ckpt-")
    try:
        results = run_ranks(2, bench, os.path.join(tmp, "ck"), timeout_s=3000)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    def worst(key, i):
        return max(r[key][i] for r in results)
    r0 = results[0]
    rows = ["# Async checkpoints: how long save() blocks the loop", "",
            "`.venv/bin/python benchmarks/async_checkpoint.py`: a llama-style decoder of "
            f"{r0['params'] / 1e6:.0f}M parameters (hidden 768, 10 layers, vocab 32000, tied), AdamW, fp32, FSDP on "
            f"2 CPU ranks (gloo); a checkpoint of {r0['bytes'] / 2**30:.2f} GiB (model and optimizer state) written "
            f"to {tempfile.gettempdir()}. Blocking: the save() call on the training thread, the slower rank; "
            "committed: until the async version's meta.json was replaced (training steps ran meanwhile).", "",
            "| save | sync blocks s | async blocks s | ratio | async committed after s | steps trained meanwhile |",
            "|---|---|---|---|---|---|"]
    for i in range(REPEATS):
        s, a = worst("sync", i), worst("async", i)
        rows.append(f"| {i + 1} | {s:.2f} | {a:.2f} | {a / s:.1%} | {worst('commit', i):.2f} | "
                    f"{min(r['steps_meanwhile'][i] for r in results)} |")
    rows += ["", "The first async save also creates the gloo group the background saves use and allocates the "
             "staging buffers (DCP's DefaultStager), which later saves reuse."]
    OUT.write_text("\n".join(rows) + "\n")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
