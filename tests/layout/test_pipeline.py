"""Pipeline parallelism as the outer dimension: stages on CPU ranks equal one process (fp32)."""
import functools

import pytest
import torch

from hybrid.runtime.launch import run_ranks
from hybrid.model.decoder import build_decoder
from tests.runtime.test_backends import TINY
from tests.runtime.test_loop import CLIP, MB, SEQ, STEPS, adamw, warmup  # the same loop as test_loop

pytestmark = pytest.mark.gloo

GA = 4


def batches(dp, steps=STEPS, seed=7):
    """Global batches: dp x GA x MB sequences per step (dp rank r reads rows r*GA*MB...)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (dp * GA * MB, SEQ), generator=g) for _ in range(steps)]


def tiny():
    return build_decoder(TINY, seed=0)


def hf_llama():
    from hybrid.model.decoder import build_hf
    torch.manual_seed(0)
    return build_hf(TINY, device="cpu")


def tiny4():
    import dataclasses
    return build_decoder(dataclasses.replace(TINY, layers=4), seed=0)


MODELS = {"tiny": tiny, "hf": hf_llama, "tiny4": tiny4}


@functools.cache        # pure: seeded model and batches, one CPU process; read only by check()
def reference(model_name, dp):
    """One process: each step the global batch's dp x GA micro-batches, mean loss, clip, step."""
    model = MODELS[model_name]()
    opt = adamw(model.parameters())
    sched = warmup(opt)
    losses = []
    for ids in batches(dp):
        chunks = ids.chunk(dp * GA)
        step_loss = 0.0
        for mb in chunks:
            loss = model(input_ids=mb, labels=mb).loss / len(chunks)
            loss.backward()
            step_loss += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(step_loss)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def train_pp(runs):
    """runs: [(model, strategy, pp, schedule)] on this world; every rank's final full state."""
    import torch.distributed as dist

    from hybrid import auto_wrap
    out = {}
    for model_name, strategy, pp, schedule in runs:
        w = auto_wrap(MODELS[model_name](), optimizer=adamw, scheduler=warmup, strategy=strategy, pp=pp,
                      schedule=schedule, gradient_accumulation=GA, max_grad_norm=CLIP, precision="fp32",
                      micro_batch=MB, seq_len=SEQ, verbose=False)
        dp, rank = w.dp_size, w.dp_rank
        losses = []
        for ids in batches(dp):
            losses.append(w.train_step(ids[rank * GA * MB:(rank + 1) * GA * MB]))
        out[f"{model_name}/{strategy}/pp{pp}/{schedule}"] = {"state": w.state_dict(), "losses": losses,
                                                            "dp": dp, "world": dist.get_world_size()}
    return out


def check(results, runs, dp):
    for model_name, *_ in runs:
        ref, ref_losses = reference(model_name, dp)
        for r in results:
            for key, res in r.items():
                if not key.startswith(model_name + "/"):
                    continue
                diff = max((res["state"][k] - ref[k]).abs().max().item() for k in ref)
                assert diff < 1e-5, (key, diff)
                assert max(abs(a - b) for a, b in zip(res["losses"], ref_losses)) < 1e-5, (key, res["losses"])


PP2_RUNS = [("tiny", "fsdp", 2, "1f1b"), ("tiny", "ddp", 2, "gpipe"), ("hf", "fsdp", 2, "gpipe"),
            ("hf", "ddp", 2, "1f1b"), ("tiny4", "fsdp", 2, "interleaved")]
PP2_DP2_RUNS = [("tiny", "fsdp", 2, "1f1b"), ("tiny", "ddp", 2, "gpipe"), ("hf", "fsdp", 2, "1f1b")]
PLAIN = ["ddp", "fsdp", "zero2"]


def two_rank_cases(_):
    """Every independent two-rank training check of this file in one launch (docs/development.md,
    "One launch, several checks"): the pp 2 schedules, and the plain loop on each backend."""
    return {"pp": train_pp(PP2_RUNS), "plain": train_plain(PLAIN)}


def four_rank_cases(_):
    """The four-rank training checks in one launch: pp 2 x dp 2, and pp 2 x tp 2."""
    return {"pp_dp": train_pp(PP2_DP2_RUNS), "pp_tp": train_pp_tp(None)}


