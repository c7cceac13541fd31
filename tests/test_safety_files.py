"""Checkpoints, exports and job files that cannot be turned against the user (issue 27): each case
a hostile or careless user found is a test here; tests/test_fuzz.py searches around them."""
import io
import json
import os
import pickle
import shutil
import stat
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
from tests.test_safety import _train
from tests.test_safety_input import _cli

pytestmark = pytest.mark.safety
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- helpers: a real checkpoint, and an attacker's edits of it -------------------------------------
def _wrap(strategy="ddp", optimizer=None, frozen=(), seed=0, **kw):
    from hybrid import auto_wrap
    model = build_decoder(TINY, seed=seed)
    for name, p in model.named_parameters():
        if any(name.startswith(f) for f in frozen):
            p.requires_grad_(False)
    return auto_wrap(model, optimizer=optimizer, strategy=strategy, precision="fp32", micro_batch=1, seq_len=16,
                     verbose=False, **kw)


def save_two(path, other, sched=False):
    """The checkpoint under test and a second one of other weights beside it (the traversal target)."""
    w = _wrap(scheduler=(lambda o: torch.optim.lr_scheduler.StepLR(o, 3)) if sched else None)
    _train(w)
    w.save(path)
    w2 = _wrap(seed=7)
    _train(w2)
    w2.save(other)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    base = tmp_path_factory.mktemp("ckpts")
    run_ranks(1, save_two, str(base / "good"), str(base / "other"))
    return base


def meta_of(path):
    with open(os.path.join(path, "meta.json")) as f:
        return json.load(f)


def write_meta(path, meta):
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump(meta, f)


def refit(path, rel):
    """Fix rel's size and CRC in meta.json, as an attacker who edits a file would."""
    meta = meta_of(path)
    with open(os.path.join(path, meta["data"], rel), "rb") as f:
        data = f.read()
    meta["files"][rel] = [len(data), zlib.crc32(data)]
    write_meta(path, meta)


def dcp_md(path):
    from hybrid.ckpt.safeio import load_metadata
    meta = meta_of(path)
    with open(os.path.join(path, meta["data"], "dcp", ".metadata"), "rb") as f:
        return load_metadata(f.read(), ".metadata")


def put_md(path, md):
    meta = meta_of(path)
    with open(os.path.join(path, meta["data"], "dcp", ".metadata"), "wb") as f:
        pickle.dump(md, f)
    refit(path, "dcp/.metadata")


def copy(ckpts, tmp_path, name="c"):
    dst = tmp_path / name
    shutil.copytree(ckpts / "good", dst, symlinks=True)
    return str(dst)


def export_error(ckpt, out):
    """export's one-line error, or None when it exported."""
    from hybrid.ckpt.export import export
    try:
        export(ckpt, out)
    except HybridError as e:
        assert "\n" not in str(e)
        return str(e)
    return None


def _first_param(md):
    return next(k for k in md.state_dict_metadata if k.startswith("model.") and "embed" in k)


# --- 1. reading confined to the checkpoint --------------------------------------------------------
def traversal(path, target):
    """Point every storage entry of path's .metadata at the other checkpoint's files."""
    md = dcp_md(path)
    for info in md.storage_data.values():
        info.relative_path = target(info.relative_path)
    put_md(path, md)


@pytest.mark.gloo
def test_metadata_cannot_point_reads_at_another_checkpoint(ckpts, tmp_path):
    other = meta_of(str(ckpts / "other"))["data"]
    cases = {"dotdot": lambda rel: f"../../../other/{other}/dcp/{rel}",
             "absolute": lambda rel: str(ckpts / "other" / other / "dcp" / rel),
             "etc": lambda rel: "../../../../../../../../etc/passwd",
             "nowhere": lambda rel: "../../../../../../../../no/such/file"}
    messages = {}
    for name, target in cases.items():
        c = copy(ckpts, tmp_path, name)
        traversal(c, target)
        messages[name] = export_error(c, str(tmp_path / f"out-{name}"))
        assert messages[name] and "not a relative path inside the checkpoint" in messages[name], messages[name]
        assert not (tmp_path / f"out-{name}").exists()
    # the answer for an existing outside file and for a missing one is the same: nothing is probed
    assert messages["etc"].split(": ", 1)[1].split("names the file")[0] == \
        messages["nowhere"].split(": ", 1)[1].split("names the file")[0]
    loads = run_ranks(1, load_each, [str(tmp_path / n) for n in cases])[0]
    assert all(m and "not a relative path inside the checkpoint" in m for m in loads), loads


