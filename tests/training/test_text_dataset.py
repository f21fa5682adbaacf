"""The ``pysource`` character language-model task: the corpus (the standard library's
own sources, split by file), its vocabulary and windows, the bits-per-character metric,
how a model is recognised as a language model, and the wiring into ``unroll train``.

The operators an actual language model needs (embedding, per-token cross_entropy,
permute) come from other work; until the registry has them the end-to-end test at the
bottom is skipped, and task detection is tested on hand-built graphs of the same form.
"""

from __future__ import annotations

import hashlib
import math
import platform
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from unroller import data
from unroller.api import graph_from_text
from unroller.cli import app
from unroller.compiler.registry import load_registry
from unroller.compiler.shapes import BATCH, TensorType
from unroller.data import DatasetError, pysource
from unroller.data.core import Signature, signature
from unroller.training.loop import evaluate
from unroller.training.metrics import MetricSet, bits_per_char

CLASSIFIER = """
model c {
    input x: f32[N, 1, 8, 8]
    target y: i64[N]
    flat = flatten(x)
    fc = linear(flat, out_features=10)
    loss = cross_entropy(fc, y)
    return loss, fc
}
"""


def lm_signature(length: int = 16, vocab: int = 128, **changes) -> Signature:
    """The signature a character LM ``ids i64[N, L] -> logits [N, V, L]`` has."""
    sig = Signature(
        model="lm",
        input_name="ids",
        input_shape=(length,),
        target_name="y",
        target_shape=(length,),
        target_dtype="i64",
        pred_shape=(vocab, length),
        loss_op="cross_entropy",
        task="language_modelling",
        input_dtype="i64",
        vocab=vocab,
        pred_class_dim=1,
    )
    return replace(sig, **changes)


# -- a small fake standard library -------------------------------------------------------


FAKE_FILES = {
    "os.py": "import sys\r\nx = 1\n",
    "bz2.py": "import _bz2\n" * 20,  # bz2.py and calendar.py are validation files
    "calendar.py": "def month():\n    pass\n" * 10,
    "json/__init__.py": "def f():\n    return 'caf\u00e9'\n",
    "json/decoder.py": "# decoder\n" * 40,
    "email/parser.py": "class P:\n    pass\n" * 30,
    "test/test_os.py": "assert True\n",  # the test suite is left out
    "lib2to3/tests/data.py": "x\n",
    "idlelib/idle_test/t.py": "y\n",
    "site-packages/pkg/mod.py": "third party\n",
    "dist-packages/m.py": "z\n",
    "__pycache__/os.cpython-311.py": "cached\n",
    "notes.txt": "not python\n",
}


@pytest.fixture
def fake_stdlib(tmp_path: Path) -> Path:
    root = tmp_path / "lib" / "python3.x"
    for rel, text in FAKE_FILES.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text.encode("utf-8"))
    (root / "latin.py").write_bytes(b"s = '\xe9'\n")  # not UTF-8: one replacement char
    return root


def test_source_files_leave_out_tests_third_party_and_caches(fake_stdlib):
    assert pysource.source_files(fake_stdlib) == [
        "bz2.py",
        "calendar.py",
        "email/parser.py",
        "json/__init__.py",
        "json/decoder.py",
        "latin.py",
        "os.py",
    ]


def test_a_files_split_is_the_sha256_of_its_relative_path():
    for rel in ("os.py", "json/decoder.py", "asyncio/tasks.py", "a/b/c.py"):
        head = int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big")
        assert pysource.is_validation(rel) == (head / 2**64 < 0.10)
    # pinned, so a change of the rule (and so of every published number) is noticed
    pinned = {"os.py": False, "ast.py": False, "bz2.py": True, "calendar.py": True}
    assert {p: pysource.is_validation(p) for p in pinned} == pinned
    paths = [f"pkg{i}/mod{i}.py" for i in range(4000)]
    share = sum(map(pysource.is_validation, paths)) / len(paths)
    assert 0.08 < share < 0.12


def test_encoding_is_ascii_with_one_bucket_for_everything_else():
    assert list(pysource.encode("a\r\nb\rc\té€")) == [97, 10, 98, 10, 99, 9, 127, 127]
    assert pysource.decode([104, 105, 127, 10]) == "hi\ufffd\n"
    assert pysource.decode(torch.tensor([65, 66])) == "AB"


