"""Seeded fuzz of model texts: every mutant is a clean error or a module that runs.

Mutants of the model files in tests/models/ and benchmarks/models/ (tokens deleted,
duplicated, swapped or renamed; numbers replaced by 0, -1, huge values, floats, 1e308,
nan; odd characters, quotes, backslashes and unicode inserted; random byte flips;
truncation; deep nesting; dtypes and dims changed; lines moved) must each either

* raise a ``ModelError`` whose formatted text starts ``bad.txt:LINE:COL: error: `` (the
  front end found the mistake and says where), or
* generate a gpu module that compiles and imports; for a random subset of the small ones,
  ``Model()`` runs one training step (batch 2, random inputs in the declared dtypes,
  class indices for cross_entropy targets) and ``predict()``, raising nothing.

200 mutants by default, 3000 with ``SLOW=1``; ``FUZZ_SEED`` picks another seeded run.
Every failure is collected (not just the first) and reported with the mutant's text, so
a run shows all the bugs it found. Generation is the slow part (black formats the
module); most mutants are formatted by a stand-in that only compiles the text (what the
fuzz needs to know: is it valid Python), and a few per seed file by black itself.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import re
import signal
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import black
import pytest
import torch
from conftest import fast_format, time_limit

from unroller.api import at_resolution, import_generated, render_graph, write_atomic
from unroller.compiler import codegen
from unroller.compiler.graph import build_graph
from unroller.compiler.options import Options
from unroller.compiler.parser import parse, read_source
from unroller.compiler.registry import load_registry
from unroller.errors import ModelError

ROOT = Path(__file__).resolve().parents[2]
SEEDS = sorted((ROOT / "tests" / "models").glob("*.txt")) + sorted(
    (ROOT / "benchmarks" / "models").glob("*.txt")
)
SLOW = os.environ.get("SLOW") == "1"
TOTAL = 3000 if SLOW else 200
FUZZ_SEED = int(os.environ.get("FUZZ_SEED", "1234"))
FILE = "bad.txt"
ERROR_LINE = re.compile(rf"^{re.escape(FILE)}:\d+:\d+: error: \S")
#: A generated module is run only if one step at batch 2 touches at most this many
#: activation and parameter elements (keeps a step to milliseconds on a CPU).
RUN_ELEMENTS = 3_000_000
#: The share of small generated mutants that are run, and how many are formatted by black.
RUN_SHARE = 0.6
BLACK_PER_SEED = 1
#: A mutant that takes longer than this (to refuse, generate or run) is a failure: the
#: front end must refuse exponential or huge work quickly.
MUTANT_SECONDS = 60

TORCH_DTYPES = {
    "f32": torch.float32,
    "f64": torch.float64,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "i64": torch.int64,
    "i32": torch.int32,
}

# ---- the mutator ---------------------------------------------------------------------

TOKEN = re.compile(
    r'"(?:[^"\\\n]|\\.)*"?'  # a string (perhaps unterminated)
    r"|#[^\n]*"  # a comment
    r"|[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)*"  # a name or dotted path
    r"|[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"  # a number
    r"|\s+"
    r"|.",
    re.S,
)
NUMBER = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?\Z")
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*\Z")

ODD_NUMBERS = [
    "0",
    "-1",
    "1",
    "2",
    "3",
    "-3",
    "7",
    "65",
    "0.5",
    "-0.5",
    "1.5",
    "1e308",
    "-1e308",
    "1e-320",
    "1e-400",
    "1e400",
    "3.5e38",
    "1e30",
    "nan",
    "inf",
    "-inf",
    "NaN",
    "2147483647",
    "2147483648",
    "4294967296",
    "65536",
    "9223372036854775807",
    "9223372036854775808",
    "-9223372036854775809",
    "9" * 30,
    "9" * 5000,
    "0" * 400 + "1",
    "+0",
    "-0",
    "00",
    "1.",
    ".5",
    "1e5",
]
ODD_TEXT = [
    '"',
    "\\",
    "(",
    ")",
    ",",
    "=",
    ":",
    "[",
    "]",
    "{",
    "}",
    "#",
    ".",
    "..",
    "-",
    "+",
    "*",
    "@",
    "$",
    "'",
    "`",
    "\x00",
    "\x1b[2J",
    "\x7f",
    "\x85",
    "\u202e",
    "\u2066",
    "\u2028",
    "\ufeff",
    "\ud800",
    "\t",
    "\r",
    "\n",
    "\f",
    "\v",
    " ",
    "é",
    "∞",
    "ß",
    "😀",
    "\u0301",
    '"\\x00"',
    '"\\q"',
    '"\\N{BOGUS}"',
    '"\\ud800"',
    '"' + "a" * 300 + '"',
    "(" * 50,
    ")" * 50,
    "(((1,),),)",
    "()",
    "(,)",
    "true",
    "false",
    "N",
    "-> ",
    "/* */",
    "\\n",
]
STRINGS = ['"nearest"', '"bilinear"', '"tanh"', '"none"', '""', '"\\x00"', '"\\u202e"', '"é"']
DTYPES = ["f32", "f16", "bf16", "f64", "i64", "i32", "f8", "bool", "float"]
KEYWORDS = ["model", "input", "target", "block", "return", "true", "false", "N", "_"]


@dataclass
class Mutant:
    text: str | None  # None when the mutant is bytes that are not UTF-8 text
    data: bytes
    how: list[str] = field(default_factory=list)


def tokens(text: str) -> list[str]:
    return TOKEN.findall(text)


def mutate(text: str, rng: random.Random, ops_and_names: list[str]) -> Mutant:
    how: list[str] = []
    gentle = rng.random() < GENTLE_SHARE
    for _ in range(1 if gentle else rng.choice((1, 1, 1, 2, 2, 3))):
        kind = rng.choice(GENTLE if gentle else MUTATIONS)
        if kind == "bytes":
            data = bytearray(text.encode("utf-8"))
            for _ in range(rng.randint(1, 3)):
                if data:
                    data[rng.randrange(len(data))] = rng.randrange(256)
            how.append("bytes")
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                return Mutant(None, bytes(data), how)
            continue
        text = TRANSFORMS[kind](text, rng, ops_and_names)
        how.append(kind)
    return Mutant(text, text.encode("utf-8", "surrogatepass"), how)


def _pick(toks: list[str], rng: random.Random, pattern: re.Pattern | None = None) -> int | None:
    places = [
        i for i, t in enumerate(toks) if not t.isspace() and (pattern is None or pattern.match(t))
    ]
    return rng.choice(places) if places else None


def _on_token(fn):
    def transform(text: str, rng: random.Random, names: list[str]) -> str:
        toks = tokens(text)
        fn(toks, rng, names)
        return "".join(toks)

    return transform


@_on_token
def _delete(toks, rng, names):
    i = _pick(toks, rng)
    if i is not None:
        del toks[i]


@_on_token
def _duplicate(toks, rng, names):
    i = _pick(toks, rng)
    if i is not None:
        toks.insert(i, toks[i])


@_on_token
def _swap(toks, rng, names):
    i, j = _pick(toks, rng), _pick(toks, rng)
    if i is not None and j is not None:
        toks[i], toks[j] = toks[j], toks[i]


@_on_token
def _number(toks, rng, names):
    i = _pick(toks, rng, NUMBER)
    if i is not None:
        toks[i] = rng.choice(ODD_NUMBERS)


@_on_token
def _small_number(toks, rng, names):
    """A plausible change (a size, a stride, a probability): mutants that may still run."""
    i = _pick(toks, rng, NUMBER)
    if i is not None:
        toks[i] = rng.choice(["0", "1", "2", "3", "4", "5", "0.0", "0.3", "1.0", "2.0", "-1"])


@_on_token
def _flip_bool(toks, rng, names):
    i = _pick(toks, rng, re.compile(r"(true|false)\Z"))
    if i is not None:
        toks[i] = "false" if toks[i] == "true" else "true"


@_on_token
def _float_dtype(toks, rng, names):
    """Every float dtype of the file changed to another one (the model stays consistent)."""
    new = rng.choice(["f64", "f16", "bf16"])
    for i, tok in enumerate(toks):
        if tok in ("f32", "f64", "f16", "bf16"):
            toks[i] = new


@_on_token
def _name(toks, rng, names):
    i = _pick(toks, rng, NAME)
    if i is not None:
        toks[i] = rng.choice(names + KEYWORDS + ["nan", "inf", "a.01", "x.y", "a" * 300])


@_on_token
def _dtype(toks, rng, names):
    i = _pick(toks, rng, re.compile(r"(f32|i64|f16|bf16|f64|i32)\Z"))
    if i is not None:
        toks[i] = rng.choice(DTYPES)


@_on_token
def _string(toks, rng, names):
    i = _pick(toks, rng, re.compile('"'))
    if i is not None:
        toks[i] = rng.choice(STRINGS)


@_on_token
def _insert(toks, rng, names):
    toks.insert(rng.randrange(len(toks) + 1), rng.choice(ODD_TEXT))


@_on_token
def _nest(toks, rng, names):
    """A keyword value wrapped in many 1-tuples or parentheses."""
    i = _pick(toks, rng, NUMBER)
    if i is not None:
        depth = rng.choice((2, 17, 40, 400, 3000))
        if rng.random() < 0.5:
            toks[i] = "(" * depth + toks[i] + ",)" * depth
        else:
            toks[i] = "(" * depth + toks[i] + ")" * depth


def _truncate(text, rng, names):
    return text[: rng.randrange(len(text) + 1)]


def _lines(text, rng, names):
    lines = text.split("\n")
    i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
    choice = rng.randrange(3)
    if choice == 0:
        del lines[i]
    elif choice == 1:
        lines.insert(j, lines[i])
    else:
        lines[i], lines[j] = lines[j], lines[i]
    return "\n".join(lines)


def _deep_blocks(text, rng, names):
    """Blocks that call each other deeper than any limit, called from the model."""
    depth = rng.choice((3, 31, 33, 200, 1200))
    blocks = ["    block fz0(v) {\n        o = relu(v)\n        return o\n    }\n"]
    blocks += [
        f"    block fz{i}(v) {{\n        o = fz{i - 1}(v)\n        return o\n    }}\n"
        for i in range(1, depth)
    ]
    at = text.find("{") + 1
    if at <= 0:
        return text
    first_float = re.search(r"input (\w+): f", text)
    call = f"    fzout = fz{depth - 1}({first_float.group(1) if first_float else 'x'})\n"
    end = text.rfind("return")
    end = text.rfind("\n", 0, end) + 1 if end >= 0 else len(text)
    return text[:at] + "\n" + "".join(blocks) + text[at:end] + call + text[end:]


def _wide_blocks(text, rng, names):
    """Each block calls the one before twice: 2**depth operator calls once inlined."""
    depth = rng.choice((3, 6, 30))
    blocks = ["    block fw0(v) {\n        o = relu(v)\n        return o\n    }\n"]
    blocks += [
        f"    block fw{i}(v) {{\n        a = fw{i - 1}(v)\n        b = fw{i - 1}(a)\n"
        f"        return b\n    }}\n"
        for i in range(1, depth)
    ]
    at = text.find("{") + 1
    first_float = re.search(r"input (\w+): f", text)
    if at <= 0 or not first_float:
        return text
    end = text.rfind("return")
    end = text.rfind("\n", 0, end) + 1 if end >= 0 else len(text)
    call = f"    fwout = fw{depth - 1}({first_float.group(1)})\n"
    return text[:at] + "\n" + "".join(blocks) + text[at:end] + call + text[end:]


TRANSFORMS = {
    "delete": _delete,
    "duplicate": _duplicate,
    "swap": _swap,
    "number": _number,
    "small_number": _small_number,
    "name": _name,
    "dtype": _dtype,
    "string": _string,
    "insert": _insert,
    "nest": _nest,
    "truncate": _truncate,
    "lines": _lines,
    "deep_blocks": _deep_blocks,
    "wide_blocks": _wide_blocks,
    "flip_bool": _flip_bool,
    "float_dtype": _float_dtype,
}
# Weighted: the plausible changes (that keep a model valid more often) come up more.
MUTATIONS = (
    ["delete", "duplicate", "swap", "name", "insert", "lines"] * 3
    + ["number"] * 3
    + ["dtype", "string", "truncate", "nest", "bytes", "small_number", "deep_blocks"] * 2
    + ["wide_blocks"]
)
# A share of the mutants get one plausible change only, so that more of them still build
# and the generated modules run with edge-case values.
GENTLE = ["small_number"] * 4 + ["flip_bool", "float_dtype", "string"]
GENTLE_SHARE = 0.35


# ---- running one mutant ----------------------------------------------------------------


@dataclass
class Outcome:
    kind: str  # "error", "generated", "ran" or "crash"
    detail: str = ""


class MutantTimeout(Exception):
    pass


@contextlib.contextmanager
def deadline(seconds: int):
    """Raise MutantTimeout in the block after ``seconds`` (where SIGALRM exists)."""
    if not hasattr(signal, "SIGALRM"):
        yield
        return

    with time_limit(seconds, MutantTimeout(f"took more than {seconds} s")):
        yield


def step_cost(graph) -> int:
    """Elements a training step touches at batch 2: activations and parameters."""
    total = sum(v.type.numel(2) for v in graph.inputs)
    for node in graph.nodes:
        total += node.output.type.numel(2)
        total += sum(math.prod(p.shape) for p in node.params + node.buffers)
        total += sum(e.type.numel(2) for e in node.extras if "N" in e.type.shape)
    return total


def make_inputs(graph, gen: torch.Generator) -> list[torch.Tensor]:
    tensors = []
    for value in graph.inputs:
        shape = (2, *value.type.shape[1:])
        dtype = TORCH_DTYPES[value.type.dtype]
        # integer values index something: classes of a loss, rows of an embedding table
        classes = [
            node.inputs[0].type.shape[1]
            for node, position in value.consumers
            if node.op.name in ("cross_entropy", "nll_loss") and position == 1
        ] + [
            node.args["num_embeddings"]
            for node, _ in value.consumers
            if node.op.name == "embedding"
        ]
        if dtype.is_floating_point:
            tensors.append(torch.rand(shape, generator=gen).to(dtype))
        else:
            high = int(min(classes)) if classes else 2
            tensors.append(torch.randint(0, high, shape, generator=gen).to(dtype))
    return tensors


def run_step(module, graph) -> None:
    """Model(), in the model's float dtype; one training step and predict() at batch 2."""
    torch.manual_seed(0)
    model = module.Model()
    dtype = TORCH_DTYPES[graph.float_dtype]
    model.to(dtype)
    inputs = make_inputs(graph, torch.Generator().manual_seed(0))
    loss = model(*inputs)
    assert isinstance(loss, torch.Tensor) and loss.dim() == 0, loss
    model.predict(*[t for t, v in zip(inputs, graph.inputs) if v.kind == "input"])


