"""Every file a user names or an environment variable points to (config.json, job file,
calibration, strategy folders) is read through config/files: a FIFO, device or folder is refused
before it is read, a huge file after its cap, deep nesting in one line, each within seconds."""
import json
import os
import subprocess
import sys
import time

import pytest

from hybrid.cli.main import main
from hybrid.config.files import JSON_LIMITS, YAML_LIMITS, load_json, read_bytes
from hybrid.errors import HybridError

pytestmark = [pytest.mark.safety, pytest.mark.unit]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cli(argv, env=None):
    """`hybrid` in a fresh process, killed past 10 s (a FIFO read would block forever)."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "hybrid.cli", *argv], capture_output=True, text=True, cwd=ROOT,
                          timeout=10, env={**os.environ, "PYTHONPATH": ROOT, **(env or {})})
    return proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start


def _one_line(rc, out, err):
    lines = [ln for ln in err.splitlines() if ln.strip()]
    return rc == 2 and out == "" and len(lines) == 1 and lines[0].startswith("hybrid: error: ") \
        and "Traceback" not in err and "cannot read" not in err       # the refusal is said once, not wrapped


def _run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def fifo(tmp_path):
    def make(name):
        path = tmp_path / name
        os.mkfifo(path)
        return str(path)
    return make


def test_a_fifo_as_config_json_is_refused(fifo):
    rc, out, err, _ = _cli(["plan", fifo("config.json"), "--json"])
    assert _one_line(rc, out, err) and "is a FIFO" in err, err


def test_a_folder_holding_a_fifo_config_json_is_refused(tmp_path, fifo):
    fifo("config.json")
    rc, out, err, _ = _cli(["plan", str(tmp_path), "--json"])
    assert _one_line(rc, out, err) and "is a FIFO" in err, err


def test_a_fifo_as_calibration_flag_or_variable_is_refused(fifo):
    path = fifo("cal.yaml")
    for argv, env in ((["--calibration", path], None), ([], {"HYBRID_CALIBRATION": path})):
        rc, out, err, _ = _cli(["plan", "gpt2", *argv, "--json"], env)
        assert _one_line(rc, out, err) and "calibration file" in err and "is a FIFO" in err, err


@pytest.mark.slow
def test_a_fifo_in_a_strategy_folder_flag_or_variable_is_refused(tmp_path, fifo):
    fifo("s.yaml")
    for argv, env in ((["--strategies-dir", str(tmp_path)], None), ([], {"HYBRID_STRATEGIES": str(tmp_path)})):
        rc, out, err, _ = _cli(["plan", "gpt2", *argv, "--json"], env)
        assert _one_line(rc, out, err) and "strategy file" in err and "is a FIFO" in err, err


def test_a_fifo_or_file_as_the_strategy_folder_is_refused(fifo, capsys):
    rc, out, err = _run(capsys, "plan", "gpt2", "--strategies-dir", fifo("dir"), "--json")
    assert _one_line(rc, out, err) and "is not a folder" in err, err


def test_a_fifo_as_job_file_is_refused(fifo):
    rc, out, err, _ = _cli(["plan", "gpt2", "--config", fifo("job.yaml"), "--json"])
    assert _one_line(rc, out, err) and "is a FIFO" in err, err


def test_a_device_or_a_folder_as_calibration_is_refused(tmp_path, capsys):
    for path, kind in (("/dev/zero", "a device"), (str(tmp_path), "a folder")):
        rc, out, err = _run(capsys, "plan", "gpt2", "--calibration", path, "--json")
        assert _one_line(rc, out, err) and kind in err, err


def test_a_100mb_calibration_file_is_refused_at_its_cap(tmp_path):
    cal = tmp_path / "cal.yaml"
    with open(cal, "wb") as f:
        f.write(b"version: 2\n")
        f.truncate(100 << 20)                       # sparse: 100 MB on disk in name only
    rc, out, err, took = _cli(["plan", "gpt2", "--calibration", str(cal), "--json"])
    assert _one_line(rc, out, err) and f"larger than {YAML_LIMITS['bytes']} bytes" in err, err
    assert took < 5


def test_a_300mb_config_json_is_refused_at_its_cap(tmp_path):
    cfg = tmp_path / "config.json"
    with open(cfg, "wb") as f:
        f.write(b'{"model_type": "llama", "pad": "')
        f.truncate(300 << 20)
    rc, out, err, took = _cli(["plan", str(cfg), "--json"])
    assert _one_line(rc, out, err) and f"larger than {JSON_LIMITS['bytes']} bytes" in err, err
    assert took < 5


def test_a_deeply_nested_calibration_file_is_one_line(tmp_path, capsys):
    cal = tmp_path / "cal.yaml"
    for text in ("job: " + "[" * 100_000 + "]" * 100_000 + "\n", "job:\n" + "".join(
            " " * (2 * i) + f"k{i}:\n" for i in range(1, 200)) + " " * 400 + "x: 1\n"):
        cal.write_text(text)
        rc, out, err = _run(capsys, "plan", "gpt2", "--calibration", str(cal), "--json")
        assert _one_line(rc, out, err) and "levels of nesting" in err, err


def test_a_deeply_nested_config_json_is_one_line(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    for depth in (40, 100_000):
        cfg.write_text('{"model_type": "llama", "x": ' + "[" * depth + "]" * depth + "}")
        rc, out, err = _run(capsys, "plan", str(cfg), "--json")
        assert _one_line(rc, out, err) and "nested deeper than 32 levels" in err, err


def test_load_json_counts_values_and_levels():
    assert load_json('{"a": [1, {"b": 2}]}') == {"a": [1, {"b": 2}]}
    with pytest.raises(ValueError, match="more than 10 values"):
        load_json(json.dumps(list(range(20))), {**JSON_LIMITS, "values": 10})
    with pytest.raises(ValueError, match="deeper than 3"):
        load_json("[[[[]]]]", {**JSON_LIMITS, "depth": 3})
    with pytest.raises(ValueError):
        load_json("1" * 5000)                       # an integer of 5,000 digits: Python refuses to parse it


def test_read_bytes_refuses_before_opening(tmp_path):
    (tmp_path / "f").write_bytes(b"x" * 11)
    assert read_bytes(str(tmp_path / "f"), "thing", 11, "") == b"x" * 11
    with pytest.raises(HybridError, match="thing .* is larger than 10 bytes; small"):
        read_bytes(str(tmp_path / "f"), "thing", 10, "small")
    with pytest.raises(HybridError, match="does not exist"):
        read_bytes(str(tmp_path / "nope"), "thing", 10, "")