@pytest.mark.gloo
def test_a_file_meta_json_does_not_list_is_never_read(ckpts, tmp_path):
    c = copy(ckpts, tmp_path)
    md = dcp_md(c)
    data = os.path.join(c, meta_of(c)["data"], "dcp")
    for info in md.storage_data.values():
        shutil.copy(os.path.join(data, info.relative_path), os.path.join(data, "extra.distcp"))
        info.relative_path = "extra.distcp"
        break
    put_md(c, md)
    assert "which meta.json does not list" in export_error(c, str(tmp_path / "out"))


@pytest.mark.gloo
def test_symlinked_data_folder_or_file_is_refused(ckpts, tmp_path):
    other = str(ckpts / "other")
    om = meta_of(other)
    c = copy(ckpts, tmp_path, "dir")
    meta = meta_of(c)
    dcp = os.path.join(c, meta["data"], "dcp")
    shutil.rmtree(dcp)
    os.symlink(os.path.join(other, om["data"], "dcp"), dcp)
    meta["files"].update({k: v for k, v in om["files"].items() if k.startswith("dcp/")})  # the other's CRCs
    write_meta(c, meta)
    assert "symbolic link" in export_error(c, str(tmp_path / "out1"))
    c2 = copy(ckpts, tmp_path, "file")
    meta = meta_of(c2)
    shard = next(k for k in meta["files"] if k.endswith(".distcp"))
    f = os.path.join(c2, meta["data"], shard)
    os.unlink(f)
    os.symlink(os.path.join(other, om["data"], shard), f)
    meta["files"][shard] = om["files"][shard]
    write_meta(c2, meta)
    assert "symbolic link" in export_error(c2, str(tmp_path / "out2"))
    c3 = copy(ckpts, tmp_path, "devzero")
    meta = meta_of(c3)
    f = os.path.join(c3, meta["data"], shard)
    os.unlink(f)
    os.symlink("/dev/zero", f)
    start = time.monotonic()
    assert "symbolic link" in export_error(c3, str(tmp_path / "out3"))
    assert time.monotonic() - start < 10
    # the whole version folder a link to the other checkpoint's, its meta.json copied in
    c4 = copy(ckpts, tmp_path, "version")
    meta = meta_of(c4)
    shutil.rmtree(os.path.join(c4, meta["data"]))
    os.symlink(os.path.join(other, om["data"]), os.path.join(c4, om["data"]))
    write_meta(c4, {**om})
    assert "symbolic link" in export_error(c4, str(tmp_path / "out4"))


@pytest.mark.gloo
@pytest.mark.parametrize("what", ["shard", "metadata", "meta.json"])
def test_a_fifo_in_the_checkpoint_fails_at_once(ckpts, tmp_path, what):
    c = copy(ckpts, tmp_path)
    meta = meta_of(c)
    rel = {"shard": next(k for k in meta["files"] if k.endswith(".distcp")), "metadata": "dcp/.metadata"}.get(what)
    f = os.path.join(c, "meta.json") if rel is None else os.path.join(c, meta["data"], rel)
    os.unlink(f)
    os.mkfifo(f)
    start = time.monotonic()
    msg = export_error(c, str(tmp_path / "out"))
    assert msg and "FIFO" in msg, msg
    assert time.monotonic() - start < 10


def load_each(paths):
    """Load each checkpoint into one job; each one's error line (None where it loaded)."""
    w = _wrap()
    out = []
    for p in paths:
        try:
            w.load(p)
            out.append(None)
        except HybridError as e:
            out.append(str(e))
    return out


