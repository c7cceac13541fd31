"""`hybrid plan --lora-rank R [--quantize-base nf4]`: the QLoRA question users ask, answered with how
it fits; the fine-tuning options' one-line errors."""
import json

import pytest

from tests.cli.test_cli import run

QLORA_70B = ["plan", "llama3-70b", "--nodes", "1", "--gpus-per-node", "2", "--gpu", "l40s-48gb",
             "--lora-rank", "16", "--quantize-base", "nf4"]


@pytest.mark.unit
def test_llama3_70b_qlora_fits_on_two_l40s_and_says_how(capsys):
    code, out, _ = run(capsys, *QLORA_70B)
    assert code == 0
    assert "chosen:" in out and "nothing fits" not in out
    assert "adapters 207,093,760 params" in out
    assert "68,451,041,280 block-linear weights in nf4 (4.127 bits each" in out
    assert "of parameters per GPU (the frozen base sharded with the adapters" in out
    assert "MFU counts 4 FLOPs per frozen weight" in out
    code, out, _ = run(capsys, *QLORA_70B, "--json")
    doc = json.loads(out)
    assert doc["spec"]["lora_rank"] == 16 and doc["spec"]["quantize_base"] == "nf4"
    chosen = doc["chosen"]
    assert chosen is not None


@pytest.mark.unit
def test_lora_without_quantisation_does_not_fit_on_two_l40s_and_the_fp32_base_is_gone(capsys):
    """A bf16 base of 70B is 131 GiB: it cannot fit on 2 x 48 GB; the frozen base is counted in
    bf16 (2 bytes per weight), not at the fp32 master size."""
    code, out, _ = run(capsys, *QLORA_70B[:-2], "--strategy", "fsdp", "--json")
    doc = json.loads(out)
    params = [c["per_gpu"]["params"] for c in doc["strategies"] if c["parallel"]["dp_shard"] == 2]
    assert params and min(params) == pytest.approx((70_553_706_496 * 2 + 207_093_760 * 4) / 2, rel=0.01)


@pytest.mark.unit
@pytest.mark.parametrize("argv,match", [
    (["--lora-rank", "0"], "--lora-rank must be a positive integer, got 0"),
    (["--lora-rank", "100000"], "--lora-rank must be at most 65536"),
    (["--quantize-base", "nf4"], "--quantize-base needs --lora-rank R"),
    (["--lora-targets", "q_proj"], "--lora-targets needs --lora-rank R"),
    (["--lora-rank", "8", "--quantize-base", "nf3"], "unknown quantize_base 'nf3'. Available: nf4, int8"),
    (["--lora-rank", "8", "--lora-targets", "q_proj,wq"],
     "unknown lora-targets wq for this llama-style decoder. Available: q_proj, k_proj"),
])
def test_fine_tuning_options_bad_input_exit_2(capsys, argv, match):
    code, out, err = run(capsys, "plan", "llama3-8b", "--json", *argv)
    assert code == 2 and out == ""
    assert match in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.unit
def test_lora_is_refused_by_the_methods_that_run_the_model_without_adapters(capsys):
    code, out, err = run(capsys, "plan", "tiny-llama", "--lora-rank", "8", "--method", "traced")
    assert code == 2 and "--method traced runs the model without adapters" in err
