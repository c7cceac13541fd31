"""Checkpoints: resume across strategies and world sizes, atomic saves, clear errors on bad input."""
import json
import os

import pytest
import torch

from hybrid.runtime.launch import run_ranks
from hybrid.model.decoder import build_decoder
from tests.runtime.test_backends import TINY

pytestmark = pytest.mark.gloo

GLOBAL, SEQ, K, N = 4, 16, 3, 6      # global batch, sequence, save after step K, stop after N


def batches():
    g = torch.Generator().manual_seed(99)
    return [torch.randint(0, 512, (GLOBAL, SEQ), generator=g) for _ in range(N)]


def _wrap(strategy, seed=0):
    from hybrid import auto_wrap
    world = int(os.environ["WORLD_SIZE"])
    return auto_wrap(build_decoder(TINY, seed=seed), optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-3),
                     strategy=strategy, precision="fp32", micro_batch=GLOBAL // world, seq_len=SEQ,
                     activation_checkpointing="none", verbose=False)


def _steps(w, start, stop):
    """Train steps [start, stop); returns the global mean loss of each."""
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    mb, out = GLOBAL // world, []
    for ids in batches()[start:stop]:
        local = ids[rank * mb:(rank + 1) * mb]
        loss = w(local, labels=local).loss
        w.backward(loss)
        w.step()
        w.zero_grad()
        g = loss.detach().clone()
        dist.all_reduce(g)
        out.append(g.item() / world)
    return out


def save_then_continue(strategy, path):
    w = _wrap(strategy)
    before = _steps(w, 0, K)
    w.save(path, extra={"epoch": 0, "batch": K})
    return before + _steps(w, K, N)


def resume(strategy, path):
    w = _wrap(strategy, seed=123)           # different initial weights: all must come from disk
    extra = w.load(path)
    assert w.step_count == K and extra == {"epoch": 0, "batch": K}
    return _steps(w, K, N)


