"""Property-based fuzzing (hypothesis) of what a user hands hybrid: tampered checkpoints (export
and load), job files and CLI arguments. The properties: a one-line HybridError or a correct
result; no other exception, no hang, nothing read or written outside the given paths, no export
that differs from the checkpoint's own tensors.

The suite runs a bounded, derandomised number of examples (well under a minute); a longer,
random search is one variable away:

    HYBRID_FUZZ_EXAMPLES=2000 .venv/bin/python -m pytest tests/test_fuzz.py
"""
import contextlib
import io
import json
import os
import pickle
import shutil
import sys
import tempfile
import time
import zlib
from datetime import timedelta

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is in the dev extra: pip install -e '.[dev]'")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from hybrid.errors import HybridError  # noqa: E402

pytestmark = pytest.mark.safety
LONG = int(os.environ.get("HYBRID_FUZZ_EXAMPLES", "0"))


def fuzz(examples: int):
    """Hypothesis settings: `examples` derandomised in the suite, HYBRID_FUZZ_EXAMPLES random ones
    when it is set."""
    return settings(max_examples=LONG or examples, derandomize=not LONG, deadline=timedelta(seconds=30),
                    suppress_health_check=list(HealthCheck), database=None)


# --- values a careless or hostile user writes -----------------------------------------------------------
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                    st.text(max_size=40), st.sampled_from(["", "0", "-1", "1e-320", ".inf", "nan", "on", "off",
                                                           "../../etc/passwd", "a100-80gb", "bf16-mixed",
                                                           "layer:0", "layer:2", "x" * 300]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)


# --- job files --------------------------------------------------------------------------------------
@pytest.mark.unit
@fuzz(150)
@given(job=st.dictionaries(st.one_of(st.sampled_from(
    ["model", "params", "nodes", "gpus_per_node", "gpu", "gpu_memory", "host_memory", "expandable_segments",
     "headroom", "micro_batch", "seq_len", "gradient_accumulation", "precision", "optimizer",
     "activation_checkpointing", "attention", "shard_size", "tp", "pp", "schedule", "method", "implementation",
     "efficiency", "strategies_dir", "strategy"]), st.text(max_size=12)), values, max_size=6))
@pytest.mark.slow
def test_job_files_are_checked_or_one_line(job):
    import yaml

    from hybrid.config.jobfile import OPTIONS, load_job
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "job.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(job, f)
        start = time.monotonic()
        try:
            out = load_job(path)
        except HybridError as e:
            assert "\n" not in str(e) and len(str(e)) < 700
            return
        assert time.monotonic() - start < 2
        for k, v in out.items():          # what passed is of the option's type and range
            assert OPTIONS[k].check(v) == v


@pytest.mark.unit
@fuzz(150)
@given(text=st.one_of(st.text(max_size=400), st.binary(max_size=400).map(lambda b: b.decode("latin-1")),
                      st.lists(st.sampled_from(["a: &a [1,2]", "b: *a", "<<: *a", "- ", "{", "[", "? x", "nodes: 8",
                                               "!!python/object:os.system", "!!binary AAAA", "&x", "*x", ": :",
                                               "'", "\t", "---", "..."]), max_size=30).map("\n".join)))
