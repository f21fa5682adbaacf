"""Hostile SPECs, options and networks for ``unroll import`` and ``unroll verify`` (torch).

Each case ends in one ``unroll: error: ...`` line (``FILE:LINE:COL: error:`` for model
text), exit status 2, no traceback, nothing written, in bounded time:

1. a dotted SPEC (``pkg.module:F``) resolves from the installed environment only: a
   ``./pkg/`` planted in the working folder, shadowing an installed module, never runs;
2. ``sys.exit(0)`` in the original's ``forward`` is an error, not a silent exit 0 (a CI
   gate running ``unroll verify`` once passed);
3. a free parameter named after a Python keyword (``class``, ``None``, ``lambda``) is
   refused in one line by the importer, and at its line and column in model text;
4. ``--kwargs`` is a JSON object of bounded depth and size, keys that are names and
   finite numbers: nested thousands deep it was a RecursionError traceback;
5. ``--input`` has at most 8 dims after N and a bounded element count (2,000 dims kept
   torch.export busy for minutes);
6. the user's network at fault (an ``i64`` input into a Linear, a constant of 1e300, a
   loss of inf) is said to be the network's fault, never "internal error";
7. torch's logs, warnings and prints while a capture fails never reach the terminal.

Most cases run the Typer app in process under an alarm; those where the real process
matters (sys.path, the exit status, what torch's log handlers write) run ``unroll``.
"""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import time_limit

from tests.adversarial.cli_cases import invoke, refused

UNROLL = Path(sys.executable).with_name("unroll")

NETS = """\
import sys
import torch
from torch import nn


class Lin(nn.Module):
    def __init__(self, n=4):
        super().__init__()
        self.fc = nn.Linear(n, 2)

    def forward(self, x):
        return self.fc(x)


def any_kwargs(**kwargs):
    return Lin()


class Exits(Lin):
    def forward(self, x):
        sys.exit(0)


class Raises(Lin):
    def forward(self, x):
        raise GeneratorExit


class Scaled(Lin):
    def forward(self, x):
        return self.fc(x) * 1e300


class Infinite(Lin):
    def forward(self, x):
        return self.fc(x) * float("inf")


class Keywords(Lin):
    def __init__(self, name):
        super().__init__()
        self.register_parameter(name, nn.Parameter(torch.ones(4)))
        self.name = name

    def forward(self, x):
        return self.fc(x * getattr(self, self.name))


class Noisy(Lin):
    def forward(self, x):
        import warnings
        print("printed by forward")
        warnings.warn("warned by forward")
        return self.fc(x)
"""

MODEL = """\
model lin {
    input x: f32[N, 4]
    target y: i64[N]
    fc = linear(x, out_features=2)
    loss = cross_entropy(fc, y)
    return loss, fc
}
"""


@pytest.fixture(autouse=True)
def alarm():
    """No case may run away: a regression fails in seconds instead of tracing for minutes."""
    with time_limit(40, TimeoutError("ran for 40 s")):
        yield


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "nets.py").write_text(NETS, encoding="utf-8")
    (tmp_path / "lin.txt").write_text(MODEL, encoding="utf-8")
    return tmp_path