def check_mutant(
    mutant: Mutant, resolution: int | None, directory: Path, name: str, run: bool
) -> Outcome:
    """Build and generate the mutant; run one step if ``run`` and the model is small."""
    try:
        if mutant.text is None:
            path = directory / f"{name}.txt"
            path.write_bytes(mutant.data)
            text = read_source(path)  # must raise: the bytes are not UTF-8
            return Outcome("crash", f"read_source accepted bytes that are not UTF-8: {text!r}")
        text = mutant.text
        model = parse(text, FILE)
        graph = build_graph(model)
        if resolution is not None:
            try:
                graph = build_graph(at_resolution(model, resolution))
            except ModelError:
                resolution = None
        options = Options(resolution=resolution)
        source = render_graph(graph, FILE, options)
    except ModelError as exc:
        formatted = exc.format(FILE, mutant.text or "")
        if exc.loc is None or not ERROR_LINE.match(formatted):
            return Outcome("crash", f"ModelError without a location: {formatted}")
        return Outcome("error", formatted.splitlines()[0])
    except Exception:
        return Outcome("crash", traceback.format_exc(limit=-6))
    try:
        path = directory / f"{name}.py"
        write_atomic(path, source)
        module = import_generated(path, name)
        if not run or step_cost(graph) > RUN_ELEMENTS:
            return Outcome("generated")
        run_step(module, graph)
    except Exception:
        return Outcome("crash", traceback.format_exc(limit=-6))
    return Outcome("ran")


