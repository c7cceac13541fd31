"""`hybrid estimate` / `hybrid plan`: tables, the JSON contract, and exit code 2 on bad input."""
import json
import subprocess
import sys

import pytest

from hybrid.cli.main import main

PLAN_7B = ["plan", "llama2-7b", "--nodes", "8", "--gpus-per-node", "8", "--gpu", "h100-80gb",
           "--seq-len", "4096", "--micro-batch", "1"]
PER_GPU_KEYS = {"params", "grads", "optimizer", "activations", "temporaries", "buffers", "overhead", "total"}


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.unit
@pytest.mark.slow
def test_plan_table(capsys):
    code, out, _ = run(capsys, *PLAN_7B, "--all")
    assert code == 0
    assert "llama2-7b" in out and "world size 64" in out and "chosen:" in out
    for name in ("ddp", "fsdp", "hsdp", "zero1", "zero2", "zero3", "zero3-hpz", "zero3-offload"):
        assert f" {name} " in out or f"*{name} " in out


@pytest.mark.unit
@pytest.mark.slow
def test_plan_table_shows_the_best_rows_each_family_and_the_choice(capsys):
    """~300 candidates for llama2-7b on 8 x 8: the default table is the best 12, the best of each
    family and the choice; --top N changes N, --all shows every one."""
    def rows(*flags):
        code, out, _ = run(capsys, *PLAN_7B, *flags)
        assert code == 0
        lines = out.splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith("---")) + 1
        return [line for line in lines[start:] if line[:1] in (" ", "*") and line.strip()], out
    default, out = rows()
    assert 12 <= len(default) <= 12 + 3 + 1 and "candidates: the best 12" in out and "--all" in out
    for family in (" ddp", " fsdp", " zero"):
        assert any(r.startswith(family) or r.startswith("*" + family[1:]) for r in default), family
    assert sum(r.startswith("*") for r in default) == 1   # the choice is shown (a tie may pick a slower row)
    assert len(rows("--top", "3")[0]) <= 3 + 3 + 1
    every, out = rows("--all")
    assert len(every) > 200 and "candidates:" not in out
    assert run(capsys, *PLAN_7B, "--top", "0")[0] == 2


def check_contract(doc, n_strategies=None):
    assert {"model", "params", "world_size", "capacity_bytes", "chosen", "strategies"} <= set(doc)
    assert isinstance(doc["params"], int) and isinstance(doc["capacity_bytes"], int)
    if n_strategies:
        assert len(doc["strategies"]) == n_strategies
    for s in doc["strategies"]:
        assert {"name", "shard_size", "per_gpu", "per_cpu", "fits", "reason"} <= set(s)
        if s["per_gpu"] is not None:
            assert set(s["per_gpu"]) == PER_GPU_KEYS
            assert all(isinstance(v, int) for v in s["per_gpu"].values() if v is not None)
            parts = sum(v for k, v in s["per_gpu"].items() if k != "total" and v is not None)
            assert parts == pytest.approx(s["per_gpu"]["total"], abs=8)
            needed = s["allocated_bytes"] + s["floor_bytes"] + (s["per_gpu"]["total"] - s["reserved_bytes"])
            fits_reserved = s["per_gpu"]["total"] <= doc["capacity_bytes"]
            assert s["verdict"] == ("fits" if fits_reserved and s["fits"] else "tight" if s["fits"] else "OOM")
            if s["per_gpu"]["activations"] is not None:       # a whole job: fits means what must fit does
                assert s["fits"] == (needed <= doc["capacity_bytes"] and s["per_cpu"]["total"] <= 2**60)
        assert isinstance(s["per_cpu"]["total"], int)


@pytest.mark.unit
@pytest.mark.slow
def test_plan_json_contract(capsys):
    code, out, _ = run(capsys, *PLAN_7B, "--json")
    doc = json.loads(out)
    check_contract(doc)
    assert doc["model"] == "llama2-7b" and doc["params"] == 6_738_415_616 and doc["world_size"] == 64
    ddp = next(s for s in doc["strategies"] if s["name"] == "ddp" and s["parallel"]["tp"] == 1
               and s["parallel"]["pp"] == 1)
    assert not ddp["fits"] and "needs" in ddp["reason"]
    chosen = next(s for s in doc["strategies"] if s["name"] == doc["chosen"])
    assert chosen["fits"]