def one_line(stderr: str, *phrases: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("unroll: error: "), stderr
    assert "internal error" not in lines[0] and "Traceback" not in stderr, lines[0]
    for phrase in phrases:
        assert phrase in lines[0], (phrase, lines[0])
    return lines[0]


def run_unroll(cwd: Path, *args: str, python_m: bool = False) -> subprocess.CompletedProcess:
    """The real command, its address space capped (nothing here may allocate gigabytes)."""
    command = [sys.executable, "-m", "unroller.cli"] if python_m else [str(UNROLL)]

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (16 * 2**30, 16 * 2**30))

    return subprocess.run(
        [*command, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=cap,
        check=False,
    )


# ------------------------------------------------------------ 1. dotted SPEC resolution


# make test runs `python -m unroller.cli` (the entry that puts the working folder first on
# sys.path); the installed script too under SLOW=1
@pytest.mark.parametrize(
    "python_m", [pytest.param(False, marks=pytest.mark.slow), True], ids=["unroll", "python -m"]
)
def test_planted_package_in_the_working_folder_never_runs(tmp_path: Path, python_m: bool):
    """``colorsys`` is installed (the standard library's); ``./colorsys/`` in the working
    folder would shadow it with the working folder first on sys.path (``python -m`` puts
    it there; the importer used to add it itself)."""
    planted = tmp_path / "colorsys"
    planted.mkdir()
    (planted / "__init__.py").write_text(
        "from pathlib import Path\nPath('RAN').write_text('planted code ran')\n"
        "from torch import nn\nNet = nn.Linear\n"
    )
    done = run_unroll(
        tmp_path, "import", "colorsys:Net", "--input", "x: f32[N, 4]", python_m=python_m
    )
    assert not (tmp_path / "RAN").exists(), "the planted package ran"
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    one_line(done.stderr, "colorsys has no attribute 'Net'")


def test_local_module_spec_points_to_the_file_form(work: Path):
    refused(
        invoke("import", "nets:Lin", "--input", "x: f32[N, 4]"),
        "the working folder is not searched",
        "nets.py:NAME",
    )
    assert invoke("import", "nets.py:Lin", "--input", "x: f32[N, 4]").exit_code == 0


def test_an_installed_entry_naming_the_working_folder_stays(work: Path, monkeypatch):
    """An editable install of the project the command runs in adds its folder to sys.path
    from a site file: that is the installed environment, so it resolves (only relative
    entries and a first entry naming the working folder are the working folder's)."""
    (work / "review_installed_net.py").write_text(NETS, encoding="utf-8")
    installed = list(sys.path)
    monkeypatch.setattr(sys, "path", [str(work), "", *installed])  # python -m, python -c
    refused(invoke("import", "review_installed_net:Lin", "--input", "x: f32[N, 4]"))
    monkeypatch.setattr(sys, "path", [installed[0], str(work), *installed])  # a site file
    result = invoke("import", "review_installed_net:Lin", "--input", "x: f32[N, 4]")
    assert result.exit_code == 0, (result.output, result.exception)
    sys.modules.pop("review_installed_net", None)


# ------------------------------------------------------------ 2. sys.exit in user code


def test_sys_exit_in_forward_fails_verify_in_the_real_process(work: Path):
    done = run_unroll(work, "verify", "lin.txt", "--against", "nets.py:Exits")
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    one_line(done.stderr, "sys.exit(0)", "nets.py:Exits")
    assert "ok:" not in done.stdout


@pytest.mark.parametrize("spec", ["nets.py:Exits", "nets.py:Raises"])
def test_sys_exit_or_base_exception_in_forward_fails_import(work: Path, spec: str):
    result = invoke("import", spec, "--input", "x: f32[N, 4]", "-o", "out.txt")
    refused(result, spec)
    assert not (work / "out.txt").exists()


def test_base_exception_in_forward_fails_verify(work: Path):
    refused(invoke("verify", "lin.txt", "--against", "nets.py:Raises"), "GeneratorExit")


# ------------------------------------------------------------ 3. keyword parameter names


@pytest.mark.parametrize("name", ["class", "None", "lambda"])
def test_keyword_parameter_name_is_refused_by_import(work: Path, name: str):
    kwargs = f'{{"name": "{name}"}}'
    result = invoke("import", "nets.py:Keywords", "--kwargs", kwargs, "--input", "x: f32[N, 4]")
    refused(result, f"'{name}'", "Python keyword")


@pytest.mark.parametrize("name", ["class", "None", "lambda", "blk.lambda"])
def test_keyword_parameter_name_in_model_text_is_located(work: Path, name: str):
    text = MODEL.replace(
        "    fc = linear(x, out_features=2)\n",
        f"    {name} = parameter(shape=(4,))\n    h = mul(x, {name})\n"
        "    fc = linear(h, out_features=2)\n",
    )
    (work / "kw.txt").write_text(text)
    for args in (
        ["generate", "kw.txt", "-o", "kw.py"],
        ["verify", "kw.txt", "--against", "nets.py:Lin"],
    ):
        result = invoke(*args)
        assert result.exit_code == 2, (args, result.output, result.exception)
        assert result.exception is None or isinstance(result.exception, SystemExit)
        first = result.stderr.splitlines()[0]
        assert first.startswith("kw.txt:4:5: error: ") and "Python keyword" in first, first
    assert not (work / "kw.py").exists()


# ------------------------------------------------------------ 4. --kwargs


def test_nested_kwargs_within_bounds_reach_the_factory(work: Path):
    result = invoke(
        "import", "nets.py:any_kwargs", "--input", "x: f32[N, 4]",
        "--kwargs", '{"a": {"b": [1, {"c": 2}]}, "d": [true, null, "s", 1.5]}',
    )  # fmt: skip
    assert result.exit_code == 0, (result.output, result.exception)


@pytest.mark.parametrize(
    ("kwargs", "phrase"),
    [
        ('{"a": ' + "[" * 30_000 + "]" * 30_000 + "}", "nest 30001 deep"),
        ('{"a": ' + "[" * 9 + "]" * 9 + "}", "nest 10 deep"),
        ('{"a": ' + "1" * 5000 + "}", "--kwargs"),
        ('{"a": 1' + "0" * 30 + "}", "outside int64"),
        ('{"a": 1e400}', "not a finite number"),
        ('{"a": [NaN]}', "NaN is not a finite number"),
        ('{"not a name": 1}', "not a keyword-argument name"),
        ('{"a": "' + "x" * 70_000 + '"}', "more than the limit"),
        ("[1, 2]", "expected a JSON object"),
    ],
    ids=["deep", "depth-9", "digits", "int64", "inf", "nan", "key", "long", "list"],
)
@pytest.mark.parametrize("command", ["import", "verify"])
def test_hostile_kwargs_are_one_line(work: Path, kwargs: str, phrase: str, command: str):
    if command == "import":
        args = ["import", "nets.py:any_kwargs", "--input", "x: f32[N, 4]"]
    else:
        args = ["verify", "lin.txt", "--against", "nets.py:any_kwargs"]
    refused(invoke(*args, "--kwargs", kwargs), phrase)


# ------------------------------------------------------------ 5. --input bounds


@pytest.mark.parametrize(
    ("spec", "phrase"),
    [
        ("x: f32[N" + ", 1" * 2000 + "]", "more than the limit of 1,000"),
        ("x: f32[N" + ", 1" * 9 + "]", "9 dims after N, more than the limit of 8"),
        ("x: f32[N, 100000, 100000]", "10,000,000,000 elements per sample"),
    ],
    ids=["2000-dims", "9-dims", "elements"],
)
def test_input_is_bounded_up_front(work: Path, spec: str, phrase: str):
    with time_limit(10, TimeoutError("--input not refused up front")):
        refused(invoke("import", "nets.py:Lin", "--input", spec), phrase)


def test_inputs_together_are_bounded(work: Path):
    specs = [arg for i in range(3) for arg in ("--input", f"x{i}: f32[N, 8192, 4096]")]
    refused(invoke("import", "nets.py:Lin", *specs), "elements per sample")


def test_verify_batch_is_bounded_up_front(work: Path):
    """--batch-size has no upper bound of its own: the step's inputs are bounded."""
    result = invoke("verify", "lin.txt", "--against", "nets.py:Lin", "--batch-size", "10**9")
    assert result.exit_code == 2  # not an integer: typer refuses it
    with time_limit(10, TimeoutError("--batch-size not refused up front")):
        result = invoke("verify", "lin.txt", "--against", "nets.py:Lin", "--batch-size", "10" * 5)
    assert result.exit_code == 2, (result.output, result.exception)
    first = result.stderr.splitlines()[0]
    assert first.startswith("lin.txt:2:11: error: ") and "more than the limit" in first, first


# ------------------------------------------------------------ 6. the network at fault


def test_integer_input_into_a_linear_is_the_inputs_fault(work: Path):
    refused(
        invoke("import", "nets.py:Lin", "--input", "x: i64[N, 4]"),
        "the network fails on inputs of the declared shapes and dtypes (x: i64[N, 4])",
        "dtype",
    )


@pytest.mark.parametrize("spec", ["nets.py:Scaled", "nets.py:Infinite"])
def test_overflowing_constant_is_the_networks_fault(work: Path, spec: str):
    refused(invoke("import", spec, "--input", "x: f32[N, 4]"), spec, "outside the float32 range")


def test_verify_against_a_network_that_gives_inf_is_a_user_error(work: Path):
    refused(
        invoke("verify", "lin.txt", "--against", "nets.py:Infinite"),
        "inf or nan",
        "(loss, grad fc.weight, grad fc.bias)",
    )


# ------------------------------------------------------------ 7. torch's logs


def test_wrong_input_shape_prints_one_line_in_the_real_process(work: Path):
    done = run_unroll(work, "import", "nets.py:Lin", "--input", "x: f32[N, 5]")
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    one_line(done.stderr, "declared shapes", "(Nx5 and 4x2)")
    assert done.stdout == ""


def test_prints_and_warnings_of_forward_stay_out_of_the_model_text(work: Path):
    result = invoke("import", "nets.py:Noisy", "--input", "x: f32[N, 4]")
    assert result.exit_code == 0, (result.output, result.exception)
    assert "printed by forward" not in result.stdout and "warned" not in result.stderr
    assert result.stdout.startswith("# imported from nets.py:Noisy")


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_import_never_replaces_the_network_it_reads(work: Path, force: list[str]):
    """``-o`` naming the SPEC's own file (or a link to it) is refused, --force or not."""
    (work / "alias.py").symlink_to("nets.py")
    for name in ("nets.py", "alias.py", str(work / "nets.py")):
        result = invoke("import", "nets.py:Lin", "--input", "x: f32[N, 4]", "-o", name, *force)
        refused(result, "is the input file")
    assert (work / "nets.py").read_text(encoding="utf-8") == NETS