# --- 2. export: what it writes is what load would restore ------------------------------------------
def _md_edit(kind):
    def edit(md, meta):
        key = _first_param(md)
        entry = md.state_dict_metadata[key]
        if kind == "larger":
            entry.size = torch.Size([entry.size[0] * 2, *entry.size[1:]])
        elif kind == "smaller":
            entry.size = torch.Size([entry.size[0] // 2, *entry.size[1:]])
            entry.chunks[0].sizes = entry.size
        elif kind == "dtype":
            entry.properties.dtype = torch.int8
        elif kind == "huge":          # 256 TiB declared, in both tables
            entry.size = torch.Size([1 << 24, 1 << 22])
            entry.chunks[0].sizes = entry.size
            meta["params"][key[len("model."):]][0] = list(entry.size)
    return edit


@pytest.mark.gloo
@pytest.mark.parametrize("kind,match", [
    ("larger", "chunks do not cover its shape"), ("smaller", "stored with shape"),
    ("dtype", "is stored as torch.int8"), ("huge", "stored in")])
def test_export_holds_metadata_to_the_params_table(ckpts, tmp_path, kind, match):
    c = copy(ckpts, tmp_path)
    md, meta = dcp_md(c), meta_of(c)
    _md_edit(kind)(md, meta)
    write_meta(c, meta)
    put_md(c, md)
    start = time.monotonic()
    msg = export_error(c, str(tmp_path / "out"))
    assert msg and match in msg, msg
    assert time.monotonic() - start < 10 and not (tmp_path / "out").exists()


@pytest.mark.gloo
@pytest.mark.parametrize("edit,match", [
    (lambda m: m.update(params={}), "'params' is not a non-empty object"),
    (lambda m: m["model"]["decoder"].update(style="mamba"), "style 'mamba'"),
    (lambda m: m["model"]["decoder"].update(bogus=1), "not a decoder hybrid writes"),
    (lambda m: m.update(files=[1, 2]), "'files' is not a non-empty object"),
    (lambda m: m.update(tied="x"), "'tied' is not a list"),
    (lambda m: m.update(step="3"), "'step' is '3'"),
    (lambda m: m.update(model=[]), "'model' is []"),
    (lambda m: m.update(params={"embed.weight": [[1e30], "float32"]}), "lists 'embed.weight' as"),
    (lambda m: m.update(data="../other"), "'data' is '../other'"),
    (lambda m: m["files"].update({"/etc/passwd": [1, 1]}), "not a relative path"),
])
def test_ill_typed_meta_json_is_one_line(ckpts, tmp_path, edit, match):
    c = copy(ckpts, tmp_path)
    meta = meta_of(c)
    edit(meta)
    write_meta(c, meta)
    msg = export_error(c, str(tmp_path / "out"))
    assert msg and match in msg, msg


@pytest.mark.gloo
def test_deeply_nested_or_huge_meta_json_is_one_line(ckpts, tmp_path):
    c = copy(ckpts, tmp_path)
    with open(os.path.join(c, "meta.json"), "w") as f:
        f.write("[" * 100000 + "]" * 100000)
    assert "nested deeper" in export_error(c, str(tmp_path / "out"))
    with open(os.path.join(c, "meta.json"), "w") as f:
        f.truncate(65 << 20)
    assert "larger than" in export_error(c, str(tmp_path / "out"))


@pytest.mark.gloo
def test_export_never_into_or_over_the_checkpoint(ckpts, tmp_path):
    c = copy(ckpts, tmp_path, "ck")
    before = sorted(os.listdir(c))
    for out in (c, str(tmp_path), os.path.join(c, "inside"), os.path.join(c, meta_of(c)["data"])):
        msg = export_error_overwrite(c, out)
        assert msg and "the checkpoint" in msg and ("contains" in msg or "inside" in msg or " is " in msg), msg
    assert sorted(os.listdir(c)) == before and export_error(c, str(tmp_path / "fine")) is None
    os.symlink(c, tmp_path / "alias")                      # the same folder under another name
    assert "the checkpoint" in export_error_overwrite(c, str(tmp_path / "alias"))
    rc, out, err = _cli(["export", c, c, "--overwrite"])
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and sorted(os.listdir(c)) == before


def export_error_overwrite(ckpt, out):
    from hybrid.ckpt.export import export
    try:
        export(ckpt, out, overwrite=True)
    except HybridError as e:
        return str(e)
    return None


@pytest.mark.gloo
def test_export_files_follow_the_umask(ckpts, tmp_path):
    c = copy(ckpts, tmp_path)
    old = os.umask(0o022)
    try:
        assert export_error(c, str(tmp_path / "out")) is None
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "out").st_mode) == 0o755
    for f in os.listdir(tmp_path / "out"):
        assert stat.S_IMODE(os.stat(tmp_path / "out" / f).st_mode) == 0o644, f