@pytest.mark.slow
def test_any_job_file_text_is_read_or_one_line(text):
    from hybrid.config.jobfile import load_job
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "job.yaml")
        with open(path, "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write(text)
        try:
            load_job(path)
        except HybridError as e:
            assert "\n" not in str(e)


# --- CLI arguments ------------------------------------------------------------------------------------
FLAGS = ["--nodes", "--gpus-per-node", "--gpu", "--gpu-memory", "--host-memory", "--expandable-segments",
         "--headroom", "--micro-batch", "--seq-len", "--precision", "--gradient-accumulation", "--optimizer",
         "--activation-checkpointing", "--attention", "--shard-size", "--tp", "--pp", "--schedule", "--efficiency",
         "--strategy"]
arg_values = st.one_of(st.integers(-5, 10**10).map(str), st.floats(allow_nan=True).map(repr),
                       st.sampled_from(["", "0", "1", "2", "8", "1e-320", "inf", "nan", "-1", "1e400", "on", "off",
                                        "bf16", "fp32", "selective", "layer:3", "1f1b", "ddp", "zero3", "fsdp",
                                        "80GiB", "-5GB", "h100-80gb", "a100-40gb", "0.5"]),
                       st.text(max_size=12))


@pytest.mark.unit
@fuzz(60)
@given(model=st.sampled_from([["gpt2"], ["llama2-7b"], ["--params", "7.5e9"], ["--params", "0"]]),
       pairs=st.lists(st.tuples(st.sampled_from(FLAGS), arg_values), max_size=4))
@pytest.mark.slow
def test_cli_arguments_answer_or_one_line(model, pairs):
    from hybrid.cli.main import main
    argv = ["plan", *model]
    for flag, value in pairs:
        argv.append(f"{flag}={value}")
    argv.append("--json")
    out, err = io.StringIO(), io.StringIO()
    start = time.monotonic()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    assert time.monotonic() - start < 20, argv
    lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
    if rc == 2:
        assert out.getvalue() == "" and len(lines) == 1 and lines[0].startswith("hybrid: error: "), (argv, lines)
    else:
        assert rc == 0 and json.loads(out.getvalue())["world_size"] >= 1, (argv, rc, err.getvalue()[-500:])


# --- tampered checkpoints -------------------------------------------------------------------------------
def save_good(path, secret):
    from tests.test_safety_files import _train, _wrap
    w = _wrap()
    _train(w)
    w.save(path)
    w2 = _wrap(seed=5)
    w2.save(secret)            # a checkpoint nothing may read: the traversal target


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    from hybrid.ckpt.export import export
    from hybrid.runtime.launch import run_ranks
    base = tmp_path_factory.mktemp("fuzz")
    run_ranks(1, save_good, str(base / "good"), str(base / "secret"))
    export(str(base / "good"), str(base / "reference"))
    return base


class Opens:
    """Files opened (audit hook) under a watched folder; the hook stays, it is switched by `watch`."""
    watch: str | None = None
    seen: list = []


def _audit(event, args):
    if event == "open" and Opens.watch and isinstance(args[0], (str, bytes)):
        p = os.fsdecode(args[0])
        if os.path.realpath(p).startswith(Opens.watch):
            Opens.seen.append(p)


sys.addaudithook(_audit)

META_FIELDS = ["format", "data", "files", "step", "world_size", "params", "tied", "model", "extra", "history",
               "optimizer"]


@st.composite
def tampering(draw):
    """A list of edits: (kind, details), applied in order to a copy of the good checkpoint."""
    edits = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["meta", "bytes", "md-path", "md-range", "md-size", "md-dtype", "md-chunks",
                                     "replace", "md-noop", "meta-extra", "meta-extra"]))
        edits.append((kind, draw(st.integers(0, 10**6)), draw(values), draw(st.booleans())))
    return edits


def _refit(c, meta, rel):
    with open(os.path.join(c, meta["data"], rel), "rb") as f:
        data = f.read()
    meta["files"][rel] = [len(data), zlib.crc32(data)]


def apply(c, edits):
    """Apply the edits as an attacker would (refitting sizes and CRCs when `fix`)."""
    import torch

    from hybrid.ckpt.safeio import load_metadata
    for kind, n, value, fix in edits:
        with open(os.path.join(c, "meta.json")) as f:
            meta = json.load(f)
        files = sorted(meta["files"]) if isinstance(meta.get("files"), dict) else []
        data = os.path.join(c, meta["data"]) if isinstance(meta.get("data"), str) else c
        if kind == "meta":
            field = META_FIELDS[n % len(META_FIELDS)]
            meta[field] = value
        elif kind == "meta-extra":          # edits that change nothing load or export reads
            meta["extra"] = {"note": value}
        elif kind == "bytes" and files:
            rel = files[n % len(files)]
            p = os.path.join(data, rel)
            if os.path.isfile(p):
                raw = bytearray(open(p, "rb").read())
                if raw:
                    i = n % len(raw)
                    raw[i:i + 4] = (n % 2**32).to_bytes(4, "little")
                open(p, "wb").write(bytes(raw))
                if fix:
                    _refit(c, meta, rel)
        elif kind == "replace" and files:
            rel = files[n % len(files)]
            p = os.path.join(data, rel)
            if os.path.isfile(p):
                open(p, "wb").write(pickle.dumps(value))
                if fix:
                    _refit(c, meta, rel)
        elif kind.startswith("md-") and os.path.isfile(os.path.join(data, "dcp", ".metadata")):
            try:
                md = load_metadata(open(os.path.join(data, "dcp", ".metadata"), "rb").read(), "m")
                infos = list(md.storage_data.values())
                entries = [e for e in md.state_dict_metadata.values() if hasattr(e, "chunks")]
            except (HybridError, AttributeError):
                continue
            if not infos or not entries:
                continue
            info, entry = infos[n % len(infos)], entries[n % len(entries)]
            if kind == "md-path":
                info.relative_path = ["../secret/" + info.relative_path, "/etc/passwd", "", ".", "./x",
                                      "dcp/" + info.relative_path, "../../secret", str(value)[:50],
                                      info.relative_path + "/"][n % 9]
            elif kind == "md-range":
                info.offset, info.length = [(n, info.length), (info.offset, n), (-1, info.length),
                                            (info.offset, 2**62)][n % 4]
            elif kind == "md-size":
                entry.size = torch.Size([s * (1 + n % 3) for s in entry.size][::(1 if n % 2 else -1)])
            elif kind == "md-dtype":
                entry.properties.dtype = [torch.int8, torch.float16, torch.bfloat16, torch.float64, torch.bool,
                                          torch.complex64][n % 6]
            elif kind == "md-chunks":
                entry.chunks = [entry.chunks[:0], entry.chunks * 2, [entry.chunks[0]] * (1 + n % 3)][n % 3]
            elif kind == "md-noop":            # re-pickled as it was
                pass
            with open(os.path.join(data, "dcp", ".metadata"), "wb") as f:
                pickle.dump(md, f)
            if fix and "dcp/.metadata" in meta.get("files", {}):
                _refit(c, meta, "dcp/.metadata")
        with open(os.path.join(c, "meta.json"), "w") as f:
            json.dump(meta, f)


