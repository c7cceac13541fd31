"""The 2026 GPU catalogue (figures against the vendors' published datasheets), short names, GPU
spec files, units, and scale-up domains (NVL72 racks) in the placement rules and the links."""
import json

import pytest

from hybrid.config.cluster import GPUS, Cluster, get_gpu, gpu_names, load_gpu_spec
from hybrid.errors import HybridError
from hybrid.units import GiB, parse_bytes, parse_rate

pytestmark = pytest.mark.unit


def test_new_gpus_carry_their_datasheets_dense_figures():
    # HGX B200 datasheet (8 GPUs, with sparsity): BF16 36, FP8 72, FP4 144 PFLOP/s; dense is half
    b200 = get_gpu("b200")
    assert (b200.bf16_flops, b200.fp8_flops, b200.fp4_flops) == (36e15 / 8 / 2, 72e15 / 8 / 2, 144e15 / 8 / 2)
    assert b200.mxfp8_flops == b200.fp8_flops and b200.scale_up_domain == 8 and not b200.domain_spans_nodes
    # GB200 NVL72 datasheet (the rack, with sparsity): BF16 360, FP8 720 PFLOP/s; 576 TB/s HBM; 72 GPUs
    gb200 = get_gpu("GB200")
    assert gb200.bf16_flops * 72 * 2 == pytest.approx(360e15) and gb200.fp8_flops * 72 * 2 == pytest.approx(720e15)
    assert gb200.mem_bw * 72 == pytest.approx(576e12) and gb200.scale_up_domain == 72 and gb200.domain_spans_nodes
    # GB300 NVL72: FP4 1,080 PFLOP/s dense per rack; ConnectX-8 800 Gb/s per GPU
    gb300 = get_gpu("gb300")
    assert gb300.fp4_flops * 72 == pytest.approx(1080e15) and gb300.inter_node_bw == 800e9 / 8
    # MI300X datasheet: BF16 2,614.9 TFLOP/s with sparsity (1,307.4 dense), FP8 5,229.8 (2,614.9), 5.3 TB/s
    mi = get_gpu("mi300x")
    assert (mi.bf16_flops, mi.fp8_flops, mi.mem_bw, mi.stack) == (1307.4e12, 2614.9e12, 5.3e12, "rocm")
    assert mi.collectives == "RCCL" and mi.software == "ROCm" and not mi.mxfp8_flops
    assert get_gpu("mi355x").mxfp8_flops == get_gpu("mi355x").fp8_flops
    # Ada whitepaper: RTX 4090 BF16 (FP32 accumulate) 165.2 dense, 1,008 GB/s; no NVLink (PCIe Gen4)
    rtx = get_gpu("RTX 4090")
    assert (rtx.bf16_flops, rtx.mem_bw, rtx.intra_node_bw) == (165.2e12, 1.008e12, 32e9)
    for name in ("h200", "b300", "gb300", "mi325x", "mi355x", "l4", "rtx-5090", "l40s"):
        g = get_gpu(name)
        assert 0 < g.bf16_flops <= g.fp8_flops and g.memory_bytes > 20 * GiB, name
    # the dense figure, never the sparse one: the float8 peak is twice bf16 at most
    for g in GPUS.values():
        assert g.fp8_flops <= 2 * g.bf16_flops * 1.02, g.name


def test_names_are_case_insensitive_with_short_forms_and_a_close_match():
    assert get_gpu("H100") is GPUS["h100-80gb"] and get_gpu("h100-80GB") is GPUS["h100-80gb"]
    assert get_gpu("NVIDIA H200").name == "h200-141gb" and get_gpu("l40s").name == "l40s-48gb"
    assert get_gpu("a10g").name == "a10g-24gb" and get_gpu("rtx_4090").name == "rtx-4090-24gb"
    with pytest.raises(HybridError, match=r"^unknown GPU 'b2000': did you mean b200\? Available: a100-40gb") as e:
        get_gpu("b2000")
    assert "\n" not in str(e.value) and "--gpu-spec" in str(e.value)
    with pytest.raises(HybridError, match=r"^unknown GPU 'zzzzzz'\. Available"):
        get_gpu("zzzzzz")
    assert "b200-180gb (b200)" in gpu_names() and "mi300x-192gb (mi300x)" in gpu_names()


