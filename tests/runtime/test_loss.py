"""The chunked and fused losses (hybrid/runtime/loss.py): the chunked loss equals the eager one in
value and gradients, keeps what estimation/memory/activations.loss_terms says (the dispatcher's
live-tensor tracker as the reference), and trains every strategy as one process does."""
import dataclasses

import pytest
import torch

from hybrid.config.spec import TrainSpec
from hybrid.errors import HybridError
from hybrid.estimation.memory.activations import LOSS_CHUNKS, loss_terms
from hybrid.model.decoder import build_decoder, causal_lm_loss
from hybrid.runtime.loss import apply_loss, check_loss, chunked_causal_lm_loss
from hybrid.runtime.launch import run_ranks
from tests.runtime.test_backends import TINY


@pytest.mark.torch
def test_chunked_loss_and_gradients_equal_eager():
    """The same model, ids and labels (some ignored): the chunked head and loss give eager's value
    and every parameter's gradient (fp32, 1e-6), and no whole logits."""
    ids = torch.randint(0, TINY.vocab, (2, 24), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[0, :5] = -100
    grads, losses = [], []
    for kind in ("eager", "chunked"):
        model = build_decoder(TINY, seed=0)
        apply_loss(model, TrainSpec(loss=kind))
        out = model(ids, labels=labels)
        out.loss.backward()
        losses.append(out.loss.item())
        grads.append({n: p.grad for n, p in model.named_parameters()})
        assert (out.logits is None) == (kind == "chunked")
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    for n, g in grads[0].items():
        assert torch.allclose(grads[1][n], g, rtol=1e-5, atol=1e-7), n


@pytest.mark.torch
@pytest.mark.parametrize("kind", ["eager", "chunked"])
def test_head_and_loss_bytes_equal_the_tracker(kind):
    """Bytes the head and loss keep after forward, and the rise over them in backward (less the
    two gradients the families count), against the dispatcher's live-tensor record; T = 128 is
    LOSS_CHUNKS x 16 tokens. Eager keeps its logits (the model's output holds them)."""
    from hybrid.estimation.memory.activations import final_norm
    from hybrid.measure.tracker import MemoryTracker
    cfg = dataclasses.replace(TINY, vocab=1000, hidden=32)
    b, s, V, h = 2, 64, cfg.vocab, cfg.hidden
    T = b * s
    head = torch.nn.Linear(h, V, bias=False)
    x = torch.randn(b, s, h, requires_grad=True)
    y = torch.randint(0, V, (b, s))
    tracker = MemoryTracker()
    tracker.register([x, y, head.weight], "params")
    with tracker:
        before = tracker.current
        if kind == "eager":
            logits = head(x)
            loss = causal_lm_loss(logits, y)
        else:
            loss = chunked_causal_lm_loss(head, x, y)
        kept = tracker.current - before
        tracker.reset_peak()
        loss.backward()
        rise = tracker.peak - before - kept
    fwd, bwd = loss_terms(cfg, TrainSpec(micro_batch=b, seq_len=s, precision="fp32", loss=kind), autocast=False)
    norm = final_norm(cfg, 4, autocast=False) * T    # the final norm's, not run here
    labels = 8 * T + 64                             # the int64 shifted labels and the scalars
    assert 0 <= kept - (fwd - norm) <= labels
    grads = 4 * (T * h + V * h) if kind == "chunked" else 0     # alive at the chunked peak (accumulating)
    assert abs(rise - grads - (bwd - fwd)) <= labels
    if kind == "chunked":
        assert bwd - fwd == (4 + 12) * V * T // LOSS_CHUNKS     # one chunk's eager bytes


@pytest.mark.torch
def test_losses_refuse_in_one_line():
    from hybrid.families.catalogue import get_strategy
    from hybrid.layout.dims import ParallelDims
    from hybrid.layout.layout import Layout
    from hybrid.runtime.parallelize import check_model
    fsdp = get_strategy("fsdp")
    chunked = TrainSpec(loss="chunked")
    with pytest.raises(HybridError, match="hybrid's decoders.*Sequential computes its own"):
        check_loss(torch.nn.Sequential(torch.nn.Linear(2, 2)), chunked)
    with pytest.raises(HybridError, match="without tp, cp or pp.*tp 2, cp 1, pp 1"):
        check_model(build_decoder(TINY, device="meta"), Layout(ParallelDims(dp_shard=1, tp=2), fsdp, "none"), chunked,
                    "CPU")
    check_model(build_decoder(TINY, device="meta"), Layout(ParallelDims(dp_shard=2), fsdp, "none"), chunked, "CPU")
    if not torch.cuda.is_available():
        with pytest.raises(HybridError, match="fused.*CUDA.*loss='chunked'"):
            check_loss(build_decoder(TINY, device="meta"), TrainSpec(loss="fused"))


def _train_chunked(strategies):
    from tests.runtime.test_loop import train
    return {s: train(s, loss="chunked") for s in strategies}


@pytest.mark.gloo
def test_auto_wrap_chunked_loss_trains_as_one_eager_process():
    """auto_wrap(loss='chunked') on 2 ranks ends where one eager process ends (1e-5, fp32)."""
    from tests.runtime.test_loop import check
    strategies = ("ddp", "fsdp", "zero3")
    check(run_ranks(2, _train_chunked, strategies), 2, strategies)
