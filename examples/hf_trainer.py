"""Plan with hybrid, hand the plan to the HF Trainer, train. Launch with torchrun (from the repo
root, after ./setup.sh):

    .venv/bin/torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --steps 2

What it does, as a Trainer user would by hand:
  1. writes a tiny Llama config.json (no weights can be downloaded; any config.json works here),
  2. plans the job for this machine's ranks (`hybrid plan CONFIG --strategy zero2 --emit deepspeed
     --for trainer`, here through the Python API) and writes the emitted ds.json,
  3. trains a transformers LlamaForCausalLM with `Trainer` under that ds.json, with default
     TrainingArguments plus what the plan says (batch size, accumulation, bf16, checkpointing).

On CPU ranks DeepSpeed runs over gloo, in fp32 (the plan's precision on CPU).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from hybrid.config.cluster import detect  # noqa: E402
from hybrid.handoff.emit import emit  # noqa: E402
from hybrid.runtime.mesh import shutdown  # noqa: E402
from hybrid.planning.planner import plan  # noqa: E402
from hybrid.model.sources import resolve_model
from hybrid.config.spec import TrainSpec  # noqa: E402

TINY_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 128, "tie_word_embeddings": False}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps (TrainingArguments.max_steps)")
    ap.add_argument("--strategy", default="zero2", help="a DeepSpeed catalogue strategy (zero1, zero2, zero3)")
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--gradient-accumulation", type=int, default=1)
    ap.add_argument("--out", default="hf_trainer_out", help="folder for config.json, ds.json and the run")
    return ap.parse_args(argv)


class Tokens(torch.utils.data.Dataset):
    """A fixed random token stream cut into sequences; labels are the inputs (causal LM)."""

    def __init__(self, n: int, seq_len: int, vocab: int):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def plan_and_emit(args) -> tuple[dict, object]:
    """The DeepSpeed config (Trainer form) of the plan for this machine's ranks, and the candidate."""
    os.makedirs(args.out, exist_ok=True)
    ours = {"config.json", "ds.json"}
    foreign = [f for f in os.listdir(args.out) if f not in ours and not f.startswith("config.json.")]
    if foreign:                             # every rank sees the same folder and stops alike
        sys.exit(f"hf_trainer: --out {args.out} holds files this example did not write ({', '.join(sorted(foreign))}); "
                 "give an empty or new folder")
    config_path = os.path.join(args.out, "config.json")
    tmp = f"{config_path}.{os.environ.get('RANK', '0')}.tmp"      # every rank writes the same bytes
    with open(tmp, "w") as f:
        json.dump(TINY_LLAMA, f)
    os.replace(tmp, config_path)
    profile = resolve_model(config_path).profile
    spec = TrainSpec(micro_batch=args.micro_batch, seq_len=args.seq_len,
                     precision="bf16-mixed" if torch.cuda.is_available() else "fp32",
                     gradient_accumulation=args.gradient_accumulation)
    p = plan(profile, spec, detect(), strategies=[args.strategy], tp=1)
    text, c = emit("deepspeed", p, profile, args.strategy, target="trainer")
    cfg = json.loads(text)
    cfg.pop("_hybrid")                      # provenance for people; DeepSpeed ignores it anyway
    with open(os.path.join(args.out, "ds.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return cfg, c


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    cfg, c = plan_and_emit(args)
    spec = c.spec
    # transformers 5 renamed gradient_checkpointing (the old name warns)
    ckpt = ("activation_checkpointing" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
            else "gradient_checkpointing")
    targs = TrainingArguments(
        output_dir=args.out, deepspeed=cfg, max_steps=args.steps,
        per_device_train_batch_size=spec.micro_batch, gradient_accumulation_steps=spec.gradient_accumulation,
        bf16=spec.precision == "bf16-mixed", fp16=spec.precision == "fp16-mixed",
        **{ckpt: spec.activation_checkpointing != "none"},
        use_cpu=not torch.cuda.is_available(), ddp_backend=None if torch.cuda.is_available() else "gloo",
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, seed=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "architectures"}))
    data = Tokens(args.micro_batch * args.gradient_accumulation * targs.world_size * args.steps,
                  args.seq_len, TINY_LLAMA["vocab_size"])
    trainer = Trainer(model=model, args=targs, train_dataset=data)
    result = trainer.train()
    if trainer.is_world_process_zero():
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        ds = trainer.accelerator.state.deepspeed_plugin
        print(f"hf_trainer: {c.label} ({c.parallel.describe()}) under the emitted ds.json "
              f"(Trainer's DeepSpeed ZeRO stage {ds.zero_stage if ds else 'off'}); "
              f"{trainer.state.global_step} steps, losses {', '.join(f'{x:.4f}' for x in losses)}; "
              f"train_loss {result.training_loss:.4f}")
    shutdown()                  # every rank leaves together (the Trainer leaves its process group up)
    return 0


if __name__ == "__main__":
    sys.exit(main())
