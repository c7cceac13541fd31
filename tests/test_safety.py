"""Safety: never destroy data, never run code from a checkpoint, never hang, never a traceback."""
import json
import os
import pickle
import subprocess
import sys
import time
import zlib

import pytest
import torch

from hybrid.errors import HybridError
from hybrid.runtime.launch import run_ranks
from hybrid.model.decoder import build_decoder
from tests.runtime.test_backends import TINY
from tests.ckpt.test_checkpoint import load_bad

pytestmark = pytest.mark.safety
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _wrap(strategy, **kw):
    from hybrid import auto_wrap
    return auto_wrap(build_decoder(TINY, seed=0), strategy=strategy, precision="fp32", micro_batch=1, seq_len=16,
                     verbose=False, **kw)


def _train(w, steps=1):
    ids = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        w.backward(w(ids, labels=ids).loss)
        w.step()
        w.zero_grad()


# --- 1. save owns only what it wrote -------------------------------------------------------------
def save_into_user_dir(path):
    w = _wrap("ddp")
    _train(w)
    out = {}
    try:
        w.save(path)
    except HybridError as e:
        out["refused"] = str(e)
    w.save(path, overwrite=True)
    _train(w)
    w.save(path, overwrite=True)                 # a second version replaces our first, only ours
    other = os.path.join(path, "other-tool")            # another tool's meta.json is never replaced
    os.makedirs(other)
    with open(os.path.join(other, "meta.json"), "w") as f:
        f.write('{"tool": "theirs"}')
    try:
        w.save(other, overwrite=True)
    except HybridError as e:
        out["foreign_meta"] = str(e)
    for target in (os.path.join(path, "notes.txt"), "/proc/hybrid-ckpt"):      # a file; unwritable
        try:
            w.save(target)
        except HybridError as e:
            out.setdefault("bad_targets", []).append(str(e))
    return out


@pytest.mark.gloo
def test_save_never_deletes_or_mixes_with_user_folders(tmp_path):
    for name in ("data-important", "data-raw"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "keep.bin").write_bytes(b"precious")
    (tmp_path / "notes.txt").write_text("mine")
    out = run_ranks(1, save_into_user_dir, str(tmp_path))[0]
    assert "hybrid did not write" in out["refused"] and "overwrite=True" in out["refused"]
    assert (tmp_path / "data-important" / "keep.bin").read_bytes() == b"precious"
    assert (tmp_path / "data-raw" / "keep.bin").read_bytes() == b"precious"
    assert (tmp_path / "notes.txt").read_text() == "mine"
    ours = [d for d in os.listdir(tmp_path) if (tmp_path / d / "HYBRID_DATA").exists()]
    assert len(ours) == 1                                            # the superseded version is gone
    assert "is a file" in out["bad_targets"][0] and "cannot write" in out["bad_targets"][1]
    assert "meta.json that hybrid did not write" in out["foreign_meta"]
    assert (tmp_path / "other-tool" / "meta.json").read_text() == '{"tool": "theirs"}'
    ours = [d for d in os.listdir(tmp_path / "other-tool")]
    assert ours == ["meta.json"]


# --- 2. loading never runs code from the checkpoint ----------------------------------------------
class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def save_one(path):
    w = _wrap("ddp")
    _train(w)
    w.save(path)


load_one = load_bad        # a HybridError's message, or None


def _craft(path, rel, payload_bytes):
    """Replace a file of the checkpoint and fix its size and CRC in meta.json, as an attacker would."""
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    target = os.path.join(path, meta["data"], rel)
    with open(target, "wb") as f:
        f.write(payload_bytes)
    meta["files"][rel] = [len(payload_bytes), zlib.crc32(payload_bytes)]
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump(meta, f)


@pytest.mark.gloo
@pytest.mark.parametrize("rel", ["rng-0.pt", "dcp/.metadata", "loop.pt"])
def test_crafted_checkpoint_never_runs_code(tmp_path, rel):
    ckpt, marker = str(tmp_path / "ckpt"), tmp_path / "pwned"
    run_ranks(1, save_one, ckpt)
    if rel.endswith(".pt"):
        import io
        buf = io.BytesIO()
        torch.save({"python": _Payload(str(marker))}, buf)
        data = buf.getvalue()
    else:
        data = pickle.dumps(_Payload(str(marker)))
    _craft(ckpt, rel, data)
    msg = run_ranks(1, load_one, ckpt)[0]
    assert msg and "refusing to load" in msg and rel.split("/")[-1] in msg
    assert not marker.exists()
    if rel == "dcp/.metadata":          # export reads the same metadata
        rc, _, err = _cli(["export", ckpt, str(tmp_path / "out")])
        assert rc == 2 and "refusing to load" in err and not marker.exists()


# --- 3. a rank that leaves early: the others fail in bounded time, naming it -----------------------
def leave_early(strategy):
    os.environ["HYBRID_TIMEOUT"] = "6"
    import torch.distributed as dist

    from hybrid.runtime.mesh import shutdown
    w = _wrap(strategy)
    _train(w, 1)
    if dist.get_rank() == 1:
        shutdown()
        return "left"
    _train(w, 5)              # must raise: rank 1 is gone
    return "no error"


