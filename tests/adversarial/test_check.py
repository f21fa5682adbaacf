"""``unroll check`` must account for every ``.py`` file under the folder it checks.

Each is up to date, stale (differs from what the generator emits now, edited after it was
generated) or damaged / not generated (no header, a damaged, moved or re-prefixed header,
header fields of the wrong kind, a missing source, not a regular file): one line per
problem file, a summary ``N up to date, M stale, K damaged/not generated``, exit status 1,
never a traceback. Damaged headers were once skipped silently: with ``import os``
appended and the header line re-prefixed, check still said "3 of 3 up to date".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import time_limit
from typer.testing import CliRunner

from unroller.cli import app

UNROLL = Path(sys.executable).with_name("unroll")
MODEL = """\
model lin {
    input x: f32[N, 6]
    target y: f32[N, 2]
    h = linear(x, out_features=5)
    a = tanh(h)
    o = linear(a, out_features=2)
    loss = mse_loss(o, y)
    return loss, o
}
"""
SCHEMES = {"a.py": "nocompress", "b.py": "quant", "c.py": "dct-dense"}

runner = CliRunner()


@pytest.fixture(autouse=True)
def alarm():
    """No case may block (a FIFO among the files, or recorded as the source)."""
    with time_limit(30, TimeoutError("blocked for 30 s")):
        yield


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """The three generated files, made once (their source is m.txt in the working dir)."""
    folder = tmp_path_factory.mktemp("pristine")
    (folder / "m.txt").write_text(MODEL, encoding="utf-8")
    here = os.getcwd()
    os.chdir(folder)
    try:
        for name, scheme in SCHEMES.items():
            result = runner.invoke(
                app, ["generate", "m.txt", "--scheme", scheme, "-o", f"gen/{name}", "--mkdir"]
            )
            assert result.exit_code == 0, result.output
    finally:
        os.chdir(here)
    return {name: (folder / "gen" / name).read_bytes() for name in SCHEMES}


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pristine) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.txt").write_text(MODEL, encoding="utf-8")
    (tmp_path / "gen").mkdir()
    for name, data in pristine.items():
        (tmp_path / "gen" / name).write_bytes(data)
    return tmp_path


def check(folder: str = "gen", *flags: str):
    result = runner.invoke(app, ["check", folder, *flags])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    return result


def summary(result) -> str:
    return result.stderr.strip().splitlines()[-1]


def test_pristine_folder_is_up_to_date(work: Path):
    result = check()
    assert result.exit_code == 0, result.output
    assert (
        summary(result) == "3 up to date, 0 stale, 0 damaged/not generated (3 .py files under gen)"
    )


# ---- damaged, moved or re-prefixed headers ----------------------------------------------


def lines_of(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines(keepends=True)


def edit(path: Path, change: Callable[[list[str]], list[str]]) -> None:
    path.write_text("".join(change(lines_of(path))), encoding="utf-8")


def header_json(path: Path) -> dict:
    return json.loads(lines_of(path)[0][len("# unroller: ") :])


def with_header(value: object | str) -> Callable[[list[str]], list[str]]:
    """Replace the header's JSON by ``value`` (a str is written as is)."""
    raw = value if isinstance(value, str) else json.dumps(value)
    return lambda lines: [f"# unroller: {raw}\n", *lines[1:]]


def with_fields(**fields: object) -> Callable[[Path], None]:
    def change(path: Path) -> None:
        header = {**header_json(path), **fields}
        header = {k: v for k, v in header.items() if v is not DELETE}
        edit(path, with_header(header))

    return change


DELETE = object()


def appended(lines: list[str]) -> list[str]:
    return [*lines, "import os\n"]


def moved_down(lines: list[str]) -> list[str]:
    return [*lines[1:12], lines[0], *lines[12:]]