def seed_resolution(text: str) -> int | None:
    """A smaller image size at which a big seed model still builds, for the runs."""
    model = parse(text, FILE)
    if step_cost(build_graph(model)) <= RUN_ELEMENTS:
        return None
    for resolution in (8, 16, 32, 64):
        try:
            if step_cost(build_graph(at_resolution(model, resolution))) <= RUN_ELEMENTS:
                return resolution
        except ModelError:
            continue
    return None


# ---- edge-case models that are valid and must run ---------------------------------------

_HEAD = "model m {\n    input x: f32[N, 3, 8, 8]\n    target y: i64[N]\n"
_VEC = "model m {\n    input x: f32[N, 4]\n    target y: f32[N, 4]\n"


def _classify(*lines: str) -> str:
    """x -> lines (the last makes t) -> flatten -> linear -> cross_entropy."""
    body = "".join(f"    {line}\n" for line in lines)
    return (
        _HEAD + body + "    fl = flatten(t)\n    fc = linear(fl, out_features=3)\n"
        "    loss = cross_entropy(fc, y)\n    return loss, fc\n}\n"
    )


def _vector(*lines: str) -> str:
    return _VEC + "".join(f"    {line}\n" for line in lines) + "}\n"


EDGE = {
    "no-parameters": _vector("loss = mse_loss(x, y)", "return loss"),
    "target-first": _vector("loss = mse_loss(y, x)", "return loss"),
    "prediction-is-input": _vector(
        "a = linear(x, out_features=4)", "loss = mse_loss(a, y)", "return loss, x, a, a"
    ),
    "loss-of-losses": _vector(
        "a = linear(x, out_features=4)",
        "l1 = mse_loss(a, y)",
        "l2 = l1_loss(a, y)",
        "s = add(l1, l2)",
        "m2 = mul(s, l1)",
        "return m2, a",
    ),
    "same-value-twice": _vector(
        "a = linear(x, out_features=4)", "loss = mse_loss(a, a)", "return loss"
    ),
    "bce-on-input": _vector("loss = bce_loss(x, y)", "return loss"),
    "one-class": "model m {\n    input x: f32[N, 4]\n    target y: i64[N]\n"
    "    a = linear(x, out_features=1)\n    loss = cross_entropy(a, y)\n    return loss, a\n}\n",
    "int-input-concat": "model m {\n    input x: f32[N, 4]\n    input z: i32[N, 2]\n"
    "    target y: f32[N, 4]\n    a = linear(x, out_features=4)\n    c = concat(z, z)\n"
    "    loss = mse_loss(a, y)\n    return loss, a, c\n}\n",
    "python-names": _vector(
        "torch = linear(x, out_features=4)",
        "K = relu(torch)",
        "P = tanh(K)",
        "self = linear(P, out_features=4)",
        "None = sigmoid(self)",
        "input = relu(None)",
        "return.0 = tanh(input)",
        "weight = linear(return.0, out_features=4)",
        "bias.weight = linear(weight, out_features=4)",
        "loss = mse_loss(bias.weight, y)",
        "return loss, None",
    ),
    "adaptive-pool-up": _classify("t = adaptive_avgpool2d(x, output_size=(1, 13))"),
    "maxpool-pad-half": _classify("t = maxpool2d(x, kernel_size=3, stride=1, padding=1)"),
    "maxpool-huge-stride": _classify("t = maxpool2d(x, kernel_size=2, stride=100)"),
    "avgpool-pad": _classify("t = avgpool2d(x, kernel_size=(3, 1), stride=(5, 1), padding=(1, 0))"),
    "conv-dilation": _classify("t = conv2d(x, out_channels=3, kernel_size=2, dilation=7)"),
    "conv-depthwise": _classify("t = conv2d(x, out_channels=3, kernel_size=1, groups=3)"),
    "conv-wide-padding": _classify("t = conv2d(x, out_channels=2, kernel_size=1, padding=20)"),
    "conv-transpose-edge": _classify(
        "t = conv_transpose2d(x, out_channels=3, kernel_size=2, dilation=3, output_padding=2, "
        "groups=3)"
    ),
    "upsample-down": _classify('t = upsample(x, scale_factor=(0.5, 3), mode="bilinear")'),
    "upsample-odd": _classify(
        't = upsample(x, scale_factor=1.0001, mode="bilinear", align_corners=true)'
    ),
    "reshape-flat": _classify("t = reshape(x, shape=(-1,))"),
    "flatten-last": _classify("t = flatten(x, start_dim=-1)"),
    "concat-one-and-last": _classify("c = concat(x)", "t = concat(c, x, x, dim=-1)"),
    "dropout-all": _classify(
        "c = conv2d(x, out_channels=2, kernel_size=1)", "t = dropout(c, p=1.0)"
    ),
    "dropout-most": _classify(
        "c = conv2d(x, out_channels=2, kernel_size=1)", "t = dropout(c, p=0.999)"
    ),
    "batchnorm-extremes": _classify(
        "c = conv2d(x, out_channels=2, kernel_size=1)",
        "b = batchnorm2d(c, eps=0, momentum=1)",
        "t = batchnorm2d(b, eps=1, momentum=0)",
    ),
    "batchnorm-1x1": _classify("p = adaptive_avgpool2d(x, output_size=1)", "t = batchnorm2d(p)"),
    "leaky-extremes": _classify(
        "c = conv2d(x, out_channels=2, kernel_size=1)",
        "a = leaky_relu(c, negative_slope=-1000)",
        "t = leaky_relu(a, negative_slope=1000)",
    ),
    "linear-on-image": _classify("t = linear(x, out_features=2)"),
    "mul-self": _classify("c = conv2d(x, out_channels=2, kernel_size=1)", "t = mul(c, c)"),
    "long-thin": "model m {\n    input x: f32[N, 1, 1, 3000]\n    target y: f32[N, 1, 1, 3000]\n"
    "    a = conv2d(x, out_channels=1, kernel_size=(1, 2999))\n"
    "    u = upsample(a, scale_factor=(1, 1500))\n    loss = mse_loss(u, y)\n    return loss\n}\n",
}

