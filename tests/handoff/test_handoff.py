"""Hand-off: torchtitan's command line, the HF Trainer's DeepSpeed form, job files (no process group;
torchtitan's and Accelerate's own readers check their files in the torch tier)."""
import json

import pytest
import yaml

from hybrid.cli.main import main



def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == 0, err
    return out, err


def torchtitan_argv(script: str) -> list[str]:
    """The arguments after `-m torchtitan.train` in an emitted script, as the shell would pass them."""
    import shlex
    lines = [line for line in script.splitlines() if not line.startswith("#")]
    words = shlex.split(" ".join(lines).replace("\\ ", " "))
    return words[words.index("torchtitan.train") + 1:]


def torchtitan_config(argv: list[str]):
    """torchtitan's own ConfigManager on the emitted arguments (torchtitan is an optional test
    dependency: its requirements pin datasets/huggingface_hub versions that transformers here
    does not take, so it is not part of setup; install it with --no-deps to run this)."""
    try:
        from torchtitan.config.manager import ConfigManager
    except ImportError as e:
        pytest.skip(f"torchtitan 0.3 is not installed ({e}): pip install --no-deps torchtitan==0.3.0 and its imports")
    return ConfigManager().parse_args(argv)


@pytest.mark.parametrize("argv,world", [(("llama3-8b", "--nodes", "8"), 64),
                                        (("llama3-70b", "--nodes", "4", "--seq-len", "8192",
                                          "--gradient-accumulation", "16", "--strategy", "fsdp", "--pp", "2"), 32)])
@pytest.mark.torch
def test_torchtitan_command_loads_in_torchtitan(capsys, argv, world):
    out, _ = _run(capsys, "plan", *argv, "--emit", "torchtitan")
    assert "-m torchtitan.train" in out and f"--nnodes {world // 8} --nproc-per-node 8" in out
    args = torchtitan_argv(out)
    assert args[-1].startswith("activation-checkpoint:")
    cfg = torchtitan_config(args)
    par = cfg.parallelism
    assert (par.data_parallel_replicate_degree * par.data_parallel_shard_degree * par.tensor_parallel_degree
            * par.pipeline_parallel_degree) == world
    want_seq = int(argv[argv.index("--seq-len") + 1]) if "--seq-len" in argv else 4096
    assert cfg.training.seq_len == want_seq
    assert cfg.training.mixed_precision_param == "bfloat16" and cfg.compile.enable is False
    assert cfg.parallelism.pipeline_parallel_degree == (2 if "--pp" in argv else 1)


@pytest.mark.parametrize("argv,module,config", [
    (("deepseek-v3", "--nodes", "8", "--seq-len", "4096"), "deepseek_v3", "deepseek_v3_671b"),
    (("gpt-oss-120b", "--nodes", "8", "--seq-len", "4096"), "gpt_oss", "gpt_oss_120b"),
    (("llama3.1-405b", "--nodes", "16", "--seq-len", "4096"), "llama3", "llama3_405b")])
@pytest.mark.torch
def test_torchtitan_command_names_its_registry_entry(capsys, argv, module, config):
    """Models torchtitan 0.3 has are named by their module and config_registry function (no
    placeholders), with the plan's ep; torchtitan's ConfigManager reads the command."""
    out, _ = _run(capsys, "plan", *argv, "--emit", "torchtitan")
    args = torchtitan_argv(out)
    assert args[:4] == ["--module", module, "--config", config] and "TT_MODULE" not in out
    if config == "llama3_405b":          # its registry function converts to float8: said in the script
        assert "float8" in out.splitlines()[3]
        pytest.importorskip("torchao")
        import torch
        if not torch.cuda.is_available():
            pytest.skip("torchtitan's llama3_405b builds its Float8LinearConverter, which needs an SM89+ GPU")
    cfg = torchtitan_config(args)
    ep = int(args[args.index("--parallelism.expert_parallel_degree") + 1]) if "deepseek" in module or "oss" in module \
        else 1
    assert cfg.parallelism.expert_parallel_degree == ep and cfg.training.seq_len == 4096


