"""The documentation the repository owns stays true to the code.

docs/language.md is the language's contract; its operator table is written from the
registry (``unroll ops --update docs/language.md``), so a new operator, argument or default
that is not in the page fails here with the command that fixes it.
"""

from __future__ import annotations

import re

from conftest import ROOT
from typer.testing import CliRunner

from unroller.cli import app
from unroller.compiler.reference import BEGIN, END, operator_table, with_table
from unroller.compiler.registry import load_registry

LANGUAGE = ROOT / "docs" / "language.md"


def test_the_operator_table_is_the_registrys():
    page = LANGUAGE.read_text(encoding="utf-8")
    assert with_table(page) == page, "run: unroll ops --update docs/language.md"


def test_every_operator_and_argument_is_in_the_table():
    table = operator_table()
    for name, spec in load_registry().items():
        row = next(line for line in table.splitlines() if line.startswith(f"| `{name}` |"))
        for arg in spec.args:
            assert f"`{arg}" in row, (name, arg)
        for tensor in (*spec.params, *spec.buffers):
            assert f"`{tensor.name}`" in row, (name, tensor.name)


def test_optional_inputs_are_bracketed():
    row = next(
        line
        for line in operator_table().splitlines()
        if line.startswith("| `scaled_dot_product_attention` |")
    )
    assert "`q, k, v, [bias]`" in row


