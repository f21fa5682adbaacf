"""Reshapes that merge the batch with the dims after it, undone by a later reshape.

``[N, L, E] -> [N*L, E]`` around ops that treat each row alone is imported on the
unmerged shapes (``unroller.importer.batch_merge``): exact, so verify passes at 1e-10.
A region where an op mixes rows (a reduction over the merged dim) or a row escapes
unsplit stays refused, with the op that breaks the proof named.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from unroller.analysis.verify import verify_text
from unroller.importer.api import import_network
from unroller.importer.model import ImportFailure

ZOO = str(Path(__file__).parents[1] / "import_zoo.py")
INPUT = ["x: f32[N, 6, 8]"]


class RowMlp(nn.Module):
    """A residual MLP run on the tokens flattened to rows and viewed back (the residual
    flattened apart, one region with two merges); ``mix`` makes
    one op of the region mix rows, ``leak`` returns the rows unsplit."""

    def __init__(self, mix: str = "", leak: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 8))
        self.mix, self.leak = mix, leak

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, x.size(-1))
        h = torch.softmax(self.fc1(self.norm(rows)), dim=1)  # dim 1 of the rows: dim 2 unmerged
        if self.mix == "mean":
            h = h - h.mean(dim=0, keepdim=True)  # over every row: mixes the batch
        if self.mix == "softmax":
            h = torch.softmax(h, dim=0)
        h = self.fc2(nn.functional.gelu(h)) * self.gain
        out = torch.flatten(x, 0, 1) + h  # a second merge of the same rows
        if self.leak:
            return out
        return out.view(shape)


class GridRows(nn.Module):
    """``[N, A, B, E]`` flattened to ``[N*A*B, E]``, each row reshaped and transposed,
    split back with the trailing dims reshaped too (``[N, A, B*E']``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, a, b, e = x.shape
        rows = torch.flatten(x, 0, 2)
        h = torch.tanh(self.fc(rows)).view(-1, 2, 2).transpose(1, 2)  # within each row
        return h.reshape(n, a, b * 4)


def test_a_flattened_mlp_imports_on_the_unmerged_shapes_and_verifies_exactly():
    text = import_network("row_mlp", INPUT, loss="mse_loss", built=RowMlp()).text
    assert "reshape(" not in text  # both reshapes are identities on [N, 6, 8]
    assert "softmax = softmax(fc1)  # [N, 6, 16]" in text  # over the last dim
    report = verify_text(text, RowMlp, {}, batch_size=3)
    assert report.ok, report.problems or report.table()


def test_a_merge_of_two_dims_split_back_with_the_trailing_dims_reshaped():
    text = import_network("grid", ["x: f32[N, 2, 3, 8]"], loss="mse_loss", built=GridRows()).text
    assert "reshape(" in text and "shape=(2, 12)" in text
    assert "dim0=3, dim1=4" in text  # the rows' dims 1, 2 counted past [N, 2, 3]
    report = verify_text(text, GridRows, {}, batch_size=3)
    assert report.ok, report.problems or report.table()


@pytest.mark.parametrize(
    "kwargs,reason",
    [
        ({"mix": "mean"}, r"aten\.mean\.dim\), which reduces over the merged dim"),
        ({"mix": "softmax"}, r"which is a softmax over the merged dim"),
        ({"leak": True}, r"which is the network's output"),
    ],
)
def test_a_region_that_mixes_rows_or_leaks_them_is_refused_with_the_reason(kwargs, reason):
    with pytest.raises(ImportFailure) as caught:
        import_network("row_mlp", INPUT, loss="mse_loss", built=RowMlp(**kwargs))
    message = str(caught.value)
    assert "reshaping [N, 6, 8] to [6*N, 8] merges the batch dim" in message
    assert "not split back by a reshape to [N, ...]" in message
    assert re.search(reason, message), message


@pytest.fixture(scope="module")
def opt_text() -> str:
    pytest.importorskip("transformers")
    return import_network(f"{ZOO}:hf_opt", ["ids: i64[N, 16]"], "y: i64[N, 16]").text


def test_opt_imports_its_row_wise_mlp_and_verifies_exactly(opt_text):
    """OPT's decoder layer flattens the tokens to rows before its MLP and views them back
    after the residual add; dropout 0.1 (the default) is compared with seeded masks."""
    assert "block opt_decoder_layer(" in opt_text
    block = opt_text.split("block opt_decoder_layer(")[1].split("}")[0]
    assert "fc1 = linear(final_layer_norm, out_features=64)" in block
    assert "dropout_1 = dropout(fc2, p=0.1)" in block
    report = verify_text(opt_text, f"{ZOO}:hf_opt", {})
    assert report.ok, report.problems or report.table()


def test_quant_generation_of_an_imported_opt_runs_a_step(opt_text):
    from unroller.api import generate_from_text
    from unroller.compiler.options import Options

    source = generate_from_text(opt_text, Options(scheme="quant"), label="opt")
    namespace: dict = {}
    exec(compile(source, "opt_quant.py", "exec"), namespace)  # noqa: S102 - our own output
    model = namespace["Model"]()
    loss = model(torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16)))
    assert torch.isfinite(loss)
    assert any("Quant" in row["compressor"] for row in model.stash_report()["rows"])