CASES: dict[str, tuple[Callable[[Path], None], str, str]] = {
    # name: (what is done to gen/b.py, its verdict, a phrase of its line)
    "body-edited": (lambda p: edit(p, appended), "stale", "edited after it was generated"),
    "checksum-changed": (
        lambda p: edit(p, lambda ls: [ls[0], "# unroller-checksum: " + "0" * 64 + "\n", *ls[2:]]),
        "stale",
        "checksum no longer matches",
    ),
    "header-deleted+import": (
        lambda p: edit(p, lambda ls: appended(ls[1:])),
        "damaged",
        "a '# unroller-checksum:' line but no header line",
    ),
    "header-and-checksum-deleted": (
        lambda p: edit(p, lambda ls: appended(ls[2:])),
        "damaged",
        "not generated / header damaged: no header, yet it says 'Generated by unroller'",
    ),
    "header-re-prefixed+import": (
        lambda p: edit(
            p, lambda ls: appended(["#unroller:" + ls[0][len("# unroller:") :], *ls[1:]])
        ),
        "damaged",
        "line 1 looks like a re-prefixed header",
    ),
    "header-double-hash": (
        lambda p: edit(p, lambda ls: ["#" + ls[0], *ls[1:]]),
        "damaged",
        "re-prefixed header",
    ),
    "header-moved-down+import": (
        lambda p: edit(p, lambda ls: appended(moved_down(ls))),
        "damaged",
        "line 12 looks like a moved header",
    ),
    "header-moved-within-top": (
        lambda p: edit(p, lambda ls: [ls[1], ls[0], *ls[2:]]),
        "stale",
        "",
    ),
    "checksum-line-deleted": (
        lambda p: edit(p, lambda ls: [ls[0], *ls[2:]]),
        "damaged",
        "header damaged: no '# unroller-checksum:' line",
    ),
    "not-json": (lambda p: edit(p, with_header("{not json")), "damaged", "is not JSON"),
    "truncated-json": (
        lambda p: edit(p, lambda ls: [ls[0][:40] + "\n", *ls[1:]]),
        "damaged",
        "is not JSON",
    ),
    "deeply-nested-json": (
        lambda p: edit(p, with_header("[" * 100_000 + "]" * 100_000)),
        "damaged",
        "header damaged",
    ),
    "json-list": (lambda p: edit(p, with_header(["x"])), "damaged", "the header is a list"),
    "json-null": (lambda p: edit(p, with_header(None)), "damaged", "the header is null"),
    "json-string": (lambda p: edit(p, with_header('"x"')), "damaged", "the header is a string"),
    "json-number": (lambda p: edit(p, with_header(3)), "damaged", "the header is a number"),
    "no-source": (with_fields(source=DELETE), "damaged", "it records no 'source'"),
    "no-platform": (with_fields(platform=DELETE), "damaged", "it records no 'platform'"),
    "source-number": (with_fields(source=5), "damaged", "'source' is 5, not a string"),
    "source-dict": (with_fields(source={"a": 1}), "damaged", "not a string"),
    "source-empty": (with_fields(source=""), "damaged", "not a path"),
    "source-nul": (with_fields(source="m\u0000.txt"), "damaged", "not a path"),
    "source-missing": (with_fields(source="gone.txt"), "damaged", "'gone.txt' is missing"),
    "source-a-folder": (with_fields(source="gen"), "damaged", "'gen' is missing"),
    "source-too-long": (with_fields(source="x" * 5000), "damaged", "is missing"),
    "platform-unknown": (with_fields(platform="tpu"), "damaged", "unknown platform 'tpu'"),
    "platform-list": (with_fields(platform=["gpu"]), "damaged", "unknown platform ['gpu']"),
    "scheme-unknown": (with_fields(scheme="zip"), "damaged", "unknown scheme 'zip'"),
    "scheme-number": (with_fields(scheme=1), "damaged", "unknown scheme 1"),
    "opt-level-string": (with_fields(opt_level="1"), "damaged", "'opt_level' is '1'"),
    "num-ipus-bool": (with_fields(num_ipus=True), "damaged", "'num_ipus' is True"),
    "num-ipus-on-gpu": (with_fields(num_ipus=2), "stale", "edited after it was generated"),
    "stage-starts-string": (with_fields(stage_starts="h"), "damaged", "'stage_starts' is 'h'"),
    "resolution-negative": (with_fields(resolution=-1), "damaged", "'resolution' is -1"),
    "generator-number": (with_fields(generator=1), "damaged", "'generator' is 1"),
    "config-number": (with_fields(compress_config=7), "damaged", "'compress_config' is 7"),
    "config-missing": (with_fields(compress_config="gone.toml"), "stale", "edited after"),
    "not-utf8": (lambda p: p.write_bytes(p.read_bytes() + b"\xff\xfe\n"), "stale", "edited"),
}