def test_units_are_required_and_bits_are_not_bytes():
    assert parse_rate("1.2PFLOP/s", "x", "FLOP/s") == pytest.approx(1.2e15)
    assert parse_rate("989 TFLOPS", "x", "FLOP/s") == pytest.approx(989e12)
    assert parse_rate("4TB/s", "x", "B/s") == 4e12 and parse_rate("900GB/s", "x", "B/s") == 900e9
    assert parse_rate("400Gb/s", "x", "B/s") == 50e9 and parse_rate("400Gbps", "x", "B/s") == 50e9
    for bad in ("400", "4TB", "fast", "1.2PF"):
        with pytest.raises(HybridError, match="unit"):
            parse_rate(bad, "x", "FLOP/s" if "F" in bad else "B/s")
    assert parse_bytes("80GiB", flag="--gpu-memory") == 80 * GiB and parse_bytes(80 * GiB, flag="--gpu-memory")
    with pytest.raises(HybridError, match=r"^--gpu-memory 80 has no unit .* --gpu-memory 80GiB \(binary\)"):
        parse_bytes("80", flag="--gpu-memory")
    with pytest.raises(HybridError, match="--gpu-memory 80 has no unit"):
        Cluster.build(gpu_memory="80")


SPEC = """name: my-accel
memory: 96GiB
bf16_flops: 1.2PFLOP/s
fp8_flops: 2.4PFLOP/s
memory_bandwidth: 4TB/s
scale_up_bandwidth: 900GB/s
scale_up_domain: 16
scale_out_bandwidth: 400Gb/s
"""


def test_a_gpu_spec_file_is_read_with_its_units(tmp_path):
    f = tmp_path / "gpu.yaml"
    f.write_text(SPEC)
    g = load_gpu_spec(str(f))
    assert (g.name, g.memory_bytes, g.bf16_flops, g.fp8_flops) == ("my-accel", 96 * GiB, 1.2e15, 2.4e15)
    assert (g.mem_bw, g.intra_node_bw, g.inter_node_bw, g.scale_up_domain) == (4e12, 450e9, 50e9, 16)
    c = Cluster.build(4, 8, gpu_spec=str(f))
    assert c.gpu.name == "my-accel" and c.domain == 16
    from hybrid.config.jobfile import cluster_of
    with pytest.raises(HybridError, match="both name the GPU"):
        cluster_of({"gpu": "h100", "gpu_spec": str(f)})


@pytest.mark.parametrize("edit,message", [
    (("name: my-accel\n", "name: my-accel\nflops: 3\n"), r"gpu.yaml:2: unknown key 'flops' in a GPU spec\. Allowed: "),
    (("memory: 96GiB\n", ""), "lacks memory; a GPU spec needs name, memory, bf16_flops"),
    (("memory: 96GiB", "memory: 96"), "gpu.yaml:2: memory 96 has no unit: write it with one, e.g. memory: 96GiB"),
    (("bf16_flops: 1.2PFLOP/s", "bf16_flops: 1.2PB/s"), "bf16_flops '1.2PB/s': unknown or missing unit"),
    (("scale_out_bandwidth: 400Gb/s", "scale_out_bandwidth: 400G"), "scale_out_bandwidth '400G': unknown or missing"),
    (("scale_up_domain: 16", "scale_up_domain: lots"), "scale_up_domain must be a whole number of GPUs"),
    (("name: my-accel\n", "- a\n"), "not valid YAML|must be a mapping"),
])
def test_a_bad_gpu_spec_is_one_line(tmp_path, edit, message):
    f = tmp_path / "gpu.yaml"
    f.write_text(SPEC.replace(*edit))
    with pytest.raises(HybridError, match=message) as e:
        load_gpu_spec(str(f))
    assert "\n" not in str(e.value)


def test_nvl72_racks_are_one_domain_across_their_trays():
    c = Cluster.build(36, 4, "gb200")
    assert (c.domain, c.domains, c.domain_word) == (72, 2, "NVLink domain")
    assert Cluster.build(9, 4, "gb200").domain == 36            # a part rack: its nodes are one domain
    assert Cluster.build(27, 4, "gb200").domain == 36           # racks of 18 tiled by 9-tray blocks
    assert Cluster.build(2, 8, "b200").domain == 8 and Cluster.build(4, 2, "h100").domain == 2   # HGX: the node
    assert Cluster.build(4, 2, "h100", scale_up_domain=8).domain == 8
    t = c.grouped(8)                                            # tp 8 groups: two trays each
    assert (t.world_size, t.domain, t.domains) == (18, 9, 2)
    with pytest.raises(HybridError, match="not a whole number of 5-GPU nodes"):
        Cluster.build(36, 5, "gb200")


