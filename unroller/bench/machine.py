"""The machine and the command a run was made on, written at the top of every report.

Timings mean little without the machine, its load and the exact command; one
description serves every preset, so their reports say the same things the same way.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch


def loadavg() -> list[float] | None:
    """The 1/5/15-minute load averages (other jobs on the machine), or None."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def describe(prog: str, argv: Sequence[str]) -> dict[str, Any]:
    """Date, processor, platform, versions, threads, load, and the command line."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "processor": platform.processor(),
        "cpu_model": cpu_model(),
        "machine": platform.machine(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "num_threads": torch.get_num_threads(),
        "loadavg_start": loadavg(),
        "command": shlex.join([*prog.split(), *map(shown_argument, argv)]),
        "executable": shown_path(sys.executable),
    }


def shown_path(path: str | os.PathLike[str]) -> str:
    """``path`` as a results file records it: relative to the working directory when it lies
    inside it, else its last part only, so that results name no absolute path of the
    machine that measured them."""
    resolved = Path(path).resolve()
    try:
        return resolved.relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return resolved.name


def shown_argument(word: str) -> str:
    """A command-line word as a results file records it: an absolute path, alone or as
    the value of ``--flag=PATH``, as ``shown_path`` shows it; any other word unchanged."""
    flag, equals, value = word.partition("=") if word.startswith("-") else ("", "", word)
    if not equals and flag:
        return word
    if not os.path.isabs(value):
        return word
    return flag + equals + shown_path(value)