_FILE_SEEDS = {f"{p.parent.parent.name}/{p.stem}": [p.read_text(encoding="utf-8")] for p in SEEDS}
#: Per parametrised case, the texts its mutants start from ("edge": any edge-case model).
BASES = {**_FILE_SEEDS, "edge": list(EDGE.values())}
PER_SEED = math.ceil(TOTAL / len(BASES))
STATS: dict[str, dict[str, int]] = {}


@pytest.mark.parametrize("name", list(EDGE))
def test_edge_case_model_runs(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Valid models with edge-case values: they generate, and one step runs."""
    monkeypatch.setattr(codegen.black, "format_str", fast_format)
    text = EDGE[name]
    outcome = check_mutant(Mutant(text, text.encode()), None, tmp_path, f"edge_{name}", True)
    assert outcome.kind == "ran", outcome.detail


@pytest.mark.parametrize("base", list(BASES))
def test_mutants_error_cleanly_or_run(base: str, monkeypatch: pytest.MonkeyPatch):
    texts = BASES[base]
    rng = random.Random(f"{FUZZ_SEED}:{base}")
    resolutions = [seed_resolution(text) for text in texts]
    names = sorted(
        {t for text in texts for t in tokens(text) if NAME.match(t)} | set(load_registry())
    )
    real_format = black.format_str
    counts = {"error": 0, "generated": 0, "ran": 0, "crash": 0}
    failures: list[str] = []
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="fuzz-") as tmp:
        directory = Path(tmp)
        for index in range(PER_SEED):
            which = rng.randrange(len(texts))
            mutant = mutate(texts[which], rng, names)
            real_black = index < BLACK_PER_SEED
            monkeypatch.setattr(
                codegen.black, "format_str", real_format if real_black else fast_format
            )
            module = f"fuzz_{re.sub(r'[^A-Za-z0-9]', '_', base)}_{FUZZ_SEED}_{index}"
            run = rng.random() < RUN_SHARE
            try:
                with deadline(MUTANT_SECONDS):
                    outcome = check_mutant(mutant, resolutions[which], directory, module, run)
            except MutantTimeout as exc:
                outcome = Outcome("crash", str(exc))
            counts[outcome.kind] += 1
            if outcome.kind == "crash":
                shown = mutant.text if mutant.text is not None else repr(mutant.data)
                failures.append(
                    f"--- mutant {index} ({', '.join(mutant.how)}) of {base}:\n"
                    f"{outcome.detail}\n--- text:\n{shown[:3000]}"
                )
    STATS[base] = counts
    print(f"\n{base}: {counts}")
    assert not failures, f"{len(failures)} of {PER_SEED} mutants crashed:\n" + "\n".join(
        failures[:5]
    )
    assert counts["error"] > 0  # the mutator does break models


def test_fuzz_summary():
    """Runs last: the totals over all seed files (printed with -s)."""
    if not STATS:
        pytest.skip("no fuzz results in this run")
    total = {k: sum(c[k] for c in STATS.values()) for k in ("error", "generated", "ran", "crash")}
    print(f"\nfuzz totals over {len(STATS)} seeds ({sum(total.values())} mutants): {total}")
    assert total["ran"] > 0 and total["error"] > 0