def test_each_damage_is_reported(work: Path):
    """One copy of b.py per case, each damaged its own way, all in one check run (in this
    process: the worker processes a folder of 8 files or more gets by default are
    test_non_regular_files_are_reported_unread's)."""
    gen = work / "gen"
    for case, (damage, _, _) in CASES.items():
        (gen / f"{case}.py").write_bytes((gen / "b.py").read_bytes())
        damage(gen / f"{case}.py")
    result = check("gen", "--jobs", "1")
    assert result.exit_code == 1, result.output
    reported = {}
    for line in result.stderr.splitlines()[:-1]:
        name, _, why = line.partition(": ")
        reported[name] = why
    for case, (_, verdict, phrase) in CASES.items():
        why = reported.pop(f"gen/{case}.py")
        assert phrase in why, (case, phrase, why)
        assert ("damaged" in why or "not generated" in why) == (verdict == "damaged"), case
    assert reported == {}  # a.py, b.py, c.py: up to date
    stale = sum(verdict == "stale" for _, verdict, _ in CASES.values())
    damaged = len(CASES) - stale
    assert summary(result) == (
        f"3 up to date, {stale} stale, {damaged} damaged/not generated "
        f"({3 + len(CASES)} .py files under gen)"
    )


@pytest.mark.parametrize("case", ["body-edited", "header-re-prefixed+import", "json-list"])
def test_one_damaged_file_fails_the_check(work: Path, case: str):
    damage, verdict, phrase = CASES[case]
    damage(work / "gen" / "b.py")
    result = check()
    assert result.exit_code == 1, result.output
    assert result.stderr.splitlines()[0].startswith("gen/b.py: ")
    assert phrase in result.stderr.splitlines()[0]
    counts = {"stale": "2 up to date, 1 stale, 0 damaged", "damaged": "2 up to date, 0 stale, 1"}
    assert summary(result).startswith(counts[verdict]), summary(result)


# ---- files that are not generated -------------------------------------------------------


def test_every_py_file_is_accounted_for(work: Path):
    gen = work / "gen"
    (gen / "__init__.py").write_text("")  # empty: allowed, not counted
    (gen / "sub").mkdir()
    (gen / "sub" / "__init__.py").write_text("import os\n")  # not empty: reported
    (gen / "sub" / "helper.py").write_text("x = 1\n")
    (gen / "sub" / "README.md").write_text("not python\n")  # not .py: ignored
    (gen / ".hidden.py").write_text("x = 1\n")
    result = check()
    assert result.exit_code == 1
    for name in ("gen/sub/__init__.py", "gen/sub/helper.py", "gen/.hidden.py"):
        assert f"{name}: not generated by unroller (no header line)" in result.stderr
    assert "README" not in result.stderr and "gen/__init__.py" not in result.stderr
    assert summary(result) == (
        "3 up to date, 0 stale, 3 damaged/not generated "
        "(7 .py files under gen, 1 empty __init__.py)"
    )