@pytest.mark.unit
def test_estimate_json_same_shape(capsys):
    code, out, _ = run(capsys, "estimate", "llama2-7b", "--strategy", "hsdp", "--nodes", "2",
                       "--seq-len", "2048", "--activation-checkpointing", "full", "--json")
    doc = json.loads(out)
    check_contract(doc, n_strategies=1)
    assert doc["strategies"][0]["name"] == "hsdp" and doc["strategies"][0]["shard_size"] == 8
    assert doc["chosen"] == "hsdp"


@pytest.mark.unit
def test_estimate_params_only_and_gpu_memory(capsys):
    code, out, _ = run(capsys, "estimate", "--params", "7.5e9", "--strategy", "zero2",
                       "--gpu-memory", "40GiB", "--json")
    doc = json.loads(out)
    assert doc["capacity_bytes"] == 40 * 1024**3 and doc["strategies"][0]["per_gpu"]["activations"] is None
    code, out, _ = run(capsys, "estimate", "--params", "7.5e9", "--strategy", "zero2")
    assert "activations unknown" in out


@pytest.mark.fakepg
def test_estimate_traced_method(capsys):
    code, out, err = run(capsys, "estimate", "tiny-llama", "--strategy", "hsdp", "--nodes", "2",
                         "--gpus-per-node", "4", "--seq-len", "64", "--method", "traced",
                         "--implementation", "hybrid", "--json")
    doc = json.loads(out)
    check_contract(doc, n_strategies=1)
    assert code == 0 and doc["method"] == "traced" and doc["strategies"][0]["shard_size"] == 4
    assert "traced on hybrid's own implementation" in doc["strategies"][0]["notes"][-1]
    assert "tracing hsdp (shard 4)" in err


@pytest.mark.parametrize("argv,match", [
    (["plan", "llama9-7b"], "unknown model 'llama9-7b'"),
    (["plan", "gpt2", "--gpu", "b2000"], "unknown GPU 'b2000': did you mean b200? Available: a100-40gb"),
    (["plan", "gpt2", "--gpu-memory", "80"], "--gpu-memory 80 has no unit (bytes?): memory sizes need one, e.g. "
                                             "--gpu-memory 80GiB"),
    (["estimate", "gpt2", "--strategy", "zero4"], "unknown strategy 'zero4'. Available:"),
    (["plan", "gpt2", "--nodes", "2", "--shard-size", "3"], "world size 16 is not divisible by shard size 3"),
    (["plan", "gpt2", "--shard-size", "16"], "shard size 16 is larger than the world size 8"),
    (["plan", "gpt2", "--micro-batch", "0"], "micro-batch must be a positive integer, got 0"),
    (["plan", "gpt2", "--seq-len", "-5"], "seq-len must be a positive integer, got -5"),
    (["plan", "gpt2", "--seq-len", "4096"], "longer than gpt2's maximum positions 1024"),
    (["plan", "gpt2", "--gpu-memory", "eighty gigs"], "cannot parse memory size 'eighty gigs'"),
    (["plan", "gpt2", "--precision", "fp16"], "unknown precision 'fp16'"),
    (["plan", "--params", "lots"], "cannot parse parameter count 'lots'"),
    (["plan", "gpt2", "--method", "guess"], "unknown method 'guess'. Available: analytic, traced, measured"),
    (["estimate", "--params", "1e9", "--strategy", "ddp", "--method", "traced"], "bare parameter count"),
    (["plan"], "no model given"),
])
@pytest.mark.unit
def test_bad_input_exit_2(capsys, argv, match):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert match in err and err.startswith("hybrid: error:") and "Traceback" not in err


@pytest.mark.parametrize("argv,match", [
    (["plan", "tests.factories:frozen"], "has no trainable parameters"),          # a torch module
    (["measure", "gpt2", "--strategy", "ddp", "--nodes", "8"], "world size 16 needs more than"),  # counts devices
])
@pytest.mark.torch
def test_bad_input_that_needs_torch_to_see_exits_2(capsys, argv, match):
    test_bad_input_exit_2(capsys, argv, match)


@pytest.mark.unit
@pytest.mark.slow
def test_console_script_and_no_torch_on_fast_path():
    """`hybrid plan` on a preset must answer without importing torch (it takes ~1 s alone)."""
    code = ("import sys; from hybrid.cli import main; rc = main(%r); "
            "sys.exit(rc if 'torch' not in sys.modules else 99)" % (PLAN_7B + ["--json"],))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["world_size"] == 64
    r = subprocess.run([sys.executable, "-m", "hybrid.cli", "plan", "nope"], capture_output=True, text=True)
    assert r.returncode == 2 and "unknown model" in r.stderr
