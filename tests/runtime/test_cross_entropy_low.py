"""cross_entropy_low: a mixed precision's cross entropy on bf16 / fp16 logits.

Under bf16-mixed the graph builder calls it where the model says cross_entropy and the
logits arrive in bfloat16 (registry ``low_precision``): no float32 cast of the logits and no
float32 log-probabilities are kept; the logits themselves are (half the bytes). Its numbers
are those of the float32 path: the log-probabilities per chunk are aten's of the rows cast
to float32, the gradient is cross_entropy's consume path rounded to the logits' dtype (bit
for bit, whatever the chunking), the loss equal up to the order of the chunks' sums.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from unroller.analysis.memory import simulate_graph
from unroller.api import graph_from_text
from unroller.compiler.options import Options
from unroller.runtime import gpu

MODELS = Path(__file__).parents[2] / "benchmarks" / "models"


def _token_logits(dtype: torch.dtype, n: int = 3, length: int = 7, classes: int = 11):
    """[N, C, L] logits as a token model hands them: a view of a contiguous [N, L, C]."""
    torch.manual_seed(0)
    head = (torch.randn(n, length, classes) * 3).to(dtype)
    target = torch.randint(0, classes, (n, length))
    target[0, :2] = -100
    return head.permute(0, 2, 1), target


def _float32_path(logits, target, g, **kwargs):
    """What the step computed before: a float32 cast, cross_entropy, its consume backward,
    the gradient cast back (the cast's backward)."""
    wide = logits.float()
    loss, log_probs = gpu.cross_entropy(wide, target, label_smoothing=0.0, ignore_index=-100)
    (grad,) = gpu.cross_entropy_backward(
        g, log_probs, target, label_smoothing=0.0, ignore_index=-100, needs=(True,), consume=True
    )
    return loss, grad.to(logits.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_float32_paths_numbers_without_its_float32_tensors(dtype):
    logits, target = _token_logits(dtype)
    g = torch.tensor(1.0)
    ref_loss, ref_grad = _float32_path(logits, target, g)
    loss = gpu.cross_entropy_low(logits, target, label_smoothing=0.0, ignore_index=-100)
    (grad,) = gpu.cross_entropy_low_backward(
        g, logits, target, label_smoothing=0.0, ignore_index=-100, needs=(True,)
    )
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    assert abs(loss.item() - ref_loss.item()) <= 1e-6 * abs(ref_loss.item())
    assert torch.equal(grad, ref_grad)
    assert grad.shape == logits.shape and grad.movedim(1, -1).is_contiguous()
    # and autograd's under torch.autocast (F.cross_entropy on the logits cast to float32)
    leaf = logits.detach().requires_grad_()
    F.cross_entropy(leaf.float(), target).backward()
    ulp = torch.finfo(dtype).eps
    assert ((grad.float() - leaf.grad.float()).abs() <= ulp * leaf.grad.float().abs()).all()


@pytest.mark.parametrize("smoothing,ignore", [(0.0, -100), (0.2, -100), (0.1, 3)])
def test_chunks_change_nothing_but_the_order_of_the_loss_sums(monkeypatch, smoothing, ignore):
    logits, target = _token_logits(torch.bfloat16, n=4, length=9)
    target = target.masked_fill(target == -100, ignore)
    kwargs = {"label_smoothing": smoothing, "ignore_index": ignore}
    g = torch.tensor(0.75)
    monkeypatch.setattr(gpu, "CROSS_ENTROPY_CHUNKS", 1)
    assert len(gpu._row_chunks(logits.movedim(1, -1).reshape(-1, 11))) == 1
    whole = gpu.cross_entropy_low(logits, target, **kwargs)
    (whole_grad,) = gpu.cross_entropy_low_backward(g, logits, target, needs=(True,), **kwargs)
    monkeypatch.setattr(gpu, "CROSS_ENTROPY_CHUNKS", 8)  # 36 rows: chunks of 5, the last 1
    assert len(gpu._row_chunks(logits.movedim(1, -1).reshape(-1, 11))) == 8
    chunked = gpu.cross_entropy_low(logits, target, **kwargs)
    (chunked_grad,) = gpu.cross_entropy_low_backward(g, logits, target, needs=(True,), **kwargs)
    assert torch.equal(chunked_grad, whole_grad)
    assert abs(chunked.item() - whole.item()) <= 1e-6 * abs(whole.item())
    ref = F.cross_entropy(logits.float(), target, **kwargs)
    assert abs(chunked.item() - ref.item()) <= 1e-6 * abs(ref.item())


def test_the_graph_calls_it_for_bf16_logits_and_keeps_them():
    text = (MODELS / "gpt_tiny.txt").read_text()
    mixed = graph_from_text(text, "gpt_tiny.txt", None, "bf16-mixed")
    plain = graph_from_text(text, "gpt_tiny.txt", None, "fp32")
    loss = mixed.nodes[-1]
    assert loss.op.name == "cross_entropy_low"
    assert loss.inputs[0].type.dtype == "bf16" and loss.output.type.dtype == "f32"
    assert not any(n.op.name == "cast" and n.output.type.dtype == "f32" for n in mixed.nodes[-3:])
    assert plain.nodes[-1].op.name == "cross_entropy"
    # the loss's own bytes per sample: bf16 logits kept, not float32 log-probabilities
    config = Options().compression(mixed)
    small, large = (simulate_graph(mixed, config, b).stash_bytes for b in (4, 8))
    classes, length = loss.inputs[0].type.shape[1:]
    per_sample = (large - small) / 4
    assert (
        per_sample
        < (
            simulate_graph(plain, config, 8).stash_bytes
            - simulate_graph(plain, config, 4).stash_bytes
        )
        / 4
    )
    assert classes * length * 2 <= per_sample  # the logits themselves are kept
