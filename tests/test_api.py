"""The public API answers as the CLI does, for every model form it takes."""
import contextlib
import dataclasses
import io
import json

import pytest

import hybrid
from hybrid.cli.main import main
from hybrid.errors import HybridError



def _cli_json(*argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(list(argv) + ["--json"]) == 0
    return json.loads(out.getvalue())


@pytest.mark.unit
@pytest.mark.slow
def test_plan_takes_a_preset_and_chooses_what_the_cli_chooses():
    p = hybrid.plan("llama2-7b", cluster=hybrid.Cluster.build(8, 8, "h100-80gb"), seq_len=4096)
    cli = _cli_json("plan", "llama2-7b", "--nodes", "8", "--gpus-per-node", "8", "--gpu", "h100-80gb",
                    "--seq-len", "4096")
    assert p.to_dict()["chosen_candidate"] == cli["chosen_candidate"]
    assert p.to_dict()["strategies"] == cli["strategies"]


@pytest.mark.unit
def test_plan_takes_a_config_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt2", "vocab_size": 50257, "n_embd": 768, "n_layer": 12,
                                "n_head": 12, "n_positions": 1024}))
    p = hybrid.plan(str(path), cluster=hybrid.Cluster.build(1, 8, "a100-80gb"), micro_batch=8, seq_len=1024)
    assert p.chosen is not None and p.spec.micro_batch == 8
    assert p.model.params == hybrid.plan("gpt2", micro_batch=8, seq_len=1024).model.params


@pytest.mark.torch       # builds a module on the meta device
def test_estimate_takes_a_module_and_a_factory():
    from hybrid.model.decoder import build_decoder
    from hybrid.model.presets import get_preset
    cfg = get_preset("gpt2")
    cluster = hybrid.Cluster.build(1, 8, "a100-80gb")
    by_name = hybrid.estimate("gpt2", "ddp", cluster=cluster, micro_batch=2, seq_len=512)
    by_module = hybrid.estimate(build_decoder(cfg, device="meta"), "ddp", cluster=cluster, micro_batch=2, seq_len=512)
    by_factory = hybrid.estimate(lambda: build_decoder(cfg, device="meta"), "ddp", cluster=cluster, micro_batch=2,
                                 seq_len=512)
    assert by_name.total == by_module.total == by_factory.total


@pytest.mark.unit
def test_bad_training_argument_is_one_line():
    with pytest.raises(HybridError, match="unknown training argument.*seqlen.*valid: micro_batch"):
        hybrid.plan("gpt2", seqlen=1024)
    with pytest.raises(HybridError, match="model must be a preset name"):
        hybrid.estimate(42)
    with pytest.raises(HybridError, match="no bf16"):
        hybrid.plan("gpt2", cluster=hybrid.Cluster.build(1, 8, "v100-32gb"), precision="bf16-mixed")


@pytest.mark.torch      # auto_wrap refuses these before any process group starts
@pytest.mark.parametrize("kw,match", [
    ({"cluster": "big"}, r"cluster must be a hybrid.Cluster, e\.g\. hybrid.Cluster.build\(8, 8, .*got str 'big'"),
    ({"config": 123}, r"config must be the path of a job file .* got int 123"),
    ({"optimizer": lambda ps: None}, r"optimizer must be a callable that returns a torch.optim.Optimizer; it returned "
                                     r"NoneType None")])
def test_auto_wrap_arguments_are_one_line_errors(kw, match):
    """They were an AttributeError, a read of file descriptor 123, and an optimizer accepted as None."""
    import torch

    import hybrid
    from hybrid.model.decoder import build_decoder
    kw = {"optimizer": lambda ps: torch.optim.AdamW(ps), **kw}
    with pytest.raises(hybrid.HybridError, match=match):
        hybrid.auto_wrap(build_decoder("tiny-llama"), seq_len=16, verbose=False, **kw)


@pytest.mark.torch      # builds modules (a factory's, our decoder on the meta device)
def test_every_model_form_defaults_to_the_sequence_length_the_help_states():
    """--help says the model's maximum, at most N: a module that states no maximum (tests.factories:
    small_mlp, no decoder) planned through the CLI, the API or a bare TrainSpec took 2048, not N."""
    import re

    from hybrid.config.options import OPTIONS
    from hybrid.config.spec import TrainSpec, default_seq_len
    from hybrid.model.decoder import build_decoder
    from hybrid.model.presets import get_preset
    from tests.factories import small_mlp
    n = int(re.search(r"the model's maximum, at most (\d+)\)", OPTIONS["seq_len"].help_text()).group(1))
    cluster, fsdp = hybrid.Cluster.build(1, 8, "h100-80gb"), ["fsdp"]
    assert _cli_json("plan", "tests.factories:small_mlp", "--strategy", "fsdp")["spec"]["seq_len"] == n
    assert hybrid.plan(small_mlp(), cluster=cluster, strategies=fsdp).spec.seq_len == n
    assert TrainSpec().seq_len == default_seq_len(None) == n
    assert hybrid.plan("tiny-llama", cluster=cluster, strategies=fsdp).spec.seq_len == 256    # its maximum, under N
    assert hybrid.plan("llama3-8b", cluster=cluster, strategies=fsdp).spec.seq_len == n       # 8192 positions
    longer = dataclasses.replace(get_preset("tiny-llama"), max_positions=8 * n)
    assert hybrid.plan(build_decoder(longer, device="meta"), cluster=cluster, strategies=fsdp).spec.seq_len == n