def test_pp2_every_schedule_tied_and_transformers_llama_and_the_plain_loop_on_two_ranks():
    """pp 2 under every schedule (ours, tied, and transformers' llama) equals one process; and
    w.train_step without a pipeline is the same loop on ddp, fsdp and zero2."""
    launched = run_ranks(2, two_rank_cases, None)
    check([r["pp"] for r in launched], PP2_RUNS, 1)
    check([r["plain"] for r in launched], [("tiny",)], 2)


def test_pp2_by_dp2_and_pp2_by_tp2_on_four_ranks_sequence_shards_cross_the_stage_boundary():
    launched = run_ranks(4, four_rank_cases, None, local_world=4)
    check([r["pp_dp"] for r in launched], PP2_DP2_RUNS, 2)
    res = [r["pp_tp"] for r in launched]
    assert res[0]["tiny/pp2xtp2"]["layout"] == res[0]["hf/pp2xtp2"]["layout"] == "pp 2 x tp 2"
    check(res, [("tiny",), ("hf",)], 1)


def run_and_save(path, pp, strategy, ga, steps_before, steps_after, load=False, model="tiny", schedule=None):
    """Train on the shared global batches (dp x ga x MB sequences per step): `steps_before`
    steps (or load `path`), save after them, then `steps_after` more; returns final state and losses."""
    from hybrid import auto_wrap
    w = auto_wrap(MODELS[model](), optimizer=adamw, scheduler=warmup, strategy=strategy, pp=pp,
                  gradient_accumulation=ga, schedule=schedule if pp > 1 else None, max_grad_norm=CLIP,
                  precision="fp32", micro_batch=MB, seq_len=SEQ, verbose=False)
    dp, rank = w.dp_size, w.dp_rank
    rows = dp * ga * MB
    g = torch.Generator().manual_seed(7)
    data = [torch.randint(0, 512, (4 * GA * MB, SEQ), generator=g)[:rows] for _ in range(steps_before + steps_after)]
    losses = []
    if load:
        w.load(path)
    for step, ids in enumerate(data):
        if load and step < steps_before:
            continue
        losses.append(w.train_step(ids[rank * ga * MB:(rank + 1) * ga * MB]))
        if not load and step == steps_before - 1:
            w.save(path)
    return {"state": w.state_dict(), "losses": losses, "layout": w.parallel.describe()}


def test_checkpoint_from_pp2_by_dp2_resumes_under_dp4_and_under_fsdp_on_two_ranks(tmp_path):
    path = str(tmp_path / "ckpt")
    full = run_ranks(4, run_and_save, path, 2, "fsdp", 2, 2, 2, local_world=4)[0]
    assert full["layout"] == "pp 2 x dp_shard 2"
    dp4 = run_ranks(4, run_and_save, path, 1, "fsdp", 1, 2, 2, True, local_world=4)[0]
    dp2 = run_ranks(2, run_and_save, path, 1, "fsdp", 2, 2, 2, True)[0]
    for other in (dp4, dp2):
        assert max(abs(a - b) for a, b in zip(other["losses"], full["losses"][2:])) < 1e-5, other["losses"]
        assert max((other["state"][k] - full["state"][k]).abs().max().item() for k in full["state"]) < 1e-5


