"""``unroller.unroll`` and ``unroller.analysis.verify``: a torch.nn module in, its unrolled step out.

- training through it equals training the original under autograd: three SGD steps in
  float64 leave the same weights to 1e-10, with the optimizer over the original's
  parameters (the generated module shares them, buffers included);
- the generated source is cached under its content hash and reused; ``source`` and
  ``source_path`` show it; a compressing scheme trains too;
- the README's Python example runs as written.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, rel_err
from torch import nn

import unroller


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 8 * 8, 5)

    def forward(self, x):
        return self.fc(torch.flatten(F.relu(self.bn(self.conv(x))), 1))


def test_training_through_it_equals_autograd(tmp_path):
    torch.manual_seed(0)
    net = Net().double()
    twin = copy.deepcopy(net)
    x, y = torch.randn(4, 3, 8, 8, dtype=torch.float64), torch.randint(0, 5, (4,))
    step = unroller.unroll(net, (x,), y, directory=tmp_path)
    assert (
        step.model.fc.weight is net.fc.weight and step.model.bn.running_mean is net.bn.running_mean
    )
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    opt_twin = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        opt.zero_grad()
        loss = step(x, y)
        opt.step()
        opt_twin.zero_grad()
        want = F.cross_entropy(twin(x), y)
        want.backward()
        opt_twin.step()
        assert rel_err(loss, want) <= 1e-10
    for (name, a), b in zip(net.state_dict().items(), twin.state_dict().values()):
        assert rel_err(a.double(), b.double()) <= 1e-10, name


def test_the_source_is_cached_and_readable(tmp_path):
    torch.manual_seed(0)
    net = Net()
    x, y = torch.randn(2, 3, 8, 8), torch.randint(0, 5, (2,))
    first = unroller.unroll(net, x, y, scheme="quant", directory=tmp_path)
    assert first.source_path.parent == tmp_path and first.source_path.name.startswith("net_")
    assert first.source_path.read_text(encoding="utf-8") == first.source
    assert "model net {" in first.text and 'C.make("quant"' in first.source
    stamp = first.source_path.stat().st_mtime_ns
    again = unroller.unroll(net, x, y, scheme="quant", directory=tmp_path)
    assert again.source_path == first.source_path
    assert again.source_path.stat().st_mtime_ns == stamp  # not written again
    loss = again(x, y)
    assert torch.isfinite(loss) and net.conv.weight.grad is not None
    assert len(list(tmp_path.glob("*.py"))) == 1
    other = unroller.unroll(net, x, y, directory=tmp_path)  # another scheme: another file
    assert other.source_path != first.source_path


def test_verify_reports_exactness():
    torch.manual_seed(0)
    net = Net()
    report = unroller.analysis.verify(net, (torch.randn(2, 3, 8, 8),), torch.randint(0, 5, (2,)))
    assert report.ok, report.problems or report.table()
    assert net.conv.weight.dtype == torch.float32  # the original is left as it was


def test_readme_example_runs(monkeypatch, tmp_path):
    pytest.importorskip("transformers")
    from unroller import oneshot

    monkeypatch.setattr(oneshot, "cache_dir", lambda: tmp_path)  # not the user's cache
    text = (Path(ROOT) / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    example = next(b for b in blocks if "unroller.unroll(" in b)
    namespace: dict = {}
    exec(compile(example, "README.md", "exec"), namespace)  # noqa: S102 - our README
    assert torch.isfinite(namespace["loss"]) and len(list(tmp_path.glob("*.py"))) == 1
    assert all(p.grad is not None for p in namespace["net"].parameters())


def test_named_inputs_reach_an_encoder_decoder_by_keyword(tmp_path):
    """A dict of inputs names them: ``decoder_input_ids`` reaches T5's forward by keyword;
    the step then takes them positionally in the dict's order, and one step's loss and
    gradients equal autograd's on the original (float64)."""
    pytest.importorskip("transformers")
    import sys

    sys.path.insert(0, str(ROOT / "tests"))
    from import_zoo import hf_t5

    torch.manual_seed(0)
    t5 = hf_t5().double()
    twin = copy.deepcopy(t5)
    # T5LayerNorm takes the mean in float32 even in float64: compare with what it computes
    # without that cast, as verify does (unroller.importer.hf_norms)
    from unroller.importer.hf_norms import swap_float64_twins

    assert swap_float64_twins(twin)
    ids, dec, y = (torch.randint(0, 64, (2, n)) for n in (12, 8, 8))
    step = unroller.unroll(t5, {"input_ids": ids, "decoder_input_ids": dec}, y, directory=tmp_path)
    loss = step(ids, dec, y)
    logits = twin(input_ids=ids, decoder_input_ids=dec).logits
    want = F.cross_entropy(logits.transpose(1, 2), y)
    want.backward()
    assert rel_err(loss, want) <= 1e-10
    theirs = dict(twin.named_parameters())
    for name, p in t5.named_parameters():
        assert rel_err(p.grad, theirs[name].grad) <= 1e-10, name
    with pytest.raises(ValueError, match="expected an identifier"):
        unroller.unroll(t5, {"input ids": ids}, y, directory=tmp_path)