EXPORT_THEN_SIGTERM = """
import os, signal, sys, threading, time
sys.path.insert(0, {root!r})
from hybrid.ckpt.export import export
parent, out = {parent!r}, {out!r}
def killer():
    while not [d for d in os.listdir(parent) if d.startswith(".out.")]:
        time.sleep(0.0005)
    os.kill(os.getpid(), signal.{sig})
threading.Thread(target=killer, daemon=True).start()
before = signal.getsignal(signal.SIGTERM)
try:
    export({ckpt!r}, out, max_shard="8KiB")
except (SystemExit, KeyboardInterrupt) as e:
    print("interrupted", type(e).__name__, signal.getsignal(signal.SIGTERM) == before)
    sys.exit(3)
print("finished")
"""


@pytest.mark.gloo
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_an_interrupted_export_leaves_no_temporary_folder(ckpts, tmp_path, sig):
    c = copy(ckpts, tmp_path)
    parent = tmp_path / "outs"
    parent.mkdir()
    script = EXPORT_THEN_SIGTERM.format(root=ROOT, parent=str(parent), out=str(parent / "out"), ckpt=c, sig=sig)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "interrupted" in proc.stdout and "True" in proc.stdout, (proc.stdout, proc.stderr[-2000:])
    assert os.listdir(parent) == []


EXPORT_FULL_DISK = """
import os, resource, signal, sys
sys.path.insert(0, {root!r})
from hybrid.errors import HybridError
from hybrid.ckpt.export import export
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)      # writes past the limit fail with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (65536, resource.RLIM_INFINITY))
try:
    export({ckpt!r}, {out!r})
except HybridError as e:
    print("ERROR", str(e))
"""


@pytest.mark.gloo
def test_a_full_disk_during_export_is_one_line_and_leaves_nothing(ckpts, tmp_path):
    c = copy(ckpts, tmp_path)
    parent = tmp_path / "outs"
    parent.mkdir()
    script = EXPORT_FULL_DISK.format(root=ROOT, ckpt=c, out=str(parent / "out"))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("ERROR")]
    assert proc.returncode == 0 and len(lines) == 1 and "cannot write" in lines[0], (proc.stdout, proc.stderr[-2000:])
    assert os.listdir(parent) == []


# --- 3. load: one line, and nothing changed before everything is checked ----------------------------
def _state(w):
    return {k: v.detach().clone() for k, v in w.state_dict().items()}


def load_crafted(paths):
    """Each crafted checkpoint into one job: the error lines, and whether the job was left as it was."""
    import random
    w = _wrap(scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 3))
    _train(w)
    out = []
    for p in paths:
        before, opt, rng = _state(w), repr(w.engine.user_optimizer.state_dict()), random.getstate()
        steps, sched = w.step_count, w.scheduler.state_dict()
        try:
            w.load(p)
            out.append((None, True))
        except HybridError as e:
            same = (all(torch.equal(v, _state(w)[k]) for k, v in before.items())
                    and repr(w.engine.user_optimizer.state_dict()) == opt and random.getstate() == rng
                    and w.step_count == steps and w.scheduler.state_dict() == sched)
            out.append((str(e), same))
    return out