@pytest.mark.gloo
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero3"])
def test_rank_leaving_early_fails_the_others_with_its_name(strategy):
    start = time.monotonic()
    with pytest.raises(HybridError, match=r"rank 1 \(after optimizer step 1\) left the job while rank 0"):
        run_ranks(2, leave_early, strategy)
    assert time.monotonic() - start < 45


# --- 4. DCP errors are one line -------------------------------------------------------------------
def load_with_sgd(path):
    from hybrid import auto_wrap
    w = auto_wrap(build_decoder(TINY, seed=0), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), strategy="fsdp",
                  precision="fp32", micro_batch=1, seq_len=16, verbose=False)
    w.load(path)


@pytest.mark.gloo
def test_other_optimizer_is_one_line(tmp_path):
    run_ranks(2, save_one, str(tmp_path / "c"))
    with pytest.raises(HybridError, match="holds AdamW optimizer state and this job uses SGD"):
        run_ranks(2, load_with_sgd, str(tmp_path / "c"))


# --- 5. export never overwrites silently ------------------------------------------------------------
def _cli(argv):
    proc = subprocess.run([sys.executable, "-m", "hybrid.cli", *argv], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.gloo
def test_export_targets(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_ranks(1, save_one, ckpt)
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("user's own")
    rc, stdout, err = _cli(["export", ckpt, str(out)])
    assert rc == 2 and "not empty" in err and "--overwrite" in err and stdout == ""
    assert (out / "config.json").read_text() == "user's own"
    (tmp_path / "afile").write_text("x")
    assert _cli(["export", ckpt, str(tmp_path / "afile")])[0] == 2
    assert _cli(["export", ckpt, "/proc/nope/out"])[0] == 2
    rc, _, _ = _cli(["export", ckpt, str(out), "--overwrite"])
    assert rc == 0 and "user's own" not in (out / "config.json").read_text()
    assert not [d for d in os.listdir(tmp_path) if d.startswith(".out")]      # no temporary left behind


# --- 6, 7, 8. the CLI: one line, exit 2, nothing on stdout ---------------------------------------------
BAD_CONFIGS = {
    "missing-hidden": {"model_type": "llama", "vocab_size": 10, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "intermediate_size": 8},
    "no-model-type": {"hidden_size": 64},
    "a-list": [1, 2],
    "string-hidden": {"model_type": "llama", "vocab_size": 10, "hidden_size": "64", "num_hidden_layers": 2,
                      "num_attention_heads": 2, "intermediate_size": 8},
    "zero-heads": {"model_type": "llama", "vocab_size": 10, "hidden_size": 64, "num_hidden_layers": 2,
                   "num_attention_heads": 0, "intermediate_size": 8},
    "resnet": {"model_type": "resnet", "num_channels": 3, "hidden_sizes": [8, 16], "depths": [1, 1]},
}

FACTORIES = '''
def raises():
    raise RuntimeError("boom")
def returns_int():
    return 3
def needs_arg(width):
    return width
'''

STRATEGIES = {"int-name": "name: 123\nfamily: ddp\nshard: none\n", "null-name": "name: null\nfamily: ddp\n",
              "list-name": "name: [x, y]\nfamily: ddp\n", "neg-bucket": "name: bad\nfamily: ddp\nbucket_cap_mb: -5\n"}


def _cases(tmp):
    cases = {}
    for name, cfg in BAD_CONFIGS.items():
        path = tmp / f"{name}.json"
        path.write_text(json.dumps(cfg))
        cases[f"config-{name}"] = ["plan", str(path)]
    (tmp / "binary.json").write_bytes(bytes(range(256)))
    cases["config-binary"] = ["plan", str(tmp / "binary.json")]
    (tmp / "userfactories.py").write_text(FACTORIES)
    for fn in ("raises", "returns_int", "needs_arg"):
        cases[f"factory-{fn}"] = ["plan", f"userfactories:{fn}"]
    cases["factory-os-system"] = ["plan", "os:system"]
    for name, text in STRATEGIES.items():
        d = tmp / f"strategies-{name}"
        d.mkdir()
        (d / "s.yaml").write_text(text)
        cases[f"yaml-{name}"] = ["plan", "gpt2", "--strategies-dir", str(d)]
    d = tmp / "strategies-binary"
    d.mkdir()
    (d / "s.yaml").write_bytes(bytes(range(256)))
    cases["yaml-binary"] = ["plan", "gpt2", "--strategies-dir", str(d)]
    cases.update({
        "gpu-memory-overflow": ["plan", "gpt2", "--gpu-memory", "1e400"],
        "gpu-memory-negative": ["plan", "gpt2", "--gpu-memory", "-5GB"],
        "seq-len-float": ["plan", "gpt2", "--seq-len", "1e12"],
        "seq-len-huge": ["plan", "gpt2", "--seq-len", "1000000000000"],
        "emit-output-missing-dir": ["plan", "llama2-7b", "--emit", "deepspeed", "-o", "/nonexistent/x.json"],
        "plot-missing-dir": ["compare", "gpt2", "--plot", "/nonexistent/x.png"],
        "emit-wrong-family": ["plan", "llama2-7b", "--emit", "deepspeed", "--strategy", "fsdp"],
        "unknown-flag": ["plan", "gpt2", "--bogus"],
        "measure-too-big": ["measure", "llama2-70b", "--strategy", "fsdp"],
    })
    return cases


@pytest.mark.gloo      # one subprocess, ~20 s: the CLI as a user runs it
def test_bad_cli_input_is_one_line_exit_2_nothing_on_stdout(tmp_path):
    cases = _cases(tmp_path)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
    script = ("import json, sys, io, contextlib\nfrom hybrid.cli import main\nout = {}\n"
              "for name, argv in json.loads(sys.argv[1]).items():\n"
              "    o, e = io.StringIO(), io.StringIO()\n"
              "    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):\n"
              "        try:\n            rc = main(argv + ['--json'] if argv[0] != 'compare' else argv)\n"
              "        except BaseException as ex:\n            rc = repr(ex)\n"
              "    out[name] = [rc, o.getvalue(), e.getvalue()]\n"
              "print(json.dumps(out))\n")
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(cases)], capture_output=True, text=True,
                          env=env, cwd=str(tmp_path), timeout=300)
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, (rc, stdout, stderr) in results.items():
        lines = [ln for ln in stderr.splitlines() if ln.strip()]
        assert rc == 2, (name, rc, stderr[-500:])
        assert stdout == "", (name, stdout[:300])
        assert len(lines) == 1 and lines[0].startswith("hybrid: error: "), (name, stderr[-500:])
    assert "needs one of: zero1" in results["emit-wrong-family"][2]
    assert "needs about" in results["measure-too-big"][2] and "CPU ranks" in results["measure-too-big"][2]


