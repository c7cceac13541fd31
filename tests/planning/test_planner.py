"""The cost-aware planner: sanity cases, ties, nothing-fits suggestions, hand-off configs, plot."""
import json

import pytest
import yaml

from hybrid.families.catalogue import load_catalogue
from hybrid.cli.main import main
from hybrid.config.cluster import Cluster
from hybrid.estimation.cost.step import step_cost
from hybrid.planning.planner import choose, plan
from hybrid.model.sources import resolve_model
from hybrid.config.spec import TrainSpec

CAT = load_catalogue()
H100_64 = Cluster.build(8, 8, "h100-80gb")


@pytest.mark.unit
def test_gpt2_on_one_a100_node_is_plain_data_parallel():
    p = plan(resolve_model("gpt2").profile, TrainSpec(8, 1024), Cluster.build(1, 8, "a100-80gb"),
             search_checkpointing=True)
    # replicated parameters, no recomputation: zero1 is predicted within the model's error of it
    assert p.chosen.name == "ddp" and p.chosen.spec.activation_checkpointing == "none"


@pytest.mark.unit
def test_llama2_7b_on_8x8_h100_shards():
    p = plan(resolve_model("llama2-7b").profile, TrainSpec(1, 4096), H100_64, search_checkpointing=True)
    ddp = [c for c in p.candidates if c.name == "ddp" and c.tp == 1 and c.pp == 1]
    assert ddp and not any(c.fits for c in ddp)                 # plain DDP cannot fit
    assert p.chosen.strategy.family != "ddp" and p.chosen.shard_size > 1 and p.chosen.fits


@pytest.mark.unit
def test_llama2_70b_shards_across_nodes_or_fully():
    p = plan(resolve_model("llama2-70b").profile, TrainSpec(1, 4096), H100_64, search_checkpointing=True)
    c = p.chosen
    assert c.shard_size > 8 or c.shard_size == 64
    assert not any(x.fits for x in p.candidates if x.spec.activation_checkpointing == "none" and x.tp == 1
                   and x.pp == 1)
    assert c.spec.activation_checkpointing != "none"           # checkpointing was needed


@pytest.mark.unit
@pytest.mark.slow
def test_nothing_fits_says_the_smallest_change():
    p = plan(resolve_model("llama3.1-405b").profile, TrainSpec(1, 4096), Cluster.build(1, 8, "a100-40gb"),
             search_checkpointing=True)
    assert p.chosen is None
    assert any(s.startswith("--nodes ") for s in p.suggestions)
    for c in p.candidates:
        assert not c.fits and c.reason


@pytest.mark.unit
def test_cost_model_orders_what_it_should():
    prof = resolve_model("llama2-7b").profile
    spec = TrainSpec(1, 4096)
    t = {n: step_cost(CAT[n], prof, spec, H100_64) for n in ("ddp", "hsdp", "fsdp", "zero3", "zero3-hpz")}
    assert t["zero3-hpz"].comm_s < t["zero3"].comm_s      # hpZ's backward gather stays in the node
    full_spec = TrainSpec(1, 4096, activation_checkpointing="full")
    full = step_cost(CAT["fsdp"], prof, full_spec, H100_64)
    # the matmuls: one more forward (8/6); the elementwise ops: one more block forward each
    from hybrid.estimation.cost.step import elementwise_seconds
    ew, ew_full = (elementwise_seconds(prof, s, H100_64.gpu) for s in (spec, full_spec))
    assert full.compute_s - ew_full == pytest.approx((t["fsdp"].compute_s - ew) * 8 / 6)
    assert ew_full > ew > 0
    assert 0 < t["hsdp"].mfu <= H100_64.gpu.efficiency + 1e-9
    assert t["hsdp"].tokens_per_s_per_gpu == pytest.approx(4096 / t["hsdp"].seconds)


@pytest.mark.unit
def test_ties_go_to_the_simpler_strategy():
    p = plan(resolve_model("llama2-7b").profile, TrainSpec(1, 4096), H100_64, strategies=["zero1", "zero2"])
    assert p.chosen.name == "zero1"                          # same predicted time, zero1 is simpler
    assert choose([]) is None


def _emit(capsys, *argv):
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


@pytest.mark.unit
@pytest.mark.slow
def test_emit_fsdp_yaml(capsys):
    doc = yaml.safe_load(_emit(capsys, "llama2-7b", "--nodes", "8", "--seq-len", "4096", "--emit", "fsdp"))
    assert doc["mesh"]["dim_names"] == ["dp_replicate", "dp_shard"]
    assert doc["mesh"]["shape"][0] * doc["mesh"]["shape"][1] == 64
    # the transformers class users train (a preset is estimated from our own Block)
    assert doc["fully_shard"]["units"] == ["LlamaDecoderLayer", "root"]
    assert doc["fully_shard"]["mp_policy"] == {"param_dtype": "bfloat16", "reduce_dtype": "float32"}


@pytest.mark.unit
def test_emit_fsdp_names_the_transformers_layer_of_a_config_json(capsys, tmp_path):
    import json
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "mistral", "vocab_size": 32000, "hidden_size": 1024,
                               "intermediate_size": 2816, "num_hidden_layers": 4, "num_attention_heads": 8,
                               "num_key_value_heads": 8, "max_position_embeddings": 2048}))
    doc = yaml.safe_load(_emit(capsys, str(cfg), "--nodes", "1", "--seq-len", "1024", "--emit", "fsdp"))
    assert doc["fully_shard"]["units"] == ["MistralDecoderLayer", "root"]


