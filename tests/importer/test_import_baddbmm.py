"""``baddbmm`` on heads merged with the batch, and BLOOM's ALiBi bias as its input.

BLOOM merges ``[N, H, L, D]`` to ``[N*H, L, D]`` and adds its ALiBi bias, a constant of
the sizes tiled once per sample (``[H, 1, L]`` repeated to ``[N*H, 1, L]``), to the scores
with ``baddbmm``. The merge is imported on the unmerged shapes only when baddbmm's input
meets the rows row for row (``batch_merge._added_rows``); the constant is then the
``alibi`` statement, matched value for value, and anything else built from sizes alone
stays refused, with the reason (the language holds no other constant tensor).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from unroller.analysis.verify import verify_text
from unroller.importer.api import import_network
from unroller.importer.model import ImportFailure
from unroller.runtime.positions import alibi, alibi_bias, alibi_slopes

HEADS, LENGTH = 2, 5
INPUTS = [f"x: f32[N, {LENGTH}, 8]"]


def _bloom():
    """BLOOM's module, imported before any trace reaches ``_bloom_slopes``: its import
    defines transformers' ModelOutput classes, which register as pytree nodes only when
    not imported under torch.export (``MergedBaddbmm.__init__`` calls this eagerly)."""
    return pytest.importorskip("transformers.models.bloom.modeling_bloom")


def _bloom_slopes(heads: int) -> torch.Tensor:
    """BLOOM's slopes as Hugging Face makes them (``_get_alibi_slopes``)."""
    return _bloom()._get_alibi_slopes(heads, torch.device("cpu"))