# --- 9. ZeRO at world size 1 under plain python; misuse is one line -------------------------------------
@pytest.mark.gloo
def test_zero_under_plain_python_and_misuse():
    script = f"""
import torch, sys
sys.path.insert(0, {ROOT!r})
from hybrid import auto_wrap
from hybrid.errors import HybridError
from hybrid.model.decoder import build_decoder
from tests.runtime.test_backends import TINY
from tests.ckpt.test_checkpoint import load_bad
w = auto_wrap(build_decoder(TINY, seed=0), strategy="zero2", precision="fp32", micro_batch=1, seq_len=16, verbose=False)
ids = torch.randint(0, 512, (1, 16))
msgs = []
try:
    w.step()
except HybridError as e:
    msgs.append(str(e))
w.backward(w(ids, labels=ids).loss); w.step(); w.zero_grad()
m = build_decoder(TINY, seed=0)
auto_wrap(m, strategy="fsdp", precision="fp32", micro_batch=1, seq_len=16, verbose=False)
try:
    auto_wrap(m, strategy="fsdp", precision="fp32", micro_batch=1, seq_len=16, verbose=False)
except HybridError as e:
    msgs.append(str(e))
print("\\n".join(msgs))
"""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "step() was called before backward()" in proc.stdout
    assert "already wrapped" in proc.stdout


# --- 10. buffers: the checkpoint holds rank 0's --------------------------------------------------------
class BNNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
                                           for _ in range(2)])
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        for b in self.blocks:
            x = torch.relu(b(x))
        return self.head(x).pow(2).mean()


def bn_save(path):
    import torch.distributed as dist

    from hybrid import auto_wrap
    torch.manual_seed(0)
    w = auto_wrap(BNNet(), strategy="zero3", precision="fp32", verbose=False)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(dist.get_rank())) * (1 + dist.get_rank())
    w.backward(w(x))
    w.step()
    w.save(path)
    return {k: v for k, v in w.state_dict().items() if "running" in k}


def bn_load(path):
    from hybrid import auto_wrap
    torch.manual_seed(1)
    w = auto_wrap(BNNet(), strategy="ddp", precision="fp32", verbose=False)
    w.load(path)
    return {k: v for k, v in w.state_dict().items() if "running" in k}


@pytest.mark.gloo
def test_buffers_that_differ_across_ranks_are_saved_from_rank_0(tmp_path):
    saved = run_ranks(2, bn_save, str(tmp_path / "bn"))
    assert any((saved[0][k] - saved[1][k]).abs().max() > 0.01 for k in saved[0])   # they really differ
    loaded = run_ranks(1, bn_load, str(tmp_path / "bn"))[0]
    for k, v in loaded.items():
        assert torch.equal(v, saved[0][k]), k


def error_then_abort():
    import os
    import time

    from hybrid.errors import HybridError
    if int(os.environ["RANK"]) == 0:
        raise HybridError("rank 0 found the checkpoint wrong")
    time.sleep(1.0)          # rank 0 has reported; this one dies the way gloo aborts on a vanished peer
    os.abort()


@pytest.mark.gloo
def test_a_peer_dying_after_an_error_reports_the_error():
    with pytest.raises(HybridError, match="rank 0 found the checkpoint wrong"):
        run_ranks(2, error_then_abort)