def in_flight_run(schedule):
    """Train one step of a 4-block model under `schedule` (pp 2, 4 micro-batches) and count, with
    saved-tensor hooks, the most (stage, micro-batch) pairs whose saved activations are alive at
    once on this rank; with what hybrid.layout.pipeline predicts for the rank."""
    import dataclasses

    from hybrid import auto_wrap
    w = auto_wrap(build_decoder(dataclasses.replace(TINY, layers=4), seed=0), optimizer=adamw, strategy="fsdp",
                  pp=2, schedule=schedule, gradient_accumulation=GA, precision="fp32", micro_batch=MB,
                  seq_len=SEQ, verbose=False)
    engine = w.engine
    state = {"current": None, "runs": {}, "live": {}, "peak": 0}

    def pre_forward(index):
        def hook(module, args):
            n = state["runs"].get(index, 0)
            state["runs"][index] = n + 1
            state["current"] = (index, n)
        return hook

    for chunk, stage in zip(engine.chunks, engine.stages):
        chunk.register_forward_pre_hook(pre_forward(stage.stage_index))

    class Saved:
        def __init__(self, t, key):
            self.t, self.key = t, key
            state["live"][key] = state["live"].get(key, 0) + 1
            alive = sum(1 for v in state["live"].values() if v > 0)
            if alive > state["peak"]:
                state["peak"], state["at_peak"] = alive, sorted((str(k) for k, v in state["live"].items() if v > 0))

        def __del__(self):
            state["live"][self.key] -= 1

    def pack(t):
        return Saved(t, state["current"])

    batch = torch.randint(0, 512, (GA * MB, SEQ), generator=torch.Generator().manual_seed(0))
    w.train_step(batch)         # the first step also infers the stage shapes (one more forward on stage 0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda s: s.t):
        w.train_step(batch)
    rank = w.mesh["pp"].get_local_rank()
    # the receive buffers torch.distributed.pipelining allocated on this rank, against the estimate's
    from hybrid.estimation.memory.analytic import receive_buffers
    from hybrid.estimation.shares import shares
    infos = [i for st in engine.stages for table in (st.args_recv_info, st.grad_recv_info)
             for mb in table.values() for i in mb]
    held = {id(i.buffer): i.buffer for i in infos if getattr(i, "buffer", None) is not None}
    recv = sum(b.numel() * b.element_size() for b in held.values())
    estimated = receive_buffers(shares(w.plan.model, w.chosen.layout, w.chosen.spec, rank))
    return {"measured": state["peak"], "predicted": w.chosen.pipeline.in_flight(rank), "at": state.get("at_peak"),
            "recv": (recv, estimated)}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_in_flight_micro_batches_match_saved_tensor_hooks(schedule):
    res = run_ranks(2, in_flight_run, schedule)
    assert [r["measured"] for r in res] == [r["predicted"] for r in res], res
    assert [r["recv"][0] for r in res] == [r["recv"][1] for r in res], [r["recv"] for r in res]


def train_pp_tp(_):
    """pp 2 x tp 2 on our decoder and on transformers' llama (its stages under the model's own tp plan:
    runtime/backends/tp.py _hf_plan)."""
    from hybrid import auto_wrap
    out = {}
    for name in ("tiny", "hf"):
        w = auto_wrap(MODELS[name](), optimizer=adamw, scheduler=warmup, strategy="fsdp", pp=2, tp=2, schedule="1f1b",
                      gradient_accumulation=GA, max_grad_norm=CLIP, precision="fp32", micro_batch=MB, seq_len=SEQ,
                      verbose=False)
        losses = [w.train_step(ids) for ids in batches(1)]
        out[f"{name}/pp2xtp2"] = {"state": w.state_dict(), "losses": losses, "layout": w.parallel.describe()}
    return out


def test_interleaved_checkpoint_resumes_under_fsdp(tmp_path):
    path = str(tmp_path / "ckpt")
    full = run_ranks(2, run_and_save, path, 2, "fsdp", 2, 2, 2, False, "tiny4", "interleaved")[0]
    assert full["layout"] == "pp 2"
    dp2 = run_ranks(2, run_and_save, path, 1, "fsdp", 1, 2, 2, True, "tiny4")[0]
    assert max(abs(a - b) for a, b in zip(dp2["losses"], full["losses"][2:])) < 1e-5, dp2["losses"]
    assert max((dp2["state"][k] - full["state"][k]).abs().max().item() for k in full["state"]) < 1e-5


def train_plain(strategies):
    """w.train_step without a pipeline: the same loop on every backend."""
    from hybrid import auto_wrap
    out = {}
    for strategy in strategies:
        w = auto_wrap(tiny(), optimizer=adamw, scheduler=warmup, strategy=strategy, gradient_accumulation=GA,
                      max_grad_norm=CLIP, precision="fp32", micro_batch=MB, seq_len=SEQ, verbose=False)
        losses = [w.train_step(ids[w.dp_rank * GA * MB:(w.dp_rank + 1) * GA * MB]) for ids in batches(w.dp_size)]
        out[f"tiny/{strategy}"] = {"state": w.state_dict(), "losses": losses}
    return out
