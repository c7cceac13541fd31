"""The YAML catalogue: shipped presets load, user files are validated with file and line."""
import pytest

from hybrid.families.catalogue import load_catalogue
from hybrid.layout.dims import validate_shard_size
from hybrid.config.cluster import Cluster
from hybrid.errors import HybridError

pytestmark = pytest.mark.unit

REQUIRED = {"ddp", "fsdp", "hsdp", "zero1", "zero2", "zero3", "zero2-offload", "zero3-offload",
            "zero3-offload-params", "zero3-hpz"}


def test_shipped_catalogue():
    cat = load_catalogue()
    assert REQUIRED <= set(cat)
    assert list(cat)[0] == "ddp"  # ordered simplest first
    cl = Cluster.build(4, 8)
    assert cat["hsdp"].shard_size(cl) == 8 and cat["fsdp"].shard_size(cl) == 32
    assert cat["hsdp"].shard_size(cl, override=16) == 16
    assert cat["zero3-hpz"].config.hpz_size(cl) == 8


def test_user_directory_overrides_and_adds(tmp_path):
    (tmp_path / "mine.yaml").write_text("name: hsdp-2\nfamily: fsdp\nshard: 2\n")
    (tmp_path / "zero2.yaml").write_text("name: zero2\nfamily: deepspeed\nstage: 2\nreduce_bucket_size: 1000\n")
    cat = load_catalogue([str(tmp_path)])
    assert cat["hsdp-2"].shard_size(Cluster.build(1, 8)) == 2
    assert cat["zero2"].config.reduce_bucket_size == 1000


@pytest.mark.parametrize("text,match", [
    ("name: x\nfamily: fsdp\nshard: world\nbucket_size: 3\n", r"bad.yaml:4: unknown key 'bucket_size' for family fsdp"),
    ("name: x\nfamily: tpu\n", r"bad.yaml:2: family 'tpu' must be one of"),
    ("name: x\nfamily: deepspeed\nstage: 4\n", "stage must be 1, 2 or 3, got 4"),
    ("name: x\nfamily: fsdp\nreshard_after_forward: maybe\n", r"bad.yaml:3: reshard_after_forward must be bool"),
    ("name: x\nfamily: deepspeed\nstage: 1\noffload_optimizer: true\n", "only with stage 2 or 3"),
    ("name: x\nfamily: ddp\nshard: node\n", "ddp does not shard"),
    ("name: x\nfamily: fsdp\nshard: -2\n", "must be none, node, world or a positive integer"),
    ("[1, 2]\n", "must be a mapping"),
])
def test_bad_files(tmp_path, text, match):
    (tmp_path / "bad.yaml").write_text(text)
    with pytest.raises(HybridError, match=match):
        load_catalogue([str(tmp_path)])


def test_missing_directory():
    with pytest.raises(HybridError, match="strategy directory '/nope' does not exist"):
        load_catalogue(["/nope"])


@pytest.mark.parametrize("n,world,per_node,match", [
    (3, 8, 8, "world size 8 is not divisible by shard size 3"),
    (16, 8, 8, "shard size 16 is larger than the world size 8"),
    (4, 24, 6, "does not divide the 6 GPUs per node"),
    (12, 48, 8, "not a whole number of nodes"),
])
def test_shard_size_rules(n, world, per_node, match):
    with pytest.raises(HybridError, match=match):
        validate_shard_size(n, world, per_node)
    validate_shard_size(per_node, world, per_node)
    validate_shard_size(world, world, per_node)


def test_each_family_owns_a_typed_config_validated_where_it_is_made():
    from dataclasses import fields

    from hybrid.families.catalogue import Strategy
    from hybrid.families.deepspeed import DeepSpeedConfig
    from hybrid.families.fsdp import FSDPConfig
    cat = load_catalogue()
    assert isinstance(cat["zero3-hpz"].config, DeepSpeedConfig) and cat["zero3-hpz"].config.hpz == "node"
    assert isinstance(cat["hsdp"].config, FSDPConfig) and not hasattr(cat["hsdp"].config, "stage")
    assert not {"stage", "hpz", "bucket_cap_mb", "reshard_after_forward"} & {f.name for f in fields(Strategy)}
    with pytest.raises(HybridError, match="offload_params needs stage 3, got stage 2"):
        DeepSpeedConfig(stage=2, offload_params=True)
    with pytest.raises(HybridError, match=r"<builtin>: strategy 'x': bucket_cap_mb must be a positive number of MiB"):
        Strategy("x", "ddp", shard="none", config={"bucket_cap_mb": 0})
    with pytest.raises(HybridError, match="stage is not a fsdp knob; its knobs: offload_optimizer, offload_params, "
                                          "reshard_after_forward"):
        Strategy("x", "fsdp", config={"stage": 3})
    with pytest.raises(HybridError, match="config must be a DDPConfig, got FSDPConfig"):
        Strategy("x", "ddp", shard="none", config=FSDPConfig())
    assert Strategy("x", "fsdp").config == FSDPConfig()            # the family's defaults