def test_corpus_streams_concatenate_each_splits_files_in_path_order(fake_stdlib):
    corpus = pysource.read_corpus(str(fake_stdlib))
    expected = {False: b"", True: b""}
    for rel in pysource.source_files(fake_stdlib):
        text = (fake_stdlib / rel).read_bytes().decode("utf-8", errors="replace")
        expected[pysource.is_validation(rel)] += pysource.encode(text)
    assert corpus.train == expected[False] and corpus.test == expected[True]
    assert (corpus.train_files, corpus.test_files) == (5, 2)
    assert b"third party" not in corpus.train + corpus.test
    assert b"s = '\x7f'\n" in corpus.train + corpus.test  # the undecodable byte


def test_a_corpus_without_both_splits_is_refused(tmp_path):
    root = tmp_path / "lib"
    root.mkdir()
    (root / "os.py").write_text("x = 1\n")  # one file: only one split can have text
    with pytest.raises(DatasetError, match="no Python sources found under .* for both splits"):
        pysource.read_corpus(str(root))
    with pytest.raises(DatasetError, match="does not exist"):
        pysource.read_corpus(str(tmp_path / "missing"))


# -- windows -------------------------------------------------------------------------------


def test_windows_are_non_overlapping_and_targets_are_the_next_character():
    stream = bytes(range(1, 42))  # 41 characters: (41 - 1) // 8 = 5 windows of 8 (+1)
    split = pysource.windows(stream, 8, None)
    assert split.inputs.shape == split.targets.shape == (5, 8)
    assert split.inputs.dtype == split.targets.dtype == torch.int64
    assert split.inputs[:, 0].tolist() == [1, 9, 17, 25, 33]
    assert torch.equal(split.targets, split.inputs + 1)  # the stream counts up by one
    assert split.targets[-1, -1].item() == 41  # the last character is predicted


def test_windows_subset_is_evenly_spaced_and_capped():
    assert pysource.window_starts(101, 10, 4).tolist() == [0, 20, 50, 70]  # floor(i*10/4)*10
    assert pysource.window_starts(101, 10, 50).tolist() == list(range(0, 100, 10))
    assert pysource.window_starts(5, 10, 3).tolist() == []  # shorter than a window


def test_build_on_a_fake_stdlib_is_deterministic(fake_stdlib):
    sig = lm_signature(length=8)
    first = pysource.build(sig, train_size=6, test_size=2, root=fake_stdlib)
    again = pysource.build(sig, train_size=6, test_size=2, root=fake_stdlib)
    assert torch.equal(first.train.inputs, again.train.inputs)
    assert torch.equal(first.test.targets, again.test.targets)
    assert first.description == again.description
    assert len(first.train) == 6 and first.task == "language_modelling"
    assert not first.synthetic


@pytest.fixture(scope="module")
def real() -> data.TaskData:
    return data.load("pysource", lm_signature(length=64))


def test_the_real_corpus_default_sizes_and_vocabulary(real):
    assert real.train.inputs.shape == (pysource.DEFAULT_TRAIN, 64)
    assert real.test.inputs.shape == (pysource.DEFAULT_TEST, 64)
    for split in (real.train, real.test):
        assert split.inputs.dtype == split.targets.dtype == torch.int64
        assert 0 <= split.inputs.min() and split.inputs.max() < pysource.VOCAB_SIZE
        assert torch.equal(split.targets[:, :-1], split.inputs[:, 1:])
    assert real.description.startswith(f"Python {platform.python_version()} standard library")
    assert "8,192 of" in real.description and "131,072 characters scored" in real.description
    text = pysource.decode(real.train.inputs[:200].flatten())
    assert "def " in text and "return" in text  # it is Python source


