"""Hand-off: torchtitan TOML, the HF Trainer's DeepSpeed form, job files (pure: no process group)."""
import json

import pytest
import yaml

from hybrid.cli import main

tomllib = pytest.importorskip("tomllib")        # Python 3.11+


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == 0, err
    return out, err


@pytest.mark.parametrize("argv,world", [(("llama2-7b", "--nodes", "8"), 64),
                                        (("llama3-70b", "--nodes", "8", "--seq-len", "8192"), 64),
                                        (("gpt2", "--nodes", "1", "--gpus-per-node", "4"), 4)])
def test_torchtitan_toml_parses_and_degrees_multiply_to_the_world(capsys, argv, world):
    out, _ = _run(capsys, "plan", *argv, "--emit", "torchtitan")
    doc = tomllib.loads(out)
    par = doc["parallelism"]
    product = (par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"]
               * par["tensor_parallel_degree"] * par["pipeline_parallel_degree"])
    assert product == world
    assert doc["activation_checkpoint"]["mode"] in ("none", "selective", "full")
    assert doc["training"]["seq_len"] > 0 and doc["training"]["local_batch_size"] == 1


def test_deepspeed_for_the_trainer_leaves_its_values_auto(capsys):
    # the plan chooses tensor parallelism here, which DeepSpeed does not run: zero3 is emitted
    out, err = _run(capsys, "plan", "llama3-70b", "--nodes", "8", "--seq-len", "8192", "--emit", "deepspeed",
                    "--for", "trainer")
    cfg = json.loads(out)
    for key in ("train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps",
                "gradient_clipping"):
        assert cfg[key] == "auto", key
    assert cfg["bf16"]["enabled"] == "auto"
    assert cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    assert "TrainingArguments(deepspeed=" in err and "bf16=True" in err
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in err    # the plan's allocator, said
    assert "the plan's choice is fsdp+tp4" in err                  # says why it differs from the choice
    engine = json.loads(_run(capsys, "plan", "llama2-7b", "--nodes", "8", "--emit", "deepspeed")[0])
    assert engine["train_batch_size"] == 64 and engine["gradient_clipping"] == 0.0


def test_job_file_round_trip_and_flags_override(capsys, tmp_path):
    job, saved = tmp_path / "job.yaml", tmp_path / "saved.yaml"
    job.write_text("model: llama3-70b\nnodes: 8\nseq-len: 8192\nactivation_checkpointing: selective\n")
    first, _ = _run(capsys, "plan", "--config", str(job), "--save-config", str(saved), "--json")
    second, _ = _run(capsys, "plan", "--config", str(saved), "--json")
    assert first == second and yaml.safe_load(saved.read_text())["seq_len"] == 8192
    over = json.loads(_run(capsys, "plan", "--config", str(job), "--nodes", "2", "--json")[0])
    assert over["nodes"] == 2 and over["spec"]["seq_len"] == 8192


def test_job_file_errors_name_the_key_and_line(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: gpt2\nnodez: 2\n")
    assert main(["plan", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:2: unknown key 'nodez'" in err and "Allowed: model" in err
    bad.write_text("model: gpt2\nnodes: many\n")
    assert main(["plan", "--config", str(bad)]) == 2
    assert "nodes must be a number, got 'many'" in capsys.readouterr().err


@pytest.mark.gloo
@pytest.mark.parametrize("strategy,expect", [
    ("hsdp", {"kind": "fsdp", "fsdp_version": 2, "layer": ["LlamaDecoderLayer"], "reshard": True,
              "dp_replicate": 2, "dp_shard": 2, "tp": 1, "mixed_precision": "bf16"}),
    ("zero3", {"kind": "deepspeed", "stage": 3, "offload": "none", "mixed_precision": "bf16"})])
def test_accelerate_launch_accepts_the_emitted_config(capsys, tmp_path, strategy, expect):
    pytest.importorskip("accelerate")
    import os
    import subprocess
    import sys
    cfg = tmp_path / "accelerate.yaml"
    _, err = _run(capsys, "plan", "llama2-7b", "--nodes", "2", "--gpus-per-node", "2", "--strategy", strategy,
                  "--emit", "accelerate", "-o", str(cfg))
    doc = yaml.safe_load(cfg.read_text())
    assert doc["num_processes"] == 4 and doc["num_machines"] == 2
    # one machine here: launch the four ranks locally with the emitted file otherwise unchanged
    cfg.write_text(cfg.read_text().replace("num_machines: 2", "num_machines: 1"))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(cfg),
                        "--main_process_port", "0", os.path.join(root, "tests", "scripts", "accelerate_probe.py"),
                        str(tmp_path)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    for rank in range(4):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["world_size"] == 4 and {k: seen[k] for k in expect} == expect


def test_accelerate_refuses_what_it_cannot_express(capsys):
    assert main(["plan", "llama2-7b", "--nodes", "2", "--strategy", "zero3-hpz", "--emit", "accelerate"]) == 2
    assert "--emit deepspeed --for trainer" in capsys.readouterr().err


@pytest.mark.gloo
def test_auto_wrap_takes_the_job_file_and_arguments_win(tmp_path, caplog):
    import logging
    caplog.set_level(logging.INFO, logger="hybrid")
    from hybrid import auto_wrap
    from hybrid.mesh import shutdown
    from hybrid.models import build_decoder
    from tests.test_backends import TINY
    job = tmp_path / "job.yaml"
    job.write_text("model: llama2-7b\nmicro_batch: 2\nseq_len: 16\nstrategy: ddp\nactivation_checkpointing: full\n"
                   "precision: fp32\n")
    try:
        w = auto_wrap(build_decoder(TINY, seed=0), config=str(job), micro_batch=3, verbose=False)
        spec = w.chosen.spec
        assert (w.chosen.name, spec.seq_len, spec.activation_checkpointing, spec.micro_batch) == ("ddp", 16, "full", 3)
        assert "model describe what `hybrid plan` estimates" in caplog.text
    finally:
        shutdown()
    bad = tmp_path / "bad.yaml"
    bad.write_text("seq_len: 16\nmicro_bacth: 2\n")
    with pytest.raises(Exception, match=r"bad.yaml:2: unknown key 'micro_bacth'"):
        auto_wrap(build_decoder(TINY, seed=0), config=str(bad))


def test_torchtitan_toml_carries_the_pipeline(capsys):
    out, _ = _run(capsys, "plan", "llama3.1-405b", "--nodes", "16", "--seq-len", "8192", "--gradient-accumulation",
                  "32", "--strategy", "fsdp-grad-op", "--emit", "torchtitan")
    par = tomllib.loads(out)["parallelism"]
    assert (par["pipeline_parallel_degree"], par["tensor_parallel_degree"]) == (16, 8)
    assert par["pipeline_parallel_schedule"] == "Interleaved1F1B"
    assert tomllib.loads(out)["training"]["local_batch_size"] == 32