def test_placement_uses_the_domain_not_the_node():
    from hybrid.layout.dims import ParallelDims
    from hybrid.estimation.memory.moe import ep_fits
    c = Cluster.build(36, 4, "gb200")
    tp8 = ParallelDims(dp_shard=18, tp=8)
    tp8.validate(c.world_size, c.gpus_per_node, c.domain)       # across two trays, inside the rack
    with pytest.raises(HybridError, match="tp 8 does not divide the 4 GPUs per node"):
        tp8.validate(c.world_size, c.gpus_per_node)
    with pytest.raises(HybridError, match="tp 16 does not divide the 72 GPUs per NVLink domain"):
        ParallelDims(dp_shard=9, tp=16).validate(c.world_size, c.gpus_per_node, c.domain)
    ParallelDims(dp_replicate=2, dp_shard=72).validate(c.world_size, c.gpus_per_node, c.domain)
    with pytest.raises(HybridError, match="shard size 48 does not divide the 72 GPUs per NVLink domain"):
        ParallelDims(dp_replicate=3, dp_shard=48).validate(c.world_size, c.gpus_per_node, c.domain)
    assert ep_fits(c, 8) and ep_fits(c, 72) and ep_fits(c, 144) and not ep_fits(c, 16)
    # a domain of 3-GPU nodes: a tp 2 group would take part of a node, and is refused in one line
    with pytest.raises(HybridError, match="tp 2 neither divides the 3 GPUs per node nor is a whole number of nodes"):
        ParallelDims(dp_shard=6, tp=2).validate(12, 3, 12)
    assert ep_fits(Cluster.build(2, 8, "h100"), 16) and not ep_fits(Cluster.build(2, 8, "h100"), 3)


def test_the_links_price_the_domain():
    from hybrid.estimation.cost.links import Links
    rack, hgx = Links(Cluster.build(36, 4, "gb200")), Links(Cluster.build(18, 8, "b200"))
    assert rack.bw(72) == get_gpu("gb200").intra_node_bw               # 18 trays on NVLink
    assert hgx.bw(72) == min(get_gpu("b200").intra_node_bw, 8 * get_gpu("b200").inter_node_bw)
    assert rack.collective("all_gather", 1e9, 8) < hgx.collective("all_gather", 1e9, 16)


@pytest.mark.slow
def test_cli_plans_the_2026_gpus(capsys):
    from hybrid.cli.main import main
    assert main(["plan", "llama3-70b", "--nodes", "36", "--gpus-per-node", "4", "--gpu", "gb200", "--tp", "8",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["scale_up_domain"] == 72 and doc["chosen_candidate"]["parallel"]["tp"] == 8
    assert main(["plan", "llama3-8b", "--gpu", "mi300x", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["collectives"], doc["software"], doc["gpu"]) == ("RCCL", "ROCm", "mi300x-192gb")
    assert main(["plan", "llama3-8b", "--gpu", "mi300x", "--emit", "deepspeed", "--strategy", "zero3"]) == 0
    assert "RCCL" in capsys.readouterr().err
    assert main(["plan", "gpt2", "--gpu", "b2000", "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and "did you mean b200?" in err


def test_mxfp8_and_tensorwise_are_each_priced_at_their_own_peak():
    from dataclasses import replace
    from hybrid.config.spec import TrainSpec
    from hybrid.estimation.cost.step import step_cost
    from hybrid.families.catalogue import load_catalogue
    from hybrid.model.sources import resolve_model
    prof, fsdp = resolve_model("llama3-8b").profile, load_catalogue()["fsdp"]
    b200 = Cluster.build(1, 8, "b200")
    tw, mx = (TrainSpec(1, 4096, compile=True, float8=True, float8_recipe=r) for r in ("tensorwise", "mxfp8"))
    bf16 = step_cost(fsdp, prof, TrainSpec(1, 4096, compile=True), b200).compute_s
    assert step_cost(fsdp, prof, tw, b200).compute_s < bf16 and step_cost(fsdp, prof, mx, b200).compute_s < bf16
    fast_mx = replace(b200, gpu=replace(b200.gpu, mxfp8_flops=4 * b200.gpu.fp8_flops))
    assert step_cost(fsdp, prof, mx, fast_mx).compute_s < step_cost(fsdp, prof, mx, b200).compute_s
    assert step_cost(fsdp, prof, tw, fast_mx).compute_s == step_cost(fsdp, prof, tw, b200).compute_s