def _initialize(cfg):
    import torch
    import deepspeed

    from hybrid.runtime.mesh import init_distributed
    from hybrid.model.decoder import build_decoder
    init_distributed()
    model = build_decoder("tiny-llama")
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                                      config=cfg)
    ids = torch.randint(0, 512, (cfg["train_micro_batch_size_per_gpu"], 16))
    loss = engine(ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return engine.zero_optimization_stage(), loss.item()


@pytest.mark.gloo
def test_emitted_deepspeed_config_loads_in_deepspeed(capsys):
    from hybrid.runtime.launch import run_ranks
    cfg = json.loads(_emit(capsys, "tiny-llama", "--gpus-per-node", "1", "--seq-len", "16", "--precision",
                           "fp32", "--emit", "deepspeed", "--strategy", "zero2"))
    assert cfg["zero_optimization"]["stage"] == 2 and cfg["train_batch_size"] == 1
    stage, loss = run_ranks(1, _initialize, cfg)[0]
    assert stage == 2 and loss > 0


@pytest.mark.unit
def test_emit_errors(capsys):
    assert main(["plan", "gpt2", "--emit", "deepspeed", "--strategy", "fsdp"]) == 2
    assert "is not a deepspeed strategy" in capsys.readouterr().err


@pytest.mark.unit
@pytest.mark.slow
def test_compare_plot(tmp_path, capsys):
    png = tmp_path / "cmp.png"
    code = main(["compare", "llama2-7b", "--nodes", "2", "--strategies", "ddp,fsdp,hsdp,zero3",
                 "--plot", str(png)])
    out, _ = capsys.readouterr()
    assert code == 0 and "params" in out and "tok/s/GPU" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


@pytest.mark.unit
def test_a_bare_count_is_never_chosen_and_the_plan_says_what_is_missing(capsys):
    """A bare parameter count has no activations: its rows are `states`, none is chosen, the plan
    lists what is missing, and --emit refuses in one line (it once chose zero1 and emitted it)."""
    job = ["plan", "--params", "7.5e9", "--nodes", "8"]
    assert main(job + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["chosen"] is None and out["chosen_candidate"] is None and out["missing"] == ["activations"]
    assert {r["verdict"] for r in out["strategies"]} <= {"states", "OOM", "n/a"}
    assert not any(r["fits"] for r in out["strategies"]) and out["suggestions"] == []
    assert main(job) == 0
    text = capsys.readouterr().out
    assert "nothing chosen: activations unknown" in text and "\n*" not in text
    assert main(job + ["--emit", "deepspeed"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bare parameter count" in err[0]


@pytest.mark.unit
def test_suggestions_keep_the_pinned_degrees(capsys):
    """With --tp 2 pinned, every suggested change keeps tp 2 (a --nodes suggestion once moved to
    zero3-offload at tp 1, a layout the user had ruled out)."""
    assert main(["plan", "llama3-70b", "--nodes", "1", "--gpus-per-node", "8", "--gpu", "a100-40gb", "--tp", "2",
                 "--pp", "1", "--json"]) == 0
    fixes = json.loads(capsys.readouterr().out)["suggestions"]
    assert fixes and all("+tp2" in f for f in fixes if not f.startswith("--tp ")), fixes


@pytest.mark.unit
def test_a_suggested_gpu_has_more_memory_and_fits_by_the_estimate(monkeypatch):
    """A GPU of the same memory class (a10g-24gb and l4-24gb differ by 6 MiB) is never suggested, even
    where its few extra MiB would fit; the GPU suggested has more memory and its plan chooses a layout."""
    from dataclasses import replace

    from hybrid.config.cluster import GPUS
    from hybrid.planning import planner
    from hybrid.units import GiB, MiB
    prof, spec = resolve_model("llama2-7b").profile, TrainSpec(1, 2048)
    a10g = GPUS["a10g-24gb"]
    on = lambda gpu: plan(prof, spec, Cluster.build(1, 1, gpu), CAT, strategies=["fsdp"], tp=1, pp=1)  # noqa: E731
    need = min(c.memory.needed for c in on(replace(a10g, name="roomy", memory_bytes=400 * GiB)).candidates)
    here = replace(a10g, name="here-24gb", memory_bytes=need - 256 * MiB)
    twin = replace(a10g, name="twin-24gb", memory_bytes=need + 256 * MiB)
    assert on(twin).chosen is not None                          # the twin would fit, by 256 MiB
    monkeypatch.setattr(planner, "GPUS", {**GPUS, twin.name: twin})
    p = on(here)
    assert p.chosen is None
    gpus = [s.split()[1] for s in p.suggestions if s.startswith("--gpu ")]
    assert gpus and twin.name not in gpus
    for name in gpus:
        assert GPUS[name].memory_bytes >= here.memory_bytes + GiB
        again = on(GPUS[name])
        assert again.chosen is not None and again.chosen.known_to_fit


@pytest.mark.unit
@pytest.mark.parametrize("command", [
    "plan --params 7e9 --nodes 8",
    "plan llama3.1-405b --nodes 1 --gpus-per-node 8 --gpu a100-40gb --tp 2",
    "plan llama2-7b --nodes 1 --gpus-per-node 1 --gpu a10g-24gb --strategy fsdp",
    "plan llama2-7b --nodes 1 --gpus-per-node 8 --seq-len 4096",
])
@pytest.mark.slow
def test_chosen_is_set_only_where_a_row_fits(capsys, command):
    import shlex
    assert main(shlex.split(command) + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    fits = [r for r in doc["strategies"] if r["fits"]]
    assert (doc["chosen"] is None) == (not fits), (doc["chosen"], len(fits))
    if doc["chosen"] is not None:
        assert any(r["name"] == doc["chosen"] for r in fits)
    assert {r["verdict"] for r in doc["strategies"]} <= {"fits", "tight", "OOM", "states", "n/a"}