def test_non_regular_files_are_reported_unread(work: Path):
    gen = work / "gen"
    os.mkfifo(gen / "pipe.py")
    os.symlink("/dev/zero", gen / "zero.py")
    os.symlink("nowhere.py", gen / "dangling.py")
    with open(gen / "huge.py", "wb") as handle:
        handle.truncate(64 * 1024 * 1024 + 1)
    os.symlink("a.py", gen / "alias.py")  # a link to a good generated file: checked through
    result = check()
    assert result.exit_code == 1
    assert "gen/pipe.py: not generated: a named pipe (FIFO), not a regular file" in result.stderr
    assert "gen/zero.py: not generated: a character device, not a regular file" in result.stderr
    assert "gen/dangling.py: a symbolic link to nowhere.py, which does not exist" in result.stderr
    assert "gen/huge.py: not generated: gen/huge.py is larger than 64 MiB" in result.stderr
    assert "alias" not in result.stderr
    assert summary(result).startswith("4 up to date, 0 stale, 4 damaged/not generated")


def test_source_that_is_a_fifo_is_never_read(work: Path):
    (work / "m.txt").unlink()
    os.mkfifo(work / "m.txt")
    result = check()
    assert result.exit_code == 1
    assert "gen/a.py: header damaged or source gone: its source 'm.txt' is missing" in (
        result.stderr
    )
    assert summary(result).startswith("0 up to date, 0 stale, 3 damaged")


