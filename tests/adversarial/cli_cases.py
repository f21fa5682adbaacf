"""How the adversarial tests run a command and judge a refusal, in one place: the Typer app
in process (fast; an alarm or a memory cap in the test turns a hang or a runaway into an
escaping exception, which fails the case), and the project's rule for bad input."""

from __future__ import annotations

from typer.testing import CliRunner

from unroller.cli import app

runner = CliRunner()


def invoke(*args: str):
    """``unroll ARGS`` in process; a TimeoutError or MemoryError escaping it fails the test
    (the command blocked or ran away instead of refusing)."""
    result = runner.invoke(app, list(args))
    assert not isinstance(result.exception, (TimeoutError, MemoryError)), result.exception
    return result


def refused(result, *phrases: str, located: bool = False, quiet: bool = False) -> str:
    """Exit status 2, no traceback, one ``unroll: error: ...`` line holding every phrase
    and never "internal error" (``located``: a ``FILE:...: error: ...`` line is also
    accepted; ``quiet``: nothing on standard output either). Returns the line."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    if quiet:
        assert result.stdout == "", result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert line.startswith("unroll: error: ") or (located and ": error: " in line), line
    assert "internal error" not in line and "Traceback" not in result.stderr, line
    for phrase in phrases:
        assert phrase in line, (phrase, line)
    return line