def _tensors(path):
    from safetensors.torch import load_file
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


@pytest.mark.gloo
@fuzz(40)
@given(edits=tampering())
def test_tampered_checkpoint_exports_exactly_or_is_one_line(good, edits):
    import torch

    from hybrid.ckpt.export import export
    with tempfile.TemporaryDirectory(dir=good) as d:
        c, out = os.path.join(d, "c"), os.path.join(d, "out")
        shutil.copytree(good / "good", c)
        apply(c, edits)
        Opens.watch, Opens.seen = os.path.realpath(good / "secret"), []
        start = time.monotonic()
        try:
            export(c, out)
            ok = True
        except HybridError as e:
            assert "\n" not in str(e)
            ok = False
        finally:
            Opens.watch = None
        event("exported" if ok else "refused")
        assert time.monotonic() - start < 20
        assert Opens.seen == [], Opens.seen                        # nothing read outside the checkpoint
        assert sorted(os.listdir(d)) == (["c", "out"] if ok else ["c"])   # nothing else written, no temp left
        if ok:                                                     # the checkpoint's own tensors, exactly
            ref, got = _tensors(good / "reference"), _tensors(out)
            assert sorted(ref) == sorted(got)
            structural = all(k.startswith(("md-", "meta")) for k, *_ in edits)
            for k in ref:
                assert got[k].shape == ref[k].shape and got[k].dtype == ref[k].dtype, k
                if structural:
                    assert torch.equal(got[k], ref[k]), k


def load_fuzz(good, secret, examples, long):
    """In one rank: load tampered copies into one job; each is a one-line error that leaves the job
    as it was, or a load."""
    import random

    import torch

    from tests.test_safety_files import _train, _wrap
    w = _wrap()
    _train(w)
    failures = []

    @settings(max_examples=examples, derandomize=not long, deadline=None, suppress_health_check=list(HealthCheck),
              database=None)
    @given(edits=tampering())
    def check(edits):
        with tempfile.TemporaryDirectory(dir=os.path.dirname(good)) as d:
            c = os.path.join(d, "c")
            shutil.copytree(good, c)
            apply(c, edits)
            before = {k: v.clone() for k, v in w.state_dict().items()}
            rng, steps = random.getstate(), w.step_count
            Opens.watch, Opens.seen = os.path.realpath(secret), []
            try:
                w.load(c)
            except HybridError as e:
                after = w.state_dict()
                if "\n" in str(e) or not all(torch.equal(v, after[k]) for k, v in before.items()) \
                        or random.getstate() != rng or w.step_count != steps:
                    failures.append((edits, str(e)[:300]))
            finally:
                Opens.watch = None
            if Opens.seen:
                failures.append((edits, f"read {Opens.seen}"))

    check()
    return [repr(f)[:600] for f in failures]


@pytest.mark.gloo
def test_tampered_checkpoint_loads_or_is_one_line_leaving_the_job(good):
    from hybrid.runtime.launch import run_ranks
    failures = run_ranks(1, load_fuzz, str(good / "good"), str(good / "secret"), LONG or 25, bool(LONG),
                         timeout_s=3600 if LONG else 300)[0]
    assert failures == []
