"""``unroll verify`` and ``unroller.analysis.verify``: model texts against torch.nn modules.

Each original is a small module written here, saved as ``tmp_path/x.py`` and named by the
``path.py:Name`` SPEC, as a user would. A faithful text passes (exit 0, a table); a text
that differs in a number the shapes do not show (an eps, a padding) fails on the rows it
touches (exit 1); different state-dict names fail before any step (exit 1, every key
named); a SPEC that does not load, a broken model file, or a text that is not
``prediction -> shape ops -> loss`` is a user error (exit 2, no traceback).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from unroller.analysis.verify import VerifyError, relative_error, verify, verify_text
from unroller.cli import app

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()

MODULES = """\
import torch
from torch import nn
import torch.nn.functional as F


class Classifier(nn.Module):
    def __init__(self, classes=5, head="fc"):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(6)
        self.head = head
        self.add_module(head, nn.Linear(6, classes))

    def forward(self, x):
        x = F.relu(self.bn(self.conv(x)))
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        return getattr(self, self.head)(x)


class Renamed(Classifier):
    def __init__(self):
        super().__init__(head="classifier")


class Tokens(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.head = nn.Linear(8, 7)

    def forward(self, ids):
        return {"logits": self.head(self.emb(ids))}


class Dropped(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(self.drop(torch.tanh(self.fc1(x))))


class Block(nn.Module):
    def __init__(self, cin, planes, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = None
        if stride != 1 or cin != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x):
        out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(out + (x if self.shortcut is None else self.shortcut(x)))


class ResNetLike(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.layer1 = nn.Sequential(Block(16, 16), Block(16, 16))
        self.layer2 = nn.Sequential(Block(16, 32, 2), Block(32, 32))
        self.layer3 = nn.Sequential(Block(32, 64, 2), Block(64, 64))
        self.linear = nn.Linear(64, classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.linear(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
"""

CLASSIFIER = """\
model classifier {
    input x: f32[N, 3, 8, 8]
    target y: i64[N]
    conv = conv2d(x, out_channels=6, kernel_size=3, padding=1, bias=false)
    bn = batchnorm2d(conv)
    r = relu(bn)
    pool = adaptive_avgpool2d(r, output_size=1)
    flat = flatten(pool)
    fc = linear(flat, out_features=5)
    loss = cross_entropy(fc, y)
    return loss, fc
}
"""

TOKENS = """\
model tokens {
    input ids: i64[N, 6]
    target y: i64[N, 6]
    emb = embedding(ids, num_embeddings=11, embedding_dim=8)
    head = linear(emb, out_features=7)                  # [N, 6, 7]: classes last
    logits = permute(head, dims=(0, 2, 1))              # [N, 7, 6]: classes at dim 1
    loss = cross_entropy(logits, y, label_smoothing=0.1)
    return loss, head
}
"""

DROPPED = """\
model dropped {
    input x: f32[N, 6]
    target y: i64[N]
    fc1 = linear(x, out_features=16)
    t = tanh(fc1)
    drop = dropout(t, p=0.5)
    fc2 = linear(drop, out_features=3)
    loss = cross_entropy(fc2, y)
    return loss, fc2
}
"""


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temp working directory holding x.py (the originals) and the model texts."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text(MODULES, encoding="utf-8")
    for name, text in (("classifier", CLASSIFIER), ("tokens", TOKENS), ("dropped", DROPPED)):
        (tmp_path / f"{name}.txt").write_text(text, encoding="utf-8")
    return tmp_path


def invoke(*args: str):
    return runner.invoke(app, ["verify", *args])


def failed_names(output: str) -> set[str]:
    """The names of the table's FAIL rows ("loss", "grad KEY", "buffer KEY", ...)."""
    rows = [line.split() for line in output.splitlines() if " FAIL" in line]
    return {words[0] if words[0] == "loss" else " ".join(words[:2]) for words in rows}


# ---- passes ----------------------------------------------------------------------------


def test_a_faithful_classifier_passes(work):
    result = invoke("classifier.txt", "--against", "x.py:Classifier")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "max |ref|" in out and "rel. error" in out
    for row in ("loss", "grad conv.weight", "grad fc.bias", "buffer bn.running_var"):
        assert row in out
    assert "buffer bn.num_batches_tracked" in out and "predictions (eval)" in out
    assert out.strip().splitlines()[-1].startswith("ok: 10 values match within 1e-10")
    assert "FAIL" not in out


def test_the_api_report(work):
    report = verify("classifier.txt", "x.py:Classifier", kwargs={"classes": 5}, batch_size=3)
    assert report.ok and not report.problems
    assert [row.name for row in report.rows][:2] == ["loss", "grad conv.weight"]
    assert all(row.rel <= 1e-10 for row in report.rows)
    assert report.rows[-1].shape == (3, 5)


def test_a_per_token_model_with_class_last_logits_passes(work):
    result = invoke("tokens.txt", "--against", "x.py:Tokens", "--seed", "3")
    assert result.exit_code == 0, result.output
    assert "head -> permute(dims=(0, 2, 1)) -> cross_entropy(" in result.stdout
    assert "label_smoothing=0.1" in result.stdout


def test_resnet_like_passes(work):
    model = ROOT / "benchmarks" / "models" / "resnet_like.txt"
    result = invoke(str(model), "--against", "x.py:ResNetLike")
    assert result.exit_code == 0, result.output
    assert "grad layer2.0.shortcut.0.weight" in result.stdout
    assert "buffer layer3.1.bn2.running_mean" in result.stdout


def test_the_callers_random_state_is_kept(work):
    torch.manual_seed(123)
    want = torch.rand(3)
    torch.manual_seed(123)
    verify_text(CLASSIFIER, lambda: _classifier(work))
    assert torch.equal(torch.rand(3), want)


def test_a_module_object_is_verified_on_a_copy(work):
    module = _classifier(work)
    weight = module.fc.weight.detach().clone()
    assert verify_text(CLASSIFIER, module).ok
    assert module.fc.weight.dtype == torch.float32 and module.fc.weight.grad is None
    assert torch.equal(module.fc.weight, weight)


def _classifier(work: Path) -> torch.nn.Module:
    from unroller.importer.source import build_module

    return build_module(f"{work / 'x.py'}:Classifier")


# ---- differences: exit 1 ---------------------------------------------------------------


@pytest.mark.parametrize(
    "edit",
    [
        ("bn = batchnorm2d(conv)", "bn = batchnorm2d(conv, eps=0.001)"),
        ("kernel_size=3, padding=1", "kernel_size=3, padding=2"),
    ],
    ids=["eps", "padding"],
)
def test_a_wrong_number_fails_on_the_rows_it_touches(work, edit):
    Path("classifier.txt").write_text(CLASSIFIER.replace(*edit), encoding="utf-8")
    result = invoke("classifier.txt", "--against", "x.py:Classifier")
    assert result.exit_code == 1, result.output
    failed = failed_names(result.stdout)
    assert {"grad conv.weight", "grad bn.weight", "grad fc.weight", "loss"} <= failed, failed
    assert "buffer bn.num_batches_tracked" not in failed
    assert result.stdout.strip().splitlines()[-1].startswith("FAIL: ")
    assert "grad conv.weight" in result.stdout.strip().splitlines()[-1]


def test_different_keys_fail_naming_every_key(work):
    result = invoke("classifier.txt", "--against", "x.py:Renamed")
    assert result.exit_code == 1, result.output
    out = result.stdout
    for key in ("classifier.weight", "classifier.bias"):
        assert f"'{key}'" in out and "in the original only" in out
    for key in ("fc.weight", "fc.bias"):
        assert f"'{key}' " in out and "in the generated module only" in out
    assert "(the generated module has 'fc.weight')" in out
    assert "max |ref|" not in out  # no step was compared
    assert out.strip().splitlines()[-1].startswith("FAIL")


def test_a_shape_mismatch_fails(work):
    text = CLASSIFIER.replace("out_channels=6", "out_channels=4")
    report = verify_text(text, lambda: _classifier(work))
    assert not report.ok and not report.rows
    assert any("'conv.weight': shape [4, 3, 3, 3]" in p for p in report.problems)


def test_a_prediction_of_another_shape_fails(work):
    text = TOKENS.replace("return loss, head", "return loss, logits")
    report = verify_text(text, "x.py:Tokens")
    assert not report.ok and not report.rows
    assert "its prediction has shape [2, 6, 7], the model text's 'logits' is [N, 7, 6]" in (
        report.problems[0]
    )


# ---- dropout ---------------------------------------------------------------------------


def test_dropout_seeded_draws_the_same_masks(work):
    result = invoke("dropped.txt", "--against", "x.py:Dropped", "--batch-size", "4")
    assert result.exit_code == 0, result.output
    assert "dropout with p > 0 (in the text: drop (p=0.5); in the original: drop" in result.stdout
    assert "both sides are seeded with 0" in result.stdout


def test_dropout_off(work):
    result = invoke("dropped.txt", "--against", "x.py:Dropped", "--dropout", "off")
    assert result.exit_code == 0, result.output
    assert "dropout off: p set to 0 on both sides" in result.stdout
    result = invoke("dropped.txt", "--against", "x.py:Dropped", "--dropout", "maybe")
    assert result.exit_code == 2
    assert "unknown --dropout 'maybe' (known: seeded, off)" in result.stderr


def test_dropout_on_one_side_only_fails(work):
    Path("dropped.txt").write_text(DROPPED.replace("p=0.5", "p=0.0"), encoding="utf-8")
    result = invoke("dropped.txt", "--against", "x.py:Dropped")
    assert result.exit_code == 1, result.output
    assert "in the original: drop (Dropout, p=0.5)" in result.stdout


# ---- user errors: exit 2 ---------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nope.py:Net", "SPEC 'nope.py:Net': nope.py is not a file"),
        ("x.py:Missing", "x.py has no attribute 'Missing'"),
        ("x.py", "expected package.module:Name"),
        ("no_such_package_xyz:Net", "cannot import no_such_package_xyz"),
    ],
)
def test_a_bad_spec_is_a_user_error(work, spec, message):
    result = invoke("classifier.txt", "--against", spec)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("unroll: error: ") and message in result.stderr
    assert "Traceback" not in result.output


def test_bad_kwargs_are_a_user_error(work):
    result = invoke("classifier.txt", "--against", "x.py:Classifier", "--kwargs", "[1]")
    assert result.exit_code == 2, result.output
    assert "--kwargs: expected a JSON object" in result.stderr


def test_a_broken_model_file_points_at_the_line(work):
    Path("classifier.txt").write_text(CLASSIFIER.replace("padding=1,", "paddin=1,"))
    result = invoke("classifier.txt", "--against", "x.py:Classifier")
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("classifier.txt:4:")
    assert "Traceback" not in result.output


def test_a_loss_that_is_not_replayable_is_a_user_error(work):
    text = CLASSIFIER.replace(
        "    loss = cross_entropy(fc, y)",
        "    lp = log_softmax(fc, dim=1)\n    loss = nll_loss(lp, y)",
    )
    Path("classifier.txt").write_text(text, encoding="utf-8")
    result = invoke("classifier.txt", "--against", "x.py:Classifier")
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("classifier.txt:11:")
    assert "prediction -> shape ops -> loss" in result.stderr
    assert "'lp' = log_softmax(...) is on the way" in result.stderr
    with pytest.raises(VerifyError):
        verify_text(text, lambda: _classifier(work))


def test_relative_error_is_against_the_tensors_scale():
    ref = torch.tensor([1e-20, 2.0, -4.0], dtype=torch.float64)
    got = ref + torch.tensor([1e-18, 0.0, 4e-12], dtype=torch.float64)
    ref_max, diff, rel = relative_error(got, ref)
    assert ref_max == 4.0 and diff == pytest.approx(4e-12) and rel == pytest.approx(1e-12)
    zeros = torch.zeros(2, dtype=torch.float64)
    assert relative_error(zeros, zeros) == (0.0, 0.0, 0.0)
    assert relative_error(zeros + 1e-30, zeros)[2] > 1e10


BIAS_BEFORE_BN = """
model biased {
    input x: f32[N, 3, 8, 8]
    target y: i64[N]
    conv = conv2d(x, out_channels=4, kernel_size=3, padding=1)
    bn = batchnorm2d(conv)
    r = relu(bn)
    pool = adaptive_avgpool2d(r, output_size=1)
    flat = flatten(pool)
    fc = linear(flat, out_features=3)
    loss = cross_entropy(fc, y)
    return loss, fc
}
"""

BIASED_MODULE = """
import torch
from torch import nn


class Biased(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv(x)))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))
"""


def test_a_gradient_zero_in_exact_arithmetic_passes_as_noise_and_says_so():
    # rows as a BERT step gives them: the key bias's gradient is 0 in exact arithmetic.
    # Judged against the step's largest gradient, whatever the noise's size on this CPU:
    # only whether the reference reproduces on the doubled batch matters.
    from unroller.analysis.verify import Row, _noise_checked

    rows = [
        Row("grad q.weight", (4, 4), 0.338, 1e-17, 3e-17, True),
        Row("grad k.bias", (4,), 4.6e-22, 5.7e-22, 1.23, False),  # diff 100x the twin's
        Row("grad v.bias", (4,), 2e-15, 3e-15, 1.5, False),  # noise 1e7x larger: still noise
        Row("grad zero", (4,), 0.0, 1e-20, float("inf"), False),  # exactly 0 on one side
        Row("grad small", (4,), 1e-12, 1e-16, 1e-4, False),  # small but real: still fails
        Row("grad branch", (4,), 3e-16, 3e-16, 1.0, False),  # reproduces: real, dropped
        Row("grad wrong", (4,), 1e-15, 1e-10, 1e5, False),  # noise reference, real difference
        Row("loss", (), 2.0, 0.0, 0.0, True),
    ]
    noise = {"grad k.bias": 5e-24, "grad v.bias": 1e-15, "grad branch": 1e-31}
    noise |= {"grad small": 1e-28, "grad wrong": 1e-15}
    checked = {row.name: row for row in _noise_checked(rows, noise)}
    assert checked["grad k.bias"].ok and checked["grad v.bias"].ok and checked["grad zero"].ok
    assert checked["grad k.bias"].note.startswith("zero in exact arithmetic")
    assert not checked["grad small"].ok and not checked["grad wrong"].ok
    assert not checked["grad branch"].ok


def test_a_biased_conv_before_batch_norm_verifies(tmp_path):
    (tmp_path / "biased.py").write_text(BIASED_MODULE)
    report = verify_text(BIAS_BEFORE_BN, f"{tmp_path / 'biased.py'}:Biased")
    assert report.ok, report.table()


def test_a_small_but_real_gradient_error_still_fails(tmp_path):
    # the noise rule does not hide a wrong gradient: a wrong eps changes every gradient
    (tmp_path / "biased.py").write_text(BIASED_MODULE)
    text = BIAS_BEFORE_BN.replace("bn = batchnorm2d(conv)", "bn = batchnorm2d(conv, eps=1e-3)")
    report = verify_text(text, f"{tmp_path / 'biased.py'}:Biased")
    assert not report.ok
    failed = {row.name for row in report.failed}
    assert "grad conv.weight" in failed and "grad conv.bias" not in failed