def _plain(c, rel, obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    meta = meta_of(c)
    with open(os.path.join(c, meta["data"], rel), "wb") as f:
        f.write(buf.getvalue())
    refit(c, rel)


def _tamper_item(c):
    """A shard whose first tensor item is replaced by a tensor of another shape (CRC refitted)."""
    md = dcp_md(c)
    meta = meta_of(c)
    key = _first_param(md)
    info = next(v for k, v in md.storage_data.items() if k.fqn == key)
    f = os.path.join(c, meta["data"], "dcp", info.relative_path)
    data = bytearray(open(f, "rb").read())
    buf = io.BytesIO()
    torch.save(torch.zeros(3), buf)
    item = buf.getvalue()
    data[info.offset:info.offset + len(item)] = item
    open(f, "wb").write(bytes(data))
    refit(c, f"dcp/{info.relative_path}")


CRAFTED = {
    "loop-list": lambda c: _plain(c, "loop.pt", [1, 2]),
    "loop-steps": lambda c: _plain(c, "loop.pt", {"optimizer_steps": "many", "scheduler": None, "scaler": None}),
    "loop-scheduler": lambda c: _plain(c, "loop.pt", {"optimizer_steps": 1, "scheduler": {"step_size": "x"}}),
    "rng-short": lambda c: _plain(c, "rng-0.pt", {"python": (3, (1, 2), None), "torch": torch.zeros(3)}),
    "rng-torch": lambda c: _plain(c, "rng-0.pt", {"python": __import__("random").getstate(),
                                                  "torch": torch.zeros(5, dtype=torch.uint8)}),
    "rng-list": lambda c: _plain(c, "rng-0.pt", [1]),
    "meta-step": lambda c: write_meta(c, {**meta_of(c), "step": -1}),
    "meta-world": lambda c: write_meta(c, {**meta_of(c), "world_size": "1"}),
    "meta-extra": lambda c: write_meta(c, {**meta_of(c), "extra": [1]}),
    "item-shape": _tamper_item,
}


@pytest.mark.gloo
def test_a_failed_load_is_one_line_and_leaves_the_job_as_it_was(ckpts, tmp_path):
    paths = []
    for name, craft in CRAFTED.items():
        c = copy(ckpts, tmp_path, name)
        craft(c)
        paths.append(c)
    for (msg, same), name in zip(run_ranks(1, load_crafted, paths)[0], CRAFTED):
        assert msg is not None and "\n" not in msg, (name, msg)
        assert same, (name, msg)


# --- 4. optimizer differences a user makes on purpose ------------------------------------------------
def save_plain_sgd(path, strategy):
    w = _wrap(strategy, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    _train(w)
    w.save(path)


def save_frozen(path):
    w = _wrap(frozen=("embed", "blocks.0"))
    _train(w)
    w.save(path)
    return {k: v.clone() for k, v in w.state_dict().items()}


def resume_with(path, kind, strategy="ddp"):
    import logging
    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logging.getLogger("hybrid").addHandler(handler)
    logging.getLogger("hybrid").setLevel(logging.INFO)
    try:
        if kind == "momentum":
            w = _wrap(strategy, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), seed=3)
        else:
            w = _wrap(strategy, seed=3)
        w.load(path)
        state = {k: v.clone() for k, v in w.state_dict().items()}
        _train(w)                                              # and it trains on
    finally:
        logging.getLogger("hybrid").removeHandler(handler)
    return records, state


def optimizer_changes(tmp):
    """In one job: SGD saved without momentum, resumed with it (ddp, fsdp); AdamW saved with frozen
    parameters, resumed with all of them trainable."""
    save_plain_sgd(os.path.join(tmp, "sgd"), "ddp")
    out = {s: resume_with(os.path.join(tmp, "sgd"), "momentum", s)[0] for s in ("ddp", "fsdp")}
    saved = save_frozen(os.path.join(tmp, "frozen"))
    records, loaded = resume_with(os.path.join(tmp, "frozen"), "unfrozen")
    out["unfrozen"] = records
    out["same"] = all(torch.equal(saved[k], loaded[k]) for k in saved)
    return out


@pytest.mark.gloo
def test_added_momentum_and_unfrozen_parameters_start_fresh_with_one_log_line(tmp_path):
    out = run_ranks(1, optimizer_changes, str(tmp_path))[0]
    for s in ("ddp", "fsdp"):
        assert any("no optimizer state momentum_buffer" in r and "starts fresh" in r for r in out[s]), out[s]
    assert any("no optimizer state" in r and "exp_avg" in r and "starts fresh" in r for r in out["unfrozen"]), out
    assert out["same"]


# --- 5. save: deletes only what it can prove it wrote; a full disk is one line -----------------------
def save_n(path, n, keep_copy):
    w = _wrap()
    for i in range(n):
        _train(w)
        w.save(path)
        if i == 0 and keep_copy:
            data = meta_of(path)["data"]
            shutil.copytree(os.path.join(path, data), os.path.join(path, data + "-mine"))
            with open(os.path.join(path, ".meta.json.deadbeef"), "w") as f:
                f.write("left by a save that crashed")
    return sorted(os.listdir(path))


def save_with_small_fsize(path, limit):
    import resource
    import signal
    w = _wrap()
    _train(w)
    w.save(path)                                    # a first version, in force
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # writes past the limit fail with EFBIG, as a full disk does
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    _train(w)
    try:
        w.save(path)
    except HybridError as e:
        return str(e)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def save_cases(copy_dir, full_dir):
    return save_n(copy_dir, 3, True), save_with_small_fsize(full_dir, 4096), load_each([full_dir])


@pytest.mark.gloo
def test_save_keeps_a_users_copy_of_a_version_and_cleans_its_temp_files_and_a_full_disk_is_one_line(tmp_path):
    p = str(tmp_path / "c")
    entries, msg, loaded = run_ranks(1, save_cases, p, str(tmp_path / "full"))[0]
    mine = [e for e in entries if e.endswith("-mine")]
    assert len(mine) == 1 and os.path.isfile(os.path.join(p, mine[0], "HYBRID_DATA"))
    assert ".meta.json.deadbeef" not in entries
    ours = [e for e in entries if e.startswith("data-") and not e.endswith("-mine")]
    assert ours == [meta_of(p)["data"]]
    p = str(tmp_path / "full")
    assert msg and "cannot write checkpoint" in msg and "previous version is still in force" in msg, msg
    assert [e for e in os.listdir(p) if e.startswith("data-")] == [meta_of(p)["data"]]
    assert not [e for e in os.listdir(p) if e.startswith(".meta.json.")]
    assert loaded == [None]


# --- 6. job files and flags: tests/test_safety_input.py (no torch) ---------------------------------


@pytest.mark.gloo
def test_a_tensor_in_more_pieces_than_ranks_is_refused_at_once(ckpts, tmp_path):
    """Chunk checks are pairwise: 200,000 crafted chunks of one tensor (each with a storage entry
    on the same bytes) would take hours. hybrid writes at most one chunk per rank that saved it."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    c = copy(ckpts, tmp_path)
    md = dcp_md(c)
    name = _first_param(md)
    entry = md.state_dict_metadata[name]
    rows, cols = entry.size
    some = next(iter(md.storage_data.values()))
    entry.chunks = [ChunkStorageMetadata(offsets=torch.Size([i, j]), sizes=torch.Size([1, 1]))
                    for i in range(rows) for j in range(cols)]            # covers the shape exactly once
    for ch in entry.chunks:
        md.storage_data[MetadataIndex(name, ch.offsets)] = _StorageInfo(some.relative_path, 0, 4)
    put_md(c, md)
    start = time.monotonic()
    assert "hybrid writes at most" in export_error(c, str(tmp_path / "out"))
    assert time.monotonic() - start < 10


@pytest.mark.gloo
def test_overwrite_replaces_an_earlier_export_never_other_files(ckpts, tmp_path):
    c = copy(ckpts, tmp_path)
    models = tmp_path / "models"
    models.mkdir()
    (models / "other-model.safetensors").write_bytes(b"mine")
    msg = export_error_overwrite(c, str(models))
    assert msg and "other-model.safetensors" in msg and "only an earlier export" in msg
    assert (models / "other-model.safetensors").read_bytes() == b"mine"
    out = str(tmp_path / "export")
    assert export_error(c, out) is None
    first = sorted(os.listdir(out))
    assert export_error_overwrite(c, out) is None           # an earlier export is replaced
    assert sorted(os.listdir(out)) == first


@pytest.mark.gloo
def test_a_decoder_type_hybrid_does_not_write_is_one_line(ckpts, tmp_path):
    c = copy(ckpts, tmp_path)
    meta = meta_of(c)
    meta["model"]["decoder"]["hf_model_type"] = "x"
    write_meta(c, meta)
    msg = export_error(c, str(tmp_path / "out"))
    assert msg and "'x'" in msg and not (tmp_path / "out").exists()


RANK0_DIES = """
import os, sys
sys.path.insert(0, {root!r})
from hybrid.errors import HybridError
from hybrid.runtime.launch import run_ranks
from tests.test_safety_files import rank0_dies_first
if __name__ == "__main__":
    try:
        run_ranks(2, rank0_dies_first)
    except HybridError as e:
        print("hybrid: error:", e)
"""


def rank0_dies_first():
    os.environ["HYBRID_TIMEOUT"] = "2"
    if os.environ["RANK"] == "0":          # before it hosts the rendezvous store
        raise HybridError("rank 0 found its input wrong")
    _wrap()


@pytest.mark.gloo
def test_rank0_dying_first_gives_the_clear_line_without_a_cpp_stack_dump(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TORCH_CPP_LOG_LEVEL"}
    proc = subprocess.run([sys.executable, "-c", RANK0_DIES.format(root=ROOT)], capture_output=True, text=True,
                          timeout=120, env=env, cwd=str(tmp_path))
    assert "hybrid: error: rank 0 found its input wrong" in proc.stdout, (proc.stdout, proc.stderr[-2000:])
    assert "frame #" not in proc.stderr and "Exception raised from" not in proc.stderr, proc.stderr[-2000:]
    assert "TORCH_CPP_LOG_LEVEL" not in os.environ or os.environ.get("TORCH_CPP_LOG_LEVEL") != "FATAL"


@pytest.mark.gloo
def test_ctrl_c_during_cli_export_is_one_line_and_leaves_nothing(ckpts, tmp_path):
    import signal
    c = copy(ckpts, tmp_path)
    parent = tmp_path / "outs"
    parent.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "hybrid.cli", "export", c, str(parent / "out"),
                             "--max-shard-size", "8KiB"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 120
    while not [d for d in os.listdir(parent) if d.startswith(".out.")] and proc.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.0005)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and err.strip() == "hybrid: interrupted" and out == "", (proc.returncode, err[-2000:])
    left = os.listdir(parent)       # nothing, or (Ctrl-C after the final rename) the whole export
    assert left == [] or (left == ["out"] and (parent / "out" / "model.safetensors.index.json").exists()), left


FACTORY = "import sys\ndef exits():\n    sys.exit(0)\ndef exits_on_import():\n    pass\n"


@pytest.mark.torch                  # a factory builds a torch module
def test_a_factory_raising_system_exit_is_a_clear_error(tmp_path):
    (tmp_path / "exitfactories.py").write_text(FACTORY)
    (tmp_path / "exitmodule.py").write_text("import sys\nsys.exit(0)\ndef f():\n    pass\n")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
    for spec, match in (("exitfactories:exits", "raised SystemExit"), ("exitmodule:f", "SystemExit")):
        rc, out, err = _cli(["plan", spec, "--json"], env=env)
        assert rc == 2 and out == "" and match in err and len(err.strip().splitlines()) == 1, (spec, rc, err)


@pytest.mark.torch                  # hybrid.ckpt.export reads checkpoints with torch
def test_export_leaves_an_ignored_hangup_ignored():
    """`nohup hybrid export ...`: the export's cleanup handlers never replace an ignored SIGHUP."""
    import signal

    from hybrid.ckpt.export import _signals_unwind
    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with _signals_unwind():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, old)
