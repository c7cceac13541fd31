"""One rank of one torchft replica group, for tests/runtime/test_ft.py.

    python tests/scripts/ft_replica.py OUT_DIR STEPS [STRATEGY]

with torchrun's variables for this group (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and torchft's
(TORCHFT_LIGHTHOUSE, REPLICA_GROUP_ID, NUM_REPLICA_GROUPS). Trains a tiny decoder under
auto_wrap(strategy=STRATEGY (default fsdp), fault_tolerant=True), one line per committed step in
OUT_DIR/g{group}r{rank}.{pid}.jsonl (step, loss, the groups in the step's quorum), until STEPS are
done and TOGETHER steps in a row had every group of the job in their quorum (a killed group rejoined and
trained with the others); then its
shards of the parameters in OUT_DIR/g{group}r{rank}.final.pt.
"""
import json
import os
import sys
import time

import torch

from hybrid import auto_wrap
from hybrid.model.decoder import build_decoder
from hybrid.model.presets import DecoderConfig
from hybrid.runtime.mesh import shutdown

TINY = DecoderConfig("llama", 512, 64, 2, 4, 176, 64, kv_heads=2, tied=True)
PAUSE_S = 0.2          # per step: the healthy group keeps stepping while the killed one restarts
DEADLINE_S = 120.0     # no rejoin by then: stop and say so
TOGETHER = 3           # steps in a row with every group in the quorum before stopping


def main(out: str, steps: int, strategy: str = "fsdp") -> None:
    torch.set_num_threads(1)
    group, rank = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["RANK"])
    groups = int(os.environ["NUM_REPLICA_GROUPS"])
    w = auto_wrap(build_decoder(TINY, seed=group), optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-3),
                  strategy=strategy, precision="fp32", micro_batch=1, seq_len=16, verbose=False, fault_tolerant=True)
    log = open(os.path.join(out, f"g{group}r{rank}.{os.getpid()}.jsonl"), "a", encoding="utf-8")
    start, together = time.monotonic(), 0
    while True:
        before = w.step_count
        g = torch.Generator().manual_seed(1000 * before + 10 * group + w.dp_rank)   # each group its own data
        ids = torch.randint(0, TINY.vocab, (1, 16), generator=g)
        loss = w.train_step(ids)
        full = w.ft.participants
        if w.step_count > before:                      # committed (else retried after a failed all-reduce)
            log.write(json.dumps({"step": w.step_count, "loss": loss, "groups": full}) + "\n")
            log.flush()
            together = together + 1 if full == groups else 0
            if w.step_count >= steps and together >= TOGETHER:
                break
        if time.monotonic() - start > DEADLINE_S:
            raise SystemExit(f"group {group}: no step with all {groups} groups within {DEADLINE_S:g} s")
        time.sleep(PAUSE_S)
    state = {k: getattr(v, "to_local", lambda: v)().clone() for k, v in w.module.state_dict().items()}
    torch.save({"step": w.step_count, "state": state}, os.path.join(out, f"g{group}r{rank}.final.pt"))
    w.ft.shutdown()
    shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:4])