@pytest.fixture(scope="module")
def zero3_on_4(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt") / "zero3-4")
    return path, run_ranks(4, save_then_continue, "zero3", path)[0]


def test_zero3_on_4_ranks_resumes_under_hsdp_on_2(zero3_on_4):
    path, uninterrupted = zero3_on_4
    resumed = run_ranks(2, resume, "hsdp", path)[0]
    assert max(abs(a - b) for a, b in zip(resumed, uninterrupted[K:])) < 1e-5


def pairs(path, uninterrupted):
    """Resume the 4-rank zero3 checkpoint under each strategy on 2 ranks."""
    return {s: resume(s, path) for s in ("ddp", "fsdp", "zero1", "zero2")}


def test_zero3_checkpoint_resumes_under_every_strategy(zero3_on_4):
    path, uninterrupted = zero3_on_4
    for strategy, losses in run_ranks(2, pairs, path, uninterrupted)[0].items():
        assert max(abs(a - b) for a, b in zip(losses, uninterrupted[K:])) < 1e-5, strategy


def save_each_and_resume_elsewhere(tmp):
    """ddp -> zero3, fsdp -> ddp, zero2 -> zero2 (DeepSpeed's own checkpoint) on 2 ranks."""
    out = {}
    for src, dst in (("ddp", "zero3"), ("fsdp", "ddp"), ("zero2", "zero2")):
        path = os.path.join(tmp, src)
        full = save_then_continue(src, path)
        out[(src, dst)] = (full[K:], resume(dst, path))
    return out


def test_other_pairs_on_2_ranks(tmp_path):
    for pair, (want, got) in run_ranks(2, save_each_and_resume_elsewhere, str(tmp_path))[0].items():
        assert max(abs(a - b) for a, b in zip(want, got)) < 1e-5, pair


def crash_mid_save(path):
    """A save that dies after writing its data leaves the previous version in force."""
    from hybrid.errors import HybridError
    w = _wrap("fsdp")
    _steps(w, 0, 1)
    w.save(path)
    first = w.state_dict()
    _steps(w, 1, 2)

    import hybrid.ckpt.store as ckpt

    def die(*a, **k):
        raise RuntimeError("node lost power")
    commit, ckpt._Version.commit = ckpt._Version.commit, die      # dies after the data, before the commit
    try:
        w.save(path)
    except RuntimeError:
        pass
    ckpt._Version.commit = commit
    w2 = _wrap("fsdp", seed=5)
    w2.load(path)
    restored = w2.state_dict()
    same = max((first[k] - restored[k]).abs().max().item() for k in first)
    # a different model: shape mismatch names the parameter
    errors = {}
    try:
        from hybrid import auto_wrap
        from hybrid.model.presets import DecoderConfig
        other = auto_wrap(build_decoder(DecoderConfig("llama", 512, 32, 2, 4, 176, 64, kv_heads=2, tied=True)),
                          strategy="ddp", precision="fp32", seq_len=16, verbose=False)
        other.load(path)
    except HybridError as e:
        errors["shape"] = str(e)
    return same, w2.step_count, errors


def test_atomic_save_and_shape_mismatch(tmp_path):
    path = str(tmp_path / "ckpt")
    same, step, errors = run_ranks(2, crash_mid_save, path)[0]
    assert same == 0.0 and step == 1
    assert ("parameter 'embed.weight' has shape (512, 64) in the checkpoint and (512, 32) in this model"
            in errors["shape"])
    assert len([d for d in os.listdir(path) if d.startswith("data-")]) >= 1


def load_bad(path):
    from hybrid.errors import HybridError
    w = _wrap("ddp")
    try:
        w.load(path)
    except HybridError as e:
        return str(e)
    return None


def load_each(paths):
    """load_bad on each path in turn, in one launch: {path: its one-line error, or None}."""
    return {path: load_bad(path) for path in paths}


def test_bad_checkpoints_are_clear_errors(zero3_on_4, tmp_path):
    good, _ = zero3_on_4
    # a truncated and a corrupted shard, in copies of the good checkpoint
    import shutil
    meta = json.load(open(os.path.join(good, "meta.json")))
    shard = next(f for f in meta["files"] if f.endswith(".distcp"))
    kinds = ("truncated", "corrupted")
    for kind in kinds:
        bad = str(tmp_path / kind)
        shutil.copytree(good, bad)
        f = os.path.join(bad, meta["data"], shard)
        data = open(f, "rb").read()
        open(f, "wb").write(data[: len(data) // 2] if kind == "truncated" else data[:100] + b"\xff" * 8 + data[108:])
    empty, missing = str(tmp_path / "empty"), str(tmp_path / "nope")
    os.makedirs(empty)
    # one launch loads each (docs/development.md, "One launch, several checks"); the good one last
    msgs = run_ranks(2, load_each, [empty, missing, *(str(tmp_path / k) for k in kinds), good])[0]
    assert "has no meta.json" in msgs[empty]
    assert "does not exist" in msgs[missing]
    for kind in kinds:
        msg = msgs[str(tmp_path / kind)]
        assert kind in msg and shard in msg
    # the original is untouched and still loads
    assert msgs[good] is None


def train_and_save_preset(name, path):
    from hybrid import auto_wrap
    w = auto_wrap(build_decoder(name, seed=0), strategy="fsdp", precision="fp32", micro_batch=2, seq_len=16,
                  verbose=False)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        loss = w(ids, labels=ids).loss
        w.backward(loss)
        w.step()
        w.zero_grad()
    w.save(path)
    return w.state_dict()


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt"])
def test_export_loads_in_transformers_with_the_same_outputs(preset, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from hybrid.cli.main import main
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    state = run_ranks(2, train_and_save_preset, preset, ckpt)[0]
    assert main(["export", ckpt, out, "--max-shard-size", "200KB"]) == 0
    files = os.listdir(out)
    assert "config.json" in files and "model.safetensors.index.json" in files
    assert sum(f.endswith(".safetensors") for f in files) > 1          # sharded by size
    ours = build_decoder(preset)
    ours.load_state_dict(state)
    hf = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.randint(0, 512, (2, 16))
    with torch.no_grad():
        assert torch.allclose(ours(ids).logits, hf(ids).logits, atol=1e-4)


def test_export_of_a_bad_checkpoint(tmp_path, capsys):
    from hybrid.cli.main import main
    assert main(["export", str(tmp_path), str(tmp_path / "o")]) == 2
    assert "has no meta.json" in capsys.readouterr().err