def test_the_real_split_is_by_file_and_about_a_tenth(real):
    root = pysource.stdlib_root()
    files = pysource.source_files(root)
    validation = [f for f in files if pysource.is_validation(f)]
    assert 0.05 < len(validation) / len(files) < 0.2
    assert not any(f.split("/")[0] in ("test", "site-packages") for f in files)
    corpus = pysource.read_corpus(str(root))
    assert corpus.test_files == len(validation)
    assert 0.05 < len(corpus.test) / (len(corpus.train) + len(corpus.test)) < 0.25
    # a validation window's text does not occur in the training stream (split by file)
    window = bytes(real.test.inputs[len(real.test) // 2].to(torch.uint8).tolist())
    assert window not in corpus.train


def test_sizes_choose_evenly_spaced_windows_and_the_same_seed_gives_the_same_data():
    sig = lm_signature(length=32)
    small = data.load("pysource", sig, seed=0, train_size=100, test_size=10)
    other_seed = data.load("pysource", sig, seed=5, train_size=100, test_size=10)
    assert small.train.inputs.shape == (100, 32) and small.test.inputs.shape == (10, 32)
    assert torch.equal(small.train.inputs, other_seed.train.inputs)  # data seed not used
    corpus = pysource.read_corpus(str(pysource.stdlib_root()))
    starts = pysource.window_starts(len(corpus.train), 32, 100)
    assert (starts[1:] - starts[:-1]).min() > 32 * 1000  # spread over the whole stream
    assert (
        bytes(small.train.inputs[7].to(torch.uint8).tolist())
        == corpus.train[starts[7] : starts[7] + 32]
    )
    assert "; the first" not in small.description  # cut while built, not by head()
    with pytest.raises(DatasetError, match="positive"):
        data.load("pysource", sig, train_size=0)


# -- bits per character ----------------------------------------------------------------------


def test_bits_per_char_of_uniform_scores_is_log2_of_the_classes():
    logits = torch.zeros(3, 4, 5)  # [N, C, L]
    target = torch.randint(0, 4, (3, 5))
    assert bits_per_char(logits, target) == pytest.approx(2.0, abs=1e-12)


def test_bits_per_char_hand_made_and_layouts():
    # two classes, p = (1/4, 3/4) at every position: target 1 costs log2(4/3), 0 costs 2
    row = torch.tensor([0.0, math.log(3.0)], dtype=torch.float64)
    logits_nlc = row.expand(1, 4, 2)  # [N, L, C]
    target = torch.tensor([[1, 1, 0, 1]])
    expected = (3 * math.log2(4 / 3) + 2.0) / 4
    assert bits_per_char(logits_nlc, target, class_dim=2) == pytest.approx(expected, abs=1e-12)
    assert bits_per_char(logits_nlc.transpose(1, 2), target) == pytest.approx(expected, abs=1e-12)
    ignored = torch.tensor([[1, -100, 0, -100]])  # torch's ignore_index is not scored
    half = (math.log2(4 / 3) + 2.0) / 2
    assert bits_per_char(logits_nlc, ignored, class_dim=2) == pytest.approx(half, abs=1e-12)


def test_metric_set_scores_a_set_as_one_batch_whatever_the_batches():
    torch.manual_seed(0)
    logits, target = torch.randn(7, 6, 5).double(), torch.randint(0, 6, (7, 5))
    target[2, 3] = -100
    scores = MetricSet("language_modelling")
    for lo, hi in ((0, 1), (1, 5), (5, 7)):  # unequal batches: a mean of means would differ
        scores.update(logits[lo:hi], target[lo:hi])
    result = scores.result()
    nats = F.cross_entropy(logits, target, reduction="sum").item()
    assert result["bpc"] == pytest.approx(nats / 34 / math.log(2), rel=1e-12)
    assert result["loss"] == pytest.approx(F.cross_entropy(logits, target).item(), rel=1e-12)
    hits = ((logits.argmax(1) == target) & (target >= 0)).sum().item()
    assert result["char_accuracy"] == pytest.approx(100 * hits / 34)
    as_nlc = MetricSet("language_modelling", class_dim=2)
    as_nlc.update(logits.transpose(1, 2), target)
    assert as_nlc.result() == pytest.approx(result)


def test_evaluate_reads_scores_from_the_prediction_layout():
    torch.manual_seed(1)
    head = torch.randn(128, 128).double()
    model = SimpleNamespace(predict=lambda ids: head[ids])  # [N, L, C]
    split = data.Split(torch.randint(0, 128, (9, 6)), torch.randint(0, 128, (9, 6)))
    got = evaluate(model, split, "language_modelling", False, 4, "cpu", class_dim=2)
    assert got["bpc"] == pytest.approx(bits_per_char(head[split.inputs], split.targets, 2))


# -- recognising a language model --------------------------------------------------------


def _value(name, dtype, shape, kind="value", producer=None):
    return SimpleNamespace(
        name=name, kind=kind, producer=producer, type=TensorType(dtype, (BATCH, *shape))
    )


def lm_graph(length=16, vocab=128, pred="logits_t", ids_dtype="i64", target_len=None):
    """A graph of the form ids -> ... -> logits [N, L, V] -> permute -> cross_entropy,
    as far as ``signature`` reads it (the real operators are not in this branch)."""
    ids = _value("ids", ids_dtype, (length,), "input")
    y = _value("y", "i64", (target_len or length,), "target")
    logits = _value("logits", "f32", (length, vocab))
    permute = SimpleNamespace(op=SimpleNamespace(name="permute"), inputs=[logits], output=None)
    logits_t = _value("logits_t", "f32", (vocab, length), producer=permute)
    permute.output = logits_t
    loss = _value("loss", "f32", ())
    ce = SimpleNamespace(op=SimpleNamespace(name="cross_entropy"), inputs=[logits_t, y])
    ce.output = loss
    preds = {"logits_t": logits_t, "logits": logits}
    return SimpleNamespace(
        name="lm",
        inputs=[ids, y],
        model_inputs=[ids],
        nodes=[permute, ce],
        loss=loss,
        preds=[preds[pred]],
    )


def test_a_per_token_cross_entropy_is_a_language_model():
    sig = signature(lm_graph())
    assert sig.task == "language_modelling"
    assert (sig.vocab, sig.pred_class_dim, sig.input_dtype) == (128, 1, "i64")
    assert sig.input_shape == sig.target_shape == (16,)
    assert pysource.check(sig) == 16


@pytest.mark.parametrize(
    ("length", "vocab", "pred", "dim"),
    [
        (16, 128, "logits_t", 1),
        (16, 128, "logits", 2),  # the prediction before the permute
        (128, 128, "logits", 2),  # C == L: told apart by the permute
        (128, 128, "logits_t", 1),
    ],
)
def test_the_prediction_layout_is_found(length, vocab, pred, dim):
    assert signature(lm_graph(length, vocab, pred)).pred_class_dim == dim


def test_a_square_prediction_not_tied_to_the_loss_is_refused():
    graph = lm_graph(128, 128, "logits")
    graph.nodes[0].op.name = "relu"  # not a permute: which dim is C cannot be told
    sig = signature(graph)
    assert sig.pred_class_dim is None
    with pytest.raises(DatasetError, match="cannot tell which dim of the prediction"):
        pysource.check(sig)


def test_a_classifier_stays_a_classifier():
    sig = signature(graph_from_text(CLASSIFIER))
    assert sig.task == "classification" and sig.vocab is None and sig.input_dtype == "f32"


REFUSALS = [
    (
        {"vocab": 96},
        "dataset 'pysource' has a vocabulary of 128 characters (ASCII, id 127 for any other), "
        "but model 'lm' (input ids: [16], target y: [16]) scores 96 classes per token",
    ),
    (
        {"target_len": 15},
        "dataset 'pysource' gives character ids i64[N, L] and targets i64[N, L] of the same L, "
        "but model 'lm' (input ids: [16], target y: [15]) declares input i64[16]",
    ),
    (
        {"ids_dtype": "f32"},
        "dataset 'pysource' gives character ids i64[N, L] and targets i64[N, L] of the same L, "
        "but model 'lm' (input ids: [16], target y: [16]) declares input f32[16]",
    ),
]


@pytest.mark.parametrize(("change", "message"), REFUSALS)
def test_a_language_model_that_does_not_fit_is_refused_in_one_line(change, message):
    with pytest.raises(DatasetError) as info:
        data.load("pysource", signature(lm_graph(**change)))
    assert str(info.value) == message


def test_other_tasks_and_datasets_do_not_mix():
    with pytest.raises(DatasetError) as info:
        data.load("pysource", signature(graph_from_text(CLASSIFIER)))
    assert str(info.value) == (
        "dataset 'pysource' is a language_modelling task (character ids [N, L], next-character "
        "targets [N, L]), but model 'c' (input x: [1, 8, 8], target y: []) is trained for "
        "classification (its loss is cross_entropy)"
    )
    with pytest.raises(DatasetError, match="dataset 'digits' is a classification task, but "):
        data.load("digits", signature(lm_graph()))


runner = CliRunner()


def test_cli_refuses_a_mismatched_model_in_one_line_exit_2(tmp_path, monkeypatch):
    model = tmp_path / "lm.txt"
    model.write_text(CLASSIFIER)
    out = ["--out", str(tmp_path / "run")]
    result = runner.invoke(app, ["train", str(model), "--dataset", "pysource", *out])
    assert result.exit_code == 2, result.output
    assert result.output.strip().startswith("unroll: error: dataset 'pysource' is a ")
    assert len(result.output.strip().splitlines()) == 1
    # a language model with another vocabulary (its graph stands in for the file's)
    monkeypatch.setattr(data, "signature", lambda graph: lm_signature(vocab=64))
    result = runner.invoke(app, ["train", str(model), "--dataset", "pysource", *out])
    assert result.exit_code == 2, result.output
    assert "scores 64 classes per token" in result.output and "Traceback" not in result.output
    result = runner.invoke(app, ["accuracy", str(model), "--dataset", "pysource", *out])
    assert result.exit_code == 2, result.output
    assert "scores 64 classes per token" in result.output


# -- digits at the native 8x8 size (a ViT on patches of the real images) ------------------


@pytest.mark.parametrize("channels", [1, 3])
def test_digits_at_8x8_are_the_original_images_standardised(channels):
    pytest.importorskip("sklearn")
    from sklearn.datasets import load_digits

    sig = Signature(
        model="vit",
        input_name="x",
        input_shape=(channels, 8, 8),
        target_name="y",
        target_shape=(),
        target_dtype="i64",
        pred_shape=(10,),
        loss_op="cross_entropy",
        task="classification",
    )
    d = data.load("digits", sig)
    raw = torch.tensor(load_digits().images, dtype=torch.float64) / 16.0
    train_idx, test_idx = data.digits.split_indices()
    mean, std = raw[train_idx].mean(), raw[train_idx].std()
    want = ((raw[test_idx] - mean) / std).float()
    assert d.test.inputs.shape == (360, channels, 8, 8)
    for c in range(channels):  # bilinear resizing to the same size is the identity
        assert torch.equal(d.test.inputs[:, c], want)


# -- end to end, once the operators exist ---------------------------------------------------

LM_OPS = {"embedding", "permute"}
LM_MODEL = """
model charlm {
    input ids: i64[N, 32]
    target y: i64[N, 32]
    tok = embedding(ids, num_embeddings=128, embedding_dim=16)
    h = linear(tok, out_features=32)
    a = relu(h)
    logits = linear(a, out_features=128)
    logits_t = permute(logits, dims=(0, 2, 1))
    loss = cross_entropy(logits_t, y)
    return loss, logits
}
"""


needs_lm_ops = pytest.mark.skipif(
    not LM_OPS <= set(load_registry()), reason="embedding / permute are not in the registry yet"
)


@needs_lm_ops
@pytest.mark.parametrize(("pred", "dim"), [("logits", 2), ("logits_t", 1)])
def test_a_real_language_model_graph_is_recognised(pred, dim):
    sig = signature(
        graph_from_text(LM_MODEL.replace("return loss, logits", f"return loss, {pred}"))
    )
    assert (sig.task, sig.vocab, sig.pred_class_dim) == ("language_modelling", 128, dim)
    assert pysource.check(sig) == 32


@needs_lm_ops
@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            ("num_embeddings=128", "num_embeddings=96", "out_features=128", "out_features=96"),
            "unroll: error: dataset 'pysource' has a vocabulary of 128 characters (ASCII, id 127 "
            "for any other), but model 'charlm' (input ids: [32], target y: [32]) scores 96 "
            "classes per token",
        ),
        (
            ("target y: i64[N, 32]", "target y: i64[N, 32]"),  # unchanged: fits
            None,
        ),
    ],
)
def test_cli_refuses_a_real_language_model_that_does_not_fit(tmp_path, edit, message):
    text = LM_MODEL
    for old, new in zip(edit[::2], edit[1::2], strict=True):
        text = text.replace(old, new)
    model = tmp_path / "charlm.txt"
    model.write_text(text)
    args = ["train", str(model), "--dataset", "pysource", "--out", str(tmp_path / "run")]
    if message is None:  # the unchanged model trains (one tiny epoch)
        args += ["--epochs", "1", "--train-size", "64", "--test-size", "8", "-q"]
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
        return
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert result.output.strip() == message


@needs_lm_ops
def test_a_character_model_trains_on_pysource_deterministically(tmp_path):
    from unroller.training.loop import TrainConfig, train

    model = tmp_path / "charlm.txt"
    model.write_text(LM_MODEL)
    sig = signature(graph_from_text(LM_MODEL))
    assert (sig.task, sig.vocab, sig.pred_class_dim) == ("language_modelling", 128, 2)
    config = TrainConfig(
        model=str(model),
        dataset="pysource",
        epochs=2,
        batch_size=32,
        lr=3e-3,
        optimizer="adam",
        train_size=256,
        test_size=64,
    )
    runs = [train(config, tmp_path / f"run{i}", progress=False, log=lambda _: None) for i in (0, 1)]
    first, second = (r.history for r in runs)
    assert first == [
        {**r, "train_time_s": a["train_time_s"], "eval_time_s": a["eval_time_s"]}
        for r, a in zip(second, first, strict=True)
    ]
    bpc = [r["test"]["bpc"] for r in first]
    assert bpc[-1] < bpc[0] < 7.0  # learns something: uniform over 128 ids is 7 bits