def test_symlinked_folder_is_noted_not_followed(work: Path, tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    (elsewhere / "x.py").write_text("x = 1\n")
    os.symlink(elsewhere, work / "gen" / "linked")
    result = check()
    assert result.exit_code == 0, result.output
    assert "note: gen/linked: a symbolic link to a folder, not followed" in result.stderr


def test_stale_temporary_files_are_listed_not_counted(work: Path):
    stale = work / "gen" / ".a.py.unroller-tmp-12345-abcd"
    stale.write_text("half")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    young = work / "gen" / f".b.py.unroller-tmp-{os.getpid()}-abcd"
    young.write_text("half")
    result = check()
    assert result.exit_code == 0, result.output
    assert f"note: {stale.relative_to(work)}: left by an interrupted write" in result.stderr
    assert young.name not in result.stderr
    assert stale.exists()  # check changes nothing


def test_the_original_report_in_a_real_process(work: Path):
    """The issue's case: `import os` appended and the header re-prefixed, plus malformed
    fields that once gave TypeError/AttributeError tracebacks; one process, exit 1."""
    gen = work / "gen"
    edit(gen / "a.py", lambda ls: appended(["#unroller:" + ls[0][len("# unroller:") :], *ls[1:]]))
    edit(gen / "b.py", with_header(["not", "a", "dict"]))
    with_fields(stage_starts=5, source=None)(gen / "c.py")
    result = subprocess.run(
        [str(UNROLL), "check", "gen"],
        cwd=work,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        timeout=120,
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert lines[0].startswith("gen/a.py: header damaged: line 1 looks like a re-prefixed header")
    assert lines[1] == "gen/b.py: header damaged: the header is a list, not a JSON object"
    assert lines[2] == "gen/c.py: header damaged: 'source' is None, not a string"
    assert lines[3] == "0 up to date, 0 stale, 3 damaged/not generated (3 .py files under gen)"
    assert len(lines) == 4


@pytest.mark.slow  # make test runs `unroll check generated` itself
def test_parallel_check_reports_like_a_sequential_one(tmp_path: Path, monkeypatch) -> None:
    """``--jobs 2`` regenerates in worker processes; verdicts and lines are the same."""
    from unroller.api import generate_from_text

    monkeypatch.chdir(tmp_path)
    Path("m.txt").write_text(MODEL)
    gen = tmp_path / "gen"
    gen.mkdir()
    text = generate_from_text(MODEL, label="m.txt")
    for i in range(4):
        (gen / f"f{i}.py").write_text(text)
    (gen / "f1.py").write_text(text + "import os\n")  # edited after generation
    (gen / "f2.py").write_text(text.replace("# unroller: ", "#unroller: ", 1))  # damaged
    results = {}
    for jobs in ("1", "2"):
        out = subprocess.run(
            [str(UNROLL), "check", "gen", "--jobs", jobs],
            capture_output=True,
            text=True,
            timeout=120,
        )
        results[jobs] = (out.returncode, out.stderr)
    assert results["1"] == results["2"]
    assert results["2"][0] == 1
    assert "2 up to date, 1 stale, 1 damaged/not generated" in results["2"][1]


# ---- files import would load instead of a checked module --------------------------------


def forged_cache(source: Path, body: str = "import os\n") -> bytes:
    """Byte code of other code, with a header that matches ``source`` (what import checks)."""
    from importlib._bootstrap_external import _code_to_timestamp_pyc

    info = source.stat()
    return bytes(
        _code_to_timestamp_pyc(compile(body, str(source), "exec"), info.st_mtime, info.st_size)
    )


def cache_name(stem: str, tag: str | None = None) -> str:
    return f"{stem}.{tag or sys.implementation.cache_tag}.pyc"


def test_files_that_shadow_a_checked_module_are_reported(work: Path):
    """gen/a/__init__.pyc once left `check` saying "up to date" while `import gen.a` ran it."""
    import py_compile

    gen = work / "gen"
    (gen / "a").mkdir()
    (gen / "a" / "x.py").write_text("import os\n")
    py_compile.compile(str(gen / "a" / "x.py"), cfile=str(gen / "a" / "__init__.pyc"))
    (gen / "a" / "x.py").unlink()
    (gen / "b").mkdir()
    (gen / "b" / "__init__.py").write_text("")  # empty, yet `import gen.b` loads it
    (gen / "c.abi3.so").write_bytes(b"\x7fELF")
    (gen / "loose.pyc").write_bytes(b"")
    result = check()
    assert result.exit_code == 1
    lines = result.stderr.splitlines()
    assert "gen/a.py: shadowed: gen/a/ is a package (__init__.pyc), which import loads" in (
        result.stderr
    )
    assert "gen/b.py: shadowed: gen/b/ is a package (__init__.py)" in result.stderr
    assert "gen/c.py: shadowed: gen/c.abi3.so is an extension module" in result.stderr
    for name, kind in {
        "gen/a/__init__.pyc": "byte code",
        "gen/loose.pyc": "byte code",
        "gen/c.abi3.so": "an extension module",
    }.items():
        assert f"{name}: not generated: {kind} that import can load (unroller writes only" in (
            "\n".join(lines)
        )
    assert summary(result) == (
        "0 up to date, 0 stale, 6 damaged/not generated "
        "(4 .py files under gen, 1 empty __init__.py, 3 importable non-.py files)"
    )


def test_byte_code_caches_are_compared_with_their_source(work: Path):
    """A cache whose header matches the source runs instead of it: forged, it is reported;
    Python's own (import, compileall, -O) and one import ignores are fine."""
    import compileall

    gen = work / "gen"
    assert compileall.compile_dir(str(gen), quiet=1, optimize=[0, 1])
    cache = gen / "__pycache__"
    assert check().exit_code == 0
    (cache / cache_name("a")).write_bytes(forged_cache(gen / "a.py"))
    (cache / cache_name("b", "cpython-39")).write_bytes(forged_cache(gen / "b.py"))
    stale = forged_cache(gen / "c.py")
    (cache / cache_name("c")).write_bytes(stale[:12] + b"\0\0\0\0" + stale[16:])  # wrong size
    result = check()
    assert result.exit_code == 1
    lines = result.stderr.splitlines()
    assert lines[0] == (
        f"gen/a.py: shadowed: gen/__pycache__/{cache_name('a')} is byte code that differs "
        "from a.py, and import runs it instead of the source: delete it"
    )
    assert lines[1].startswith(
        "gen/b.py: gen/__pycache__/b.cpython-39.pyc is byte code for another Python"
    )
    assert summary(result).startswith("1 up to date, 0 stale, 2 damaged")


# ---- a header names a file outside the project ------------------------------------------


def planted(path: Path, source: str) -> None:
    """Point the header of ``path`` at ``source``, with a checksum that matches again."""
    from unroller.compiler.codegen import CHECKSUM_TAG, body_checksum

    with_fields(source=source)(path)
    lines = lines_of(path)
    at = next(i for i, line in enumerate(lines) if line.startswith(CHECKSUM_TAG))
    lines[at] = f"{CHECKSUM_TAG}{body_checksum(''.join(lines))}\n"
    path.write_text("".join(lines), encoding="utf-8")


def test_a_header_cannot_point_check_outside_the_project(work: Path, tmp_path_factory):
    secret = tmp_path_factory.mktemp("outside") / "token.txt"
    secret.write_text("ghp_SECRET_TOKEN_123 and more\n")
    (work / "inside.txt").write_text("ghp_INSIDE_TOKEN_456 and more\n")
    os.symlink(secret, work / "link.txt")
    gen = work / "gen"
    ups = "../" * len(work.parts)
    for name, source in {
        "abs": str(secret),
        "dotdot": ups + str(secret).lstrip("/"),
        "link": "link.txt",
        "inside": "inside.txt",
    }.items():
        (gen / f"{name}.py").write_bytes((gen / "a.py").read_bytes())
        planted(gen / f"{name}.py", source)
    result = check()
    assert result.exit_code == 1
    assert "SECRET" not in result.output and "INSIDE" not in result.output
    for name in ("abs", "dotdot", "link"):
        assert f"gen/{name}.py: header damaged: its source " in result.stderr
    assert result.stderr.count("lies outside the working directory and the folder") == 3
    assert "gen/inside.py: cannot regenerate: its source 'inside.txt' has an error at line 1" in (
        result.stderr
    )
    assert summary(result).startswith("3 up to date, 1 stale, 3 damaged")


def test_a_config_outside_the_project_is_never_read_through_another_base(
    work: Path, tmp_path_factory
):
    """The generator reads a header's compression config relative to the working
    directory: check once skipped an outside file there, found a copy beside the
    generated file, and then let the generator read the outside one."""
    config = '[default]\ncompressor = "quant"\nbits = 8\n'
    (work / "c.toml").write_text(config)
    made = runner.invoke(
        app, ["generate", "m.txt", "--compress-config", "c.toml", "-o", "gen/q.py"]
    )
    assert made.exit_code == 0, made.output
    assert summary(check()).startswith("4 up to date")
    secret = tmp_path_factory.mktemp("outside") / "c.toml"
    secret.write_text(config)
    (work / "c.toml").unlink()
    os.symlink(secret, work / "c.toml")
    (work / "gen" / "c.toml").write_text(config)  # an inside copy under another base
    result = check()
    assert "gen/q.py: header damaged: its compression config 'c.toml' lies outside" in (
        result.stderr
    )
    assert summary(result).startswith("3 up to date, 0 stale, 1 damaged")


# ---- parallel check: no code from the working directory ----------------------------------


def test_parallel_check_runs_no_code_from_the_working_directory(work: Path):
    """`check -j 2` starts multiprocessing's fork server (`python -c ...`), which once put
    the working directory first on sys.path: ./multiprocessing/ ran before anything."""
    planted_modules = ["multiprocessing/__init__.py", "socket.py", "selectors.py", "typer.py"]
    for name in planted_modules:
        (work / name).parent.mkdir(exist_ok=True)
        marker = work / f"ran-{name.replace('/', '_')}"
        (work / name).write_text(f"open({str(marker)!r}, 'w').close()\n")
    result = subprocess.run(
        [str(UNROLL), "check", "gen", "--jobs", "2"],
        cwd=work,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        timeout=120,
    )
    assert sorted(p.name for p in work.glob("ran-*")) == []
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines()[-1].startswith("3 up to date, 0 stale, 0 damaged")