class MergedBaddbmm(nn.Module):
    """BLOOM's attention as it writes it, heads merged with the batch for ``baddbmm`` and
    ``bmm`` and split back; ``bias`` picks baddbmm's input: ``alibi`` (BLOOM's, tiled per
    sample), ``table`` (a parameter [L, L] without the batch), ``data`` (a per-sample bias
    merged as the heads are), ``ones`` (a tile of a constant that is not ALiBi's),
    ``numbered`` (a constant that differs per row: it mixes samples)."""

    def __init__(self, bias: str = "alibi", beta: float = 1.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = nn.Linear(8, 3 * 8)
        self.score = nn.Linear(8, HEADS)
        self.table = nn.Parameter(torch.randn(LENGTH, LENGTH))
        self.out = nn.Linear(8, 3)
        self.bias, self.beta = bias, beta
        if bias == "alibi":
            _bloom()  # here, not first in the exported forward

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        n, length, _ = x.shape
        if self.bias == "alibi":  # BloomModel.forward without an attention mask
            slopes = _bloom_slopes(HEADS)
            tiled = slopes[:, None, None] * torch.arange(length, device=x.device)
            return tiled.repeat(n, 1, 1).to(x.dtype)
        if self.bias == "ones":
            return torch.ones(HEADS, 1, length, device=x.device).repeat(n, 1, 1).to(x.dtype)
        if self.bias == "numbered":
            return torch.arange(n * HEADS, dtype=x.dtype, device=x.device).view(-1, 1, 1)
        if self.bias == "table":
            return self.table
        per_key = self.score(x).transpose(1, 2).unsqueeze(2)  # [N, H, 1, L]
        return per_key.reshape(n * HEADS, 1, length)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, length, _ = x.shape
        q, k, v = (
            t.view(n, length, HEADS, 4).transpose(1, 2).reshape(n * HEADS, length, 4)
            for t in self.qkv(x).chunk(3, dim=-1)
        )
        scores = self._input(x).baddbmm(q, k.transpose(-1, -2), beta=self.beta, alpha=0.5)
        probs = torch.softmax(scores.view(n, HEADS, length, length), dim=-1)
        a = torch.bmm(probs.view(n * HEADS, length, length), v).view(n, HEADS, length, 4)
        return self.out(a.transpose(1, 2).reshape(n, length, 8))


@pytest.mark.parametrize(
    "bias, beta, op",
    [("alibi", 1.0, "alibi("), ("table", 0.5, "add("), ("data", 1.0, "add(")],
)
def test_baddbmm_on_merged_heads_imports_and_verifies_exactly(bias, beta, op):
    """The product is a matmul scaled by alpha, the input added (scaled by beta): ALiBi's
    tile as one alibi statement, a table without the batch and a per-sample bias merged as
    the heads are as they are; registry operators only, verified at another batch size."""
    built = MergedBaddbmm(bias, beta)
    text = import_network("merged_baddbmm", INPUTS, loss="mse_loss", built=built).text
    assert "aten(" not in text
    assert "matmul(" in text and "scale(" in text and op in text
    report = verify_text(text, MergedBaddbmm, {"bias": bias, "beta": beta}, batch_size=3)
    assert report.ok, report.problems or report.table()


#: A fresh interpreter (transformers not imported yet) imports the ALiBi model, then asks
#: whether Hugging Face's ModelOutput classes are pytree nodes.
_FRESH_IMPORT = """
import sys
import torch.utils._pytree as pytree
from importer.test_import_baddbmm import INPUTS, MergedBaddbmm
from unroller.importer.api import import_network
assert "transformers.modeling_outputs" not in sys.modules, "imported too early to tell"
import_network("merged_baddbmm", INPUTS, loss="mse_loss", built=MergedBaddbmm("alibi"))
from transformers.modeling_outputs import SequenceClassifierOutput
assert SequenceClassifierOutput in pytree.SUPPORTED_NODES, "not a pytree node"
"""


def test_importing_the_alibi_model_leaves_hugging_face_outputs_pytree_nodes():
    """transformers registers each ModelOutput class as a pytree node when its module is
    imported, but not while ``torch.compiler.is_compiling()`` (as under torch.export), and
    retries only when an output is built outside a trace. A first import of BLOOM's module
    inside the exported forward left every output class of ``modeling_outputs`` unknown to
    torch.export for the rest of the process: a later ``torch.onnx.export`` of a Hugging
    Face classifier in the same pytest worker failed on ``SequenceClassifierOutput``. Run
    in its own interpreter: in this one transformers may have been imported already."""
    pytest.importorskip("transformers")
    tests = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", _FRESH_IMPORT],
        cwd=tests,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize(
    "bias, said",
    [
        ("ones", "not ALiBi's bias"),
        ("numbered", "a batched value from outside the rows"),
    ],
)
def test_other_constant_inputs_of_a_merged_baddbmm_stay_refused(bias, said):
    """A tile of another constant passes the row proof but has no statement; a constant
    whose rows differ per sample fails the proof (it would mix samples). The fallback takes
    neither: the rows are merged with the batch."""
    with pytest.raises(ImportFailure) as caught:
        import_network("merged_baddbmm", INPUTS, loss="mse_loss", built=MergedBaddbmm(bias))
    message = str(caught.value)
    assert said in message and "baddbmm" in message


@pytest.mark.parametrize("heads", [1, 3, 8, 12, 16, 40])
def test_alibi_kernel_is_bloom_s_bias_added_bit_for_bit(heads):
    """The slopes and the bias are Hugging Face's to the bit (heads not a power of two
    included), and the kernel adds them as baddbmm's input is added."""
    assert torch.equal(alibi_slopes(heads), _bloom_slopes(heads))
    scores = torch.randn(2, heads, 3, 7, dtype=torch.float64)
    bias = (_bloom_slopes(heads)[:, None, None] * torch.arange(7)).to(torch.float64)
    assert torch.equal(alibi_bias(heads, 7, torch.float64), bias)
    assert torch.equal(alibi(scores), scores + bias)


@pytest.mark.slow  # a few seconds: transformers' BLOOM exported and verified
def test_bloom_verifies_exactly_through_the_benchmark():
    """BloomForCausalLM at its library defaults (vocabulary 128) through the network zoo:
    ALiBi as alibi statements, the merged heads on the unmerged shapes."""
    from benchmarks.network_zoo import find, measure

    _, net = find("new:bloom")
    start = time.perf_counter()
    found = measure(net, True)
    assert found["status"] == "verified", found
    assert found["max_rel"] <= 1e-10
    assert "aten.baddbmm.default" not in found["opaque_ops"]
    assert time.perf_counter() - start < 120