def test_update_rewrites_only_the_marked_section(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(f"# Title\n\nbefore\n\n{BEGIN}\nstale\n{END}\n\nafter\n", encoding="utf-8")
    result = CliRunner().invoke(app, ["ops", "--update", str(page)])
    assert result.exit_code == 0, result.output
    text = page.read_text(encoding="utf-8")
    assert text.startswith("# Title\n\nbefore\n\n") and text.endswith(f"{END}\n\nafter\n")
    assert "stale" not in text and "| `conv2d` |" in text
    page.write_text("no markers here\n", encoding="utf-8")
    result = CliRunner().invoke(app, ["ops", "--update", str(page)])
    assert result.exit_code == 2 and "no operator section" in result.output
    assert page.read_text(encoding="utf-8") == "no markers here\n"  # nothing lost


def test_no_repository_text_links_outside_it():
    """A clone has no ../shared: no tracked text file may point there or to an absolute
    machine path."""
    import subprocess

    files = subprocess.run(
        ["git", "ls-files", "*.md", "*.py", "*.txt", "*.toml", "*.j2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    bad = []
    for name in files:
        text = (ROOT / name).read_text(encoding="utf-8", errors="replace")
        for needle in ("../shared", "/work/"):
            if needle in text and name != "tests/project/test_docs.py":
                bad.append(f"{name}: {needle}")
    assert not bad, bad


def test_result_tables_in_the_docs_are_the_results_files():
    """Measured tables are included from benchmarks/results (python -m benchmarks.doc_tables),
    never pasted: every page's includes equal the files now."""
    from benchmarks.doc_tables import fill, pages

    stale = [p.name for p in pages() if fill(p.read_text(encoding="utf-8")) != p.read_text()]
    assert not stale, f"run: python -m benchmarks.doc_tables ({stale})"


def test_an_include_copies_its_file_and_refuses_other_paths():
    import pytest

    from benchmarks.doc_tables import END, fill

    page = (
        '<!-- include: benchmarks/results/compress_bench.md start="|" -->\nSTALE TEXT\n'
        + END
        + "\n"
    )
    filled = fill(page)
    assert "STALE TEXT" not in filled and filled.count("|") > 4
    with pytest.raises(ValueError, match="only files under benchmarks/results"):
        fill("<!-- include: pyproject.toml -->\nx\n" + END)


def test_headline_reads_the_slopes_of_a_run(tmp_path):
    """benchmarks.headline: per network, autograd's MiB per sample and how many times less
    the best of ours keeps within the time limit, checkpointing and hooks at any time."""
    import json

    from benchmarks.headline import headline

    def run(kind, method, slope, time):
        return {
            "type": "run",
            "benchmark": "net",
            "kind": kind,
            "method": method,
            "time_ratio": {"median": time},
            "per_sample": {"batches": [4, 8], "bytes_per_sample": slope * 2**20},
        }

    rows = [
        {"type": "meta", "command": "python -m benchmarks.run X", "cpu_count": 2},
        run("autograd", "autograd", 8.0, 1.0),
        run("ours", "ours:quant", 2.0, 1.2),
        run("ours", "ours:tiny-but-slow", 0.5, 2.0),  # past the time limit: not the best
        run("checkpoint", "checkpoint", 4.0, 1.5),
        run("hooks", "hooks:quant", 3.2, 1.1),
    ]
    path = tmp_path / "bench.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    table = headline(path)
    row = next(line for line in table.splitlines() if line.startswith("| net |"))
    assert "| 8.000 |" in row
    assert "4.0x less at 1.20x time (`ours:quant`)" in row
    assert "2.0x less at 1.50x time (`checkpoint`)" in row
    assert "2.5x less at 1.10x time (`hooks:quant`)" in row
    assert "python -m benchmarks.run X" in table


def _tracked(*patterns: str) -> list[str]:
    import subprocess

    return subprocess.run(
        ["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()


def test_no_repository_text_names_issues_or_sessions():
    """The repository explains itself: no text refers to the tracker's issues or to work
    sessions, which a reader of a clone cannot see."""
    import re

    pattern = re.compile(r"\bissue[ _-]?\d+|\bsessions?\b", re.I)
    bad = []
    for name in _tracked("*.md", "*.py", "*.txt", "*.toml", "*.j2", "Makefile"):
        if name == "tests/project/test_docs.py":
            continue
        text = (ROOT / name).read_text(encoding="utf-8", errors="replace")
        bad += [f"{name}: {m.group(0)}" for m in pattern.finditer(text)]
    assert not bad, bad


def test_links_in_the_docs_resolve():
    """Every relative link of README.md and docs/*.md names a file of the repository."""
    import re

    bad = []
    for name in _tracked("README.md", "docs/*.md"):
        page = ROOT / name
        for target in re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", page.read_text()):
            if re.match(r"^[a-z]+:", target):
                continue
            if not (page.parent / target).exists():
                bad.append(f"{name}: {target}")
    assert not bad, bad


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, len(lines)


def _bench_run(name, kind, method, slope, time, max_batch=None):
    row = {
        "type": "run",
        "benchmark": name,
        "kind": kind,
        "method": method,
        "batch": 4,
        "time_ratio": {"median": time},
        "per_sample": {"batches": [4, 8], "bytes_per_sample": slope * 2**20},
    }
    if max_batch is not None:
        batch, basis, ratio = max_batch
        row["max_batch"] = {
            "budget_bytes": 64 * 2**20,
            "max_batch": batch,
            "basis": basis,
            "confirmed": basis == "measured",
        }
        row["max_batch_ratio_vs_autograd"] = ratio
        row["max_batch_speed"] = {"ratio_vs_autograd": {"median": 0.9}}
        if kind == "ours":
            row["predicted"] = {"ideal_max_batch": batch + 1, "measured_over_floor": 1.02}
    return row


def _write_run(tmp_path, runs):
    import json

    meta = {"type": "meta", "command": "python -m benchmarks.run X --out-dir /elsewhere/run"}
    path = tmp_path / "bench.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [meta, *runs]) + "\n")
    return path


def test_summary_tables_per_sample_matrix(tmp_path):
    """benchmarks.summary_tables: per method and network, x less than autograd per sample
    and the step time, with the run's command (an absolute --out-dir named where it lies)."""
    from benchmarks.summary_tables import per_sample_matrix

    path = _write_run(
        tmp_path,
        [
            _bench_run("a", "autograd", "autograd", 8.0, 1.0),
            _bench_run("a", "ours", "ours:quant", 2.0, 1.2),
            _bench_run("b", "autograd", "autograd", 1.0, 1.0),
            _bench_run("b", "checkpoint", "checkpoint", 0.05, 1.5),
        ],
    )
    table = per_sample_matrix(path)
    lines = table.splitlines()
    assert lines[0] == "| method | a | b |"
    assert "| autograd, MiB per sample | 8 | 1 |" in lines
    assert "| ours:quant | 4.00x / 1.20x | n/a |" in lines
    assert "| checkpoint | n/a | 20.0x / 1.50x |" in lines
    assert "batch 4 and 8" in table and "/elsewhere" not in table
    assert f"python -m benchmarks.run X --out-dir {tmp_path.as_posix()}" in table


def test_summary_tables_max_batch(tmp_path):
    from benchmarks.summary_tables import max_batch_tables

    path = _write_run(
        tmp_path,
        [
            _bench_run("a", "autograd", "autograd", 8.0, 1.0, (10, "measured", 1.0)),
            _bench_run("a", "ours", "ours:quant", 2.0, 1.2, (30, "predicted", 3.0)),
            _bench_run("a", "hooks", "hooks:quant", 4.0, 1.1, (15, "search", 1.5)),
        ],
    )
    table = max_batch_tables(path)
    assert "| a (64 MiB) | 10 | 3.00x p | 1.50x u |" in table
    assert "| ours:quant | 30 p (3.00x) | 31 | 0.90x | 1.200x | 1.02x |" in table
    assert "| autograd | 10 (1.00x) | - | 0.90x | 1.000x | - |" in table
    assert "### a" in table and "Marks:" in table


def test_summary_tables_core(tmp_path):
    import json

    from benchmarks.summary_tables import core_table

    model = {
        "model": "tiny",
        "parameters": 12000,
        "time": {
            "ours": {"median": 10.0},
            "autograd": {"median": 8.0},
            "ratio": {"median": 1.25},
        },
        "memory": {"ours": {"peak_bytes": 2**20}, "autograd": {"peak_bytes": 2 * 2**20}},
        "saved": {
            "ours_predicted_bytes": 2**19,
            "autograd_counted": {"without_params_bytes": 2**20},
        },
    }
    path = tmp_path / "core.json"
    path.write_text(
        json.dumps({"meta": {"command": "python -m benchmarks.core_bench"}, "models": [model]})
    )
    table = core_table(path)
    assert "| tiny (12k params) | 10.0 | 8.0 | 1.250 | 1.00 / 2.00 | 0.50 / 1.00 |" in table
    assert "python -m benchmarks.core_bench" in table


# What a measurement looks like in prose: a ratio against something (8.6x less, 1.14-1.22x,
# 0.53x), a time (29 ms, 2,122 s), a measured size (1.45 MiB, 725 KiB per sample), a share
# of something measured (17%), a date or commit a figure was taken at, a tally of runs;
# a difference or level of a training metric (-0.46 pp, 0.40 dB, 0.0003 IoU, 3.36
# bits/char), a signed decimal of two or more places (+1.11 and -1.39 pp: a measured
# difference, where a limit or a format fact is unsigned or one place: +0.0, -1.0), a
# ratio in words (7-10 times less).
_MEASURED = re.compile(
    r"(?<![\w.])[+-]?\d+(?:\.\d+)? ?(?:pp|dB|IoU)\b"
    r"|\b\d+(?:\.\d+)? percentage points?\b"
    r"|(?<![\w.+=-])[+-]\d+\.\d{2,}\b"
    r"|\b\d+(?:\.\d+)? ?bits?(?:/| per )char"
    r"|\b\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)? times (?:less|more|fewer|smaller|larger|faster"
    r"|slower)\b"
    r"|\b\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?x (?:less|more|smaller|larger|faster|slower|fewer"
    r"|below|above|the|its|autograd)\b"
    r"|(?<![\w.])\d+\.\d+(?:-\d+\.\d+)?x\b"
    r"|\b\d+-\d+x\b"
    r"|\b\d[\d,]*(?:\.\d+)?(?:-\d+(?:\.\d+)?)? ?(?:ms|us)\b"
    r"|\(\d[\d,]* s[),;]"
    r"|\b\d[\d,]*(?:\.\d+)? ?(?:s|seconds) (?:each|per (?:step|run|model))\b"
    r"|\b\d[\d,]*\.\d+ ?(?:KiB|MiB|GiB|KB|MB|GB)\b"
    r"|\b\d[\d,]*(?:\.\d+)? ?(?:B|KiB|MiB|GiB|KB|MB) (?:per (?:sample|token)|/ sample)\b"
    r"|\b\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)? ?%"
    r"|\b\d+(?:-\d+)? (?:min|minutes)\b"
    r"|\b20\d\d-\d\d-\d\d\b"
    r"|\bcommits? `?[0-9a-f]{7,40}\b|`[0-9a-f]{7,40}`|--old [0-9a-f]{7}"
    r"|\bmeasured (?:at|on) (?:commit|a snapshot|\d|this \d|another|the \w+ VM)"
    r"|\bby a hair\b|\bbefore/after\b|\bwent from \S+ to\b"
    r"|\bin (?:two|three|four|five|six|\d+) runs(?: of (?:two|three|six|\d+))?\b"
    r"|\bload(?: average)? \d",
    re.I,
)

# Figures that are not measurements: a limit, a default, a threshold a goal states, or a
# fact of the format. Each entry is the exact text around the figure, reviewed by hand.
_NOT_MEASURED = {
    "<= 1.3x",  # the harness's time limit for "the best of ours" (a goal, not a result)
    "<= 1.3x autograd",
    "within 1.3x autograd",  # the same limit, as the README's headline states it
    ">= 0.5x",  # a codec goal: round trip at half of clone's bandwidth or better
    "within 10% of",  # auto's budget: the least reachable peak + 10% (a definition)
    "plus 10%",
    "at most 2%",  # the planner's first tier of forms (a definition)
    "+ 10%",
    "(10 minutes old",  # when a stale lock is taken over (docs/cli.md)
    "about 10 % of files",  # pysource's validation split (a definition)
    "the IPU case study: 1.1-3.5x faster",  # published figures, cited as such (docs/scaling.md)
    "streaming; 17-20x",
    "29 gradients, 0.30 MiB",  # the shape of a printed line, in an example of output
    "within 1 pp",  # the accuracy goals' limits (docs/accuracy.md), stated before the runs
    "within 0.05 bits/char",
}


def _prose(page: str) -> str:
    """``page`` with its include blocks blanked (their text is a results file's), lines
    kept where they were."""
    from benchmarks.doc_tables import END

    def blank(match: re.Match) -> str:
        return "\n" * match.group(0).count("\n")

    return re.sub(r"<!-- include: .*?" + re.escape(END), blank, page, flags=re.S)


def _measured_figures(page: str) -> list[str]:
    found = []
    for number, line in enumerate(_prose(page).splitlines(), 1):
        allowed = [
            (m.start(), m.end()) for ok in _NOT_MEASURED for m in re.finditer(re.escape(ok), line)
        ]
        for match in _MEASURED.finditer(line):
            if not any(a <= match.start() and match.end() <= b for a, b in allowed):
                found.append(f"{number}: {match.group(0)!r} in {line.strip()[:100]!r}")
    return found


def test_guides_quote_measurements_only_through_includes():
    """Every figure a guide gives of a measurement comes from a results file through an
    include (benchmarks/results, with the command and machine that measured it); prose
    describes the present and quotes no number a later run could contradict."""
    bad = []
    for name in _tracked("README.md", "docs/*.md"):
        bad += [f"{name}:{hit}" for hit in _measured_figures((ROOT / name).read_text())]
    assert not bad, "\n".join(bad)


def test_the_measurement_pattern_catches_pasted_figures():
    pasted = [
        "| ours dct-dense | 1441 | 725 | **8.63x less** |",
        "dct-dense 8.47x less at 1.14-1.22x time in six runs of six",
        "the step's codec time at batch 4 from 79 to 29 ms",
        "1.45 MiB on ResNet-34",
        "Measured 2026-12-01 at commit 2fbd843",
        "met by a hair, not with margin",
        "the DCT codec about 17%",
        "Block recompute matches checkpointing (0.53x against 0.55x)",
        "**met**, -0.46 pp and +0.09 pp",
        "costs 0.40 dB (64x64) on denoising",
        "nocompress 28.40 dB; quant 8/4/2 bits -0.02 / +0.01 / -0.22 dB",
        "free everywhere (within 0.1 pp, 0.1 dB, 0.0003 IoU)",
        "the 4-bit and 2-bit runs land at +1.11 and -1.39 pp",
        "the noisy inputs are at 13.8 dB",
        "one test image is 0.28 pp",
        "`dct-dense` stores 7-10 times less",
        "nothing measurable on the cloud masks (-0.002 IoU)",
        "within 1 percentage point: met, +0.0002 bits/char (even 2-bit is +0.008)",
        "a unigram model scores 4.46 bits/char",
    ]
    for text in pasted:
        assert _measured_figures(text), text
    fine = [
        "keeps 16 of 64 coefficients in 4 bits, int8",
        "`--memory-budget 2GiB`, a file of at most 64 MiB",
        "the best of ours at <= 1.3x autograd's time",
        "Goal: 8-bit `quant` within 1 pp of `nocompress`",
        "`quant` within 0.05 bits/char of `nocompress`",
        "a zero minimum is stored as +0.0; -0.0 inputs decompress to +0.0",
        "`min_val=-1.0`, `compiled-budget-0.5` / `-0.1`",
        "<!-- include: benchmarks/results/x.md -->\n| a | 8.63x less |\n<!-- end include -->",
    ]
    for text in fine:
        assert not _measured_figures(text), text


def test_every_include_names_a_results_file():
    """An include names an existing file under benchmarks/results (and its start/end
    phrases are in it), so a renamed or deleted results file fails here, not in a reader."""
    from benchmarks.doc_tables import _INCLUDE, _excerpt

    bad = []
    for name in _tracked("README.md", "docs/*.md"):
        page = (ROOT / name).read_text(encoding="utf-8")
        opened = page.count("<!-- include: ")
        matches = list(_INCLUDE.finditer(page))
        if len(matches) != opened:
            bad.append(f"{name}: {opened} includes opened, {len(matches)} closed")
        for match in matches:
            try:
                _excerpt(match["path"], match["options"])
            except (OSError, ValueError) as error:
                bad.append(f"{name}: {error}")
    assert not bad, bad


def test_accuracy_summaries_are_what_their_scripts_write():
    """benchmarks/results/accuracy/goals.md (differences and goal verdicts, from every
    experiment's summary.json) and stash_per_token.md (the stash plans of the two
    transformers) are reproduced byte for byte by their scripts, in seconds."""
    from benchmarks import accuracy_goals, stash_per_token

    for module in (accuracy_goals, stash_per_token):
        assert module.OUT.read_text(encoding="utf-8") == module.report(), f"run: {module.COMMAND}"


def test_accuracy_goals_judge_the_absolute_difference():
    from benchmarks.accuracy_goals import goals

    def row(scheme, delta, diverged=0):
        return {
            "scheme": scheme,
            "metric": "accuracy",
            "seeds": [0, 1],
            "delta": delta,
            "diverged": diverged,
        }

    summary = {
        "rows": [
            row("nocompress", 0.0),
            row("dct-dense", -1.2),
            row("quant-8bit", 0.9),
            row("auto", 0.1, diverged=1),
        ]
    }
    table = "\n".join(goals([("x", summary)]))
    assert (
        "| x | dct-dense | within 1 pp of nocompress (mean of 2 seeds) | -1.20 pp | **NOT met** |"
        in table
    )
    assert (
        "| x | quant-8bit | within 1 pp of nocompress (mean of 2 seeds) | +0.90 pp | met |" in table
    )
    assert "| x | auto |" in table and table.count("**NOT met**") == 2
