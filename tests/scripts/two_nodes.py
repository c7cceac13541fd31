"""Launched by two `torchrun --nnodes 2 --nproc-per-node 2` on localhost (tests/runtime/test_mesh.py):
checks from inside each rank that hsdp's shard group is node-local, then trains one step."""
import json
import os
import sys

import torch
import torch.distributed as dist

from hybrid import auto_wrap
from hybrid.runtime.mesh import shard_group_ranks, shutdown
from hybrid.model.decoder import build_decoder

out_dir = sys.argv[1]
w = auto_wrap(build_decoder("tiny-llama"), strategy="hsdp", precision="fp32", micro_batch=2, seq_len=16,
              verbose=False)
node = int(os.environ["GROUP_RANK"])
shard_group = w.mesh["dp_shard"].get_group()
nodes_in_group = [None] * dist.get_world_size(shard_group)
dist.all_gather_object(nodes_in_group, node, group=shard_group)
ids = torch.randint(0, 512, (2, 16))
loss = w(ids, labels=ids).loss
w.backward(loss)
w.step()
with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump({"node": node, "shard_ranks": shard_group_ranks(w.mesh), "nodes_in_group": nodes_in_group,
               "mesh": list(w.mesh.shape), "loss": loss.item()}, f)
shutdown()