def swin():
    """``transformers.SwinModel`` from a tiny config: 32x32 images, windows of 4x4."""
    from transformers import SwinConfig, SwinModel

    config = SwinConfig(
        image_size=32,
        patch_size=4,
        embed_dim=16,
        depths=[1, 1],
        num_heads=[2, 2],
        window_size=4,
        drop_path_rate=0.0,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return SwinModel(config)


def test_swin_window_partition_stays_refused_and_is_named():
    """Swin merges its windows into the batch and runs attention per window: not proven
    row-wise here, so the merge is refused, named a window partition."""
    pytest.importorskip("transformers")
    with pytest.raises(ImportFailure) as caught:
        import_network("swin", ["x: f32[N, 3, 32, 32]"], loss="mse_loss", built=swin())
    message = str(caught.value)
    assert "merges the batch dim (a window partition, as Swin's" in message
    assert "scaled_dot_product_attention" in message


class DebertaLike(nn.Module):
    """DeBERTa-v2's attention as it writes it: heads merged with the batch for ``bmm``
    (``[N, H, L, D] -> [N*H, L, D]``), the scores divided by a constant scalar tensor, a
    constant mask of ones multiplied in and a fill under its (empty) complement, then
    split back."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.qkv = nn.Linear(8, 24)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        n, length, _ = x.shape
        mask = torch.ones(n, length, 1)
        x = x * mask
        q, k, v = (
            t.view(n, length, 2, 4).transpose(1, 2).reshape(n * 2, length, 4)
            for t in self.qkv(x).chunk(3, dim=-1)
        )
        scale = torch.sqrt(torch.tensor(4, dtype=torch.float) * 2)
        scores = torch.bmm(q, k.transpose(-1, -2)) / scale.to(q.dtype)
        scores = scores.view(n, 2, length, length)
        blocked = ~torch.ones(n, 1, length, length, dtype=torch.bool)
        scores = scores.masked_fill(blocked, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1).view(n * 2, length, length)
        a = torch.bmm(probs, v).view(n, 2, length, 4)
        return self.out(a.transpose(1, 2).reshape(n, length, 8))


def test_bmm_on_merged_heads_and_constant_masks_import_and_verify_exactly():
    text = import_network(
        "deberta_like", ["x: f32[N, 5, 8]"], loss="mse_loss", built=DebertaLike()
    ).text
    assert "aten(" not in text  # bmm row-wise, the scale a factor, the masks identities
    assert "matmul(" in text and "scale(" in text
    report = verify_text(text, DebertaLike, {}, batch_size=3)
    assert report.ok, report.problems or report.table()