@pytest.mark.unit
@pytest.mark.slow
def test_torchtitan_command_says_what_it_cannot_express(capsys):
    assert main(["plan", "llama3-8b", "--nodes", "1", "--precision", "fp16-mixed", "--gpu", "v100-32gb",
                 "--emit", "torchtitan"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bfloat16 or float32" in err[0] and "--emit deepspeed" in err[0]
    assert main(["plan", "llama3-8b", "--nodes", "1", "--activation-checkpointing", "layer:2",
                 "--emit", "torchtitan"]) == 2
    assert "activation-checkpointing full or op" in capsys.readouterr().err
    out, _ = _run(capsys, "plan", "llama2-7b", "--nodes", "1", "--emit", "torchtitan")
    assert "${TT_CONFIG:?" in out and "no config_registry function for llama2-7b" in out


@pytest.mark.unit
@pytest.mark.slow
def test_deepspeed_for_the_trainer_leaves_its_values_auto(capsys):
    # the plan chooses hsdp here, which DeepSpeed does not run: its fastest layout that fits is emitted
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
    assert "export TORCH_EXTENSIONS_DIR=" in err     # DeepSpeed's op builds go to the job's own cache
    assert "the plan's choice is hsdp" in err                      # says why it differs from the choice
    engine = json.loads(_run(capsys, "plan", "llama2-7b", "--nodes", "8", "--emit", "deepspeed")[0])
    assert engine["train_batch_size"] == 64 and engine["gradient_clipping"] == 0.0


@pytest.mark.unit
@pytest.mark.slow
def test_job_file_round_trip_and_flags_override(capsys, tmp_path):
    job, saved = tmp_path / "job.yaml", tmp_path / "saved.yaml"
    job.write_text("model: llama3-70b\nnodes: 8\nseq-len: 8192\nactivation_checkpointing: selective\n")
    first, _ = _run(capsys, "plan", "--config", str(job), "--save-config", str(saved), "--json")
    second, _ = _run(capsys, "plan", "--config", str(saved), "--json")
    assert first == second and yaml.safe_load(saved.read_text())["seq_len"] == 8192
    over = json.loads(_run(capsys, "plan", "--config", str(job), "--nodes", "2", "--json")[0])
    assert over["nodes"] == 2 and over["spec"]["seq_len"] == 8192


@pytest.mark.unit
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
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(cfg),
                        "--main_process_port", "0", os.path.join(root, "tests", "scripts", "accelerate_probe.py"),
                        str(tmp_path)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    for rank in range(4):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["world_size"] == 4 and {k: seen[k] for k in expect} == expect


@pytest.mark.unit
def test_accelerate_refuses_what_it_cannot_express(capsys):
    assert main(["plan", "llama2-7b", "--nodes", "2", "--strategy", "zero3-hpz", "--emit", "accelerate"]) == 2
    assert "--emit deepspeed --for trainer" in capsys.readouterr().err


@pytest.mark.gloo
def test_auto_wrap_takes_the_job_file_and_arguments_win(tmp_path, caplog):
    import logging
    caplog.set_level(logging.INFO, logger="hybrid")
    from hybrid import auto_wrap
    from hybrid.runtime.mesh import shutdown
    from hybrid.model.decoder import build_decoder
    from tests.runtime.test_backends import TINY
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


@pytest.mark.unit
def test_torchtitan_command_carries_the_pipeline(capsys):
    out, _ = _run(capsys, "plan", "llama3.1-405b", "--nodes", "16", "--seq-len", "8192", "--global-batch",
                  "32", "--strategy", "fsdp-grad-op", "--schedule", "interleaved", "--emit", "torchtitan")
    args = torchtitan_argv(out)
    opt = {a: b for a, b in zip(args, args[1:]) if a.startswith("--") and not b.startswith("--")}
    assert (opt["--parallelism.pipeline_parallel_degree"], opt["--parallelism.tensor_parallel_degree"]) == ("16", "8")
    assert opt["--parallelism.pipeline_parallel_schedule"] == "Interleaved1F1B"
    assert opt["--training.local_batch_size"] == "32"
    assert args[:4] == ["--module", "llama3", "--config", "llama3_405b"]    # torchtitan's registry entry,
    assert "converts the linears to float8" in out                        # which runs float8: said in the script


@pytest.mark.torch
def test_accelerate_for_several_machines_says_how_to_launch_each(capsys, tmp_path):
    """A two-node file as launched with no rank or address would wait for peers that never come:
    it carries the rendezvous keys (a placeholder address that cannot resolve), a comment, and
    the launch line with --machine_rank/--main_process_ip; Accelerate's own ClusterConfig reads it."""
    from accelerate.commands.config.config_args import ClusterConfig
    out, _ = _run(capsys, "plan", "llama2-7b", "--nodes", "2", "--emit", "accelerate")
    doc = yaml.safe_load(out)
    assert doc["num_machines"] == 2 and doc["machine_rank"] == 0
    assert doc["main_process_ip"] == "FIRST_NODE_IP" and doc["main_process_port"] == 29500
    assert "--machine_rank $NODE_RANK --main_process_ip $FIRST_NODE_IP" in out and "accelerate launch" in out
    f = tmp_path / "acc.yaml"
    f.write_text(out)
    cfg = ClusterConfig.from_yaml_file(str(f))
    assert cfg.main_process_ip == "FIRST_NODE_IP" and cfg.num_machines == 2
    one = yaml.safe_load(_run(capsys, "plan", "llama2-7b", "--nodes", "1", "--emit", "accelerate")[0])
    assert "main_process_ip" not in one
