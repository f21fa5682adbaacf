"""Hostile output paths for ``unroll generate -o`` (and ``diff --against``, stdout).

Each case must end in one ``unroll: error: ...`` line, exit status 2, no traceback, and
leave what was there untouched: /dev/zero is never read (it once read until the process
was OOM-killed), a FIFO never blocks, a full standard output is an error, a symbolic link
is followed only to an existing regular file (which is replaced atomically; the link
stays), a missing folder is created only with ``--mkdir``, and temporary files
(``.NAME.unroller-tmp-PID-RANDOM``) never outlive a failed write.

Most cases run the Typer app in process under an alarm (and /dev/zero under a memory
cap), so a regression fails in seconds instead of blocking or exhausting memory; the one
where the real process matters (a full stdout at interpreter exit) runs the ``unroll``
script with a timeout.
"""

from __future__ import annotations

import os
import resource
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import time_limit

from tests.adversarial.cli_cases import invoke, refused
from unroller import files
from unroller.api import PathError, generate_source, read_bounded, stale_temps, write_atomic
from unroller.cli import app
from unroller.compiler.options import Options

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
CHANGED = MODEL.replace("out_features=5", "out_features=7")


@pytest.fixture(autouse=True)
def alarm():
    """No case may block: a FIFO opened for reading or writing would hang forever."""
    with time_limit(30, TimeoutError("blocked for 30 s")):
        yield


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.txt").write_text(MODEL, encoding="utf-8")
    return tmp_path


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def fresh(model: str = "m.txt") -> str:
    return generate_source(model, Options())


def run_unroll(*args: str, cwd: Path, stdout=subprocess.PIPE):
    return subprocess.run(
        [str(UNROLL), *args],
        cwd=cwd,
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        timeout=120,
    )


def dead_pid() -> int:
    """A process id no process has here (beyond pid_max if need be)."""
    for pid in range(2**22 + 1000, 2**22, -1):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            continue
    raise AssertionError("no free pid")


# ---- devices and FIFOs ----------------------------------------------------------------


@pytest.fixture
def memory_cap():
    """At most 1 GiB more address space while the test runs: reading /dev/zero to the end
    (what -o /dev/zero once did, until the OOM killer came) fails fast instead."""
    with open("/proc/self/status") as status:
        size = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (size + (1 << 30), hard))
    yield
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_character_devices_are_refused_unread(work: Path, memory_cap, force: list[str]):
    for device in ("/dev/zero", "/dev/null"):
        refused(invoke("generate", "m.txt", "-o", device, *force), device, "character device")
    assert names(work) == ["m.txt"]


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_fifo_is_refused_and_never_opened(work: Path, force: list[str]):
    os.mkfifo(work / "out.py")
    refused(invoke("generate", "m.txt", "-o", "out.py", *force), "out.py is a named pipe (FIFO)")
    assert stat.S_ISFIFO(os.lstat(work / "out.py").st_mode)  # not replaced by a file
    assert names(work) == ["m.txt", "out.py"]


def test_diff_against_a_fifo_or_device_is_refused(work: Path):
    os.mkfifo(work / "pipe.py")
    for against in ("pipe.py", "/dev/zero"):
        result = invoke("diff", "m.txt", "--against", against)
        refused(result, against, "not a regular file")


def test_write_atomic_refuses_a_fifo(tmp_path: Path):
    os.mkfifo(tmp_path / "out.py")
    with pytest.raises(PathError, match="named pipe"):
        write_atomic(tmp_path / "out.py", "x = 1\n")
    with pytest.raises(PathError, match="named pipe"):
        read_bounded(tmp_path / "out.py")
    assert names(tmp_path) == ["out.py"]


# ---- standard output ------------------------------------------------------------------


def test_full_stdout_is_an_error_not_a_traceback(work: Path):
    """The real process: one line, status 2, and nothing more when the interpreter exits
    (what is still buffered for stdout must not fail a second time)."""
    with open("/dev/full", "w") as full:
        result = run_unroll("generate", "m.txt", "-o", "-", cwd=work, stdout=full)
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        "unroll: error: cannot write to standard output: No space left on device\n"
    )


@pytest.mark.parametrize(
    "args",
    [
        ["generate", "m.txt"],
        ["diff", "m.txt", "--scheme", "nocompress", "--scheme", "quant"],
        ["graph", "m.txt", "--format", "json"],
        ["ops"],
    ],
)
def test_full_stdout_in_process(work: Path, monkeypatch, capsys, args: list[str]):
    with open("/dev/full", "w") as full:
        monkeypatch.setattr(sys, "stdout", full)
        with pytest.raises(SystemExit) as exit_info:
            app(args, prog_name="unroll")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.endswith("unroll: error: cannot write to standard output: No space left on device\n")


# ---- symbolic links: followed to an existing regular file only -------------------------


def test_symlink_to_a_generated_file_is_followed_and_survives(work: Path):
    (work / "real").mkdir()
    assert invoke("generate", "m.txt", "-o", "real/lin.py").exit_code == 0
    os.symlink("real/lin.py", work / "lin.py")
    (work / "m.txt").write_text(CHANGED, encoding="utf-8")
    result = invoke("generate", "m.txt", "-o", "lin.py")
    assert result.exit_code == 0, result.output
    assert "wrote lin.py (-> " in result.stderr
    assert os.path.islink(work / "lin.py") and os.readlink(work / "lin.py") == "real/lin.py"
    assert (work / "real" / "lin.py").read_text() == fresh()
    assert names(work / "real") == ["lin.py"] and names(work) == ["lin.py", "m.txt", "real"]


def test_symlink_to_a_hand_edited_file_is_refused_through_the_link(work: Path):
    assert invoke("generate", "m.txt", "-o", "real.py").exit_code == 0
    edited = (work / "real.py").read_text() + "import os\n"
    (work / "real.py").write_text(edited)
    os.symlink("real.py", work / "lin.py")
    refused(invoke("generate", "m.txt", "-o", "lin.py"), "edited by hand", "--force")
    assert (work / "real.py").read_text() == edited
    assert invoke("generate", "m.txt", "-o", "lin.py", "--force").exit_code == 0
    assert os.path.islink(work / "lin.py") and (work / "real.py").read_text() == fresh()


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_dangling_symlink_is_refused(work: Path, force: list[str]):
    os.symlink("missing/nowhere.py", work / "lin.py")
    refused(invoke("generate", "m.txt", "-o", "lin.py", *force), "symbolic link", "does not exist")
    assert names(work) == ["lin.py", "m.txt"] and not (work / "missing").exists()


def test_symlink_loop_and_links_to_non_files_are_refused(work: Path):
    os.symlink("loop_b.py", work / "loop_a.py")
    os.symlink("loop_a.py", work / "loop_b.py")
    refused(invoke("generate", "m.txt", "-o", "loop_a.py"), "cannot be followed")
    os.symlink("/dev/null", work / "null.py")
    refused(invoke("generate", "m.txt", "-o", "null.py", "--force"), "character device")
    os.mkfifo(work / "pipe")
    os.symlink("pipe", work / "pipe.py")
    refused(invoke("generate", "m.txt", "-o", "pipe.py", "--force"), "named pipe")
    (work / "dir").mkdir()
    os.symlink("dir", work / "dir.py")
    refused(invoke("generate", "m.txt", "-o", "dir.py"), "link to the folder", "file's name")
    assert os.path.islink(work / "null.py") and stat.S_ISFIFO(os.stat(work / "pipe").st_mode)
    assert names(work / "dir") == []


# ---- folders ----------------------------------------------------------------------------


def test_missing_folder_is_refused_unless_mkdir(work: Path):
    refused(invoke("generate", "m.txt", "-o", "new/sub/lin.py"), "folder new/sub does not exist")
    assert names(work) == ["m.txt"]
    result = invoke("generate", "m.txt", "-o", "new/sub/lin.py", "--mkdir")
    assert result.exit_code == 0, result.output
    assert (work / "new/sub/lin.py").read_text() == fresh()


def test_parent_that_is_a_file_is_refused(work: Path):
    for extra in ([], ["--mkdir"]):
        result = invoke("generate", "m.txt", "-o", "m.txt/lin.py", *extra)
        refused(result, "m.txt")
    assert (work / "m.txt").read_text() == MODEL


def test_write_atomic_without_parents_does_not_create_folders(tmp_path: Path):
    with pytest.raises(FileNotFoundError):
        write_atomic(tmp_path / "nope" / "x.py", "x = 1\n", parents=False)
    assert names(tmp_path) == []


# ---- what is read from an existing target ---------------------------------------------


def test_huge_existing_file_is_not_read(work: Path):
    big = work / "out.py"
    with open(big, "wb") as handle:  # sparse: 64 MiB + 1 byte on no disk
        handle.truncate(files.MAX_READ_BYTES + 1)
    refused(invoke("generate", "m.txt", "-o", "out.py"), "larger than 64 MiB", "--force")
    assert big.stat().st_size == files.MAX_READ_BYTES + 1
    assert invoke("generate", "m.txt", "-o", "out.py", "--force").exit_code == 0
    assert big.read_text() == fresh()


def test_read_bounded_stops_at_the_limit(tmp_path: Path):
    (tmp_path / "f").write_bytes(b"x" * 101)
    assert read_bounded(tmp_path / "f", limit=101) == b"x" * 101
    with pytest.raises(PathError, match="larger than"):
        read_bounded(tmp_path / "f", limit=100)


# ---- temporary files ------------------------------------------------------------------


def test_temporary_file_is_recognisable_and_removed_on_interrupt(work: Path, monkeypatch):
    assert invoke("generate", "m.txt", "-o", "out.py").exit_code == 0
    before = (work / "out.py").read_bytes()
    seen = []

    def interrupted(fd):
        seen.extend(n for n in names(work) if n.startswith(".out.py.unroller-tmp-"))
        raise KeyboardInterrupt

    monkeypatch.setattr(files.os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_atomic(work / "out.py", "half")
    assert len(seen) == 1 and seen[0].startswith(f".out.py.unroller-tmp-{os.getpid()}-")
    (work / "m.txt").write_text(CHANGED, encoding="utf-8")
    result = invoke("generate", "m.txt", "-o", "out.py")  # Ctrl-C in the CLI: aborted
    assert result.exit_code not in (0, 2)
    assert (work / "out.py").read_bytes() == before
    assert names(work) == ["m.txt", "out.py"]


def test_full_disk_while_writing_leaves_the_old_file(work: Path, monkeypatch):
    assert invoke("generate", "m.txt", "-o", "out.py").exit_code == 0
    before = (work / "out.py").read_bytes()
    (work / "m.txt").write_text(CHANGED, encoding="utf-8")

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, "fsync", full)
    refused(invoke("generate", "m.txt", "-o", "out.py"), "cannot write out.py", "No space left")
    assert (work / "out.py").read_bytes() == before
    assert names(work) == ["m.txt", "out.py"]


def test_stale_temporary_files_of_the_target_are_removed(work: Path):
    dead = dead_pid()
    files = {
        f".out.py.unroller-tmp-{dead}-0a1b": 2 * 3600,  # old: removed
        f".out.py.unroller-tmp-{dead}-ffff": 120,  # its writer is gone: removed
        f".out.py.unroller-tmp-{dead}-eeee": 5,  # too fresh to judge: kept
        f".out.py.unroller-tmp-{os.getppid()}-cccc": 120,  # a live writer: kept
        f".other.py.unroller-tmp-{dead}-dddd": 2 * 3600,  # another target's: kept
    }
    for name, age in files.items():
        (work / name).write_text("partial")
        os.utime(work / name, (time.time() - age, time.time() - age))
    assert len(stale_temps(work)) == 3 and len(stale_temps(work, "out.py")) == 2
    result = invoke("generate", "m.txt", "-o", "out.py")
    assert result.exit_code == 0, result.output
    assert result.stderr.count("left by an interrupted write") == 2
    assert names(work) == sorted(
        [
            f".out.py.unroller-tmp-{dead}-eeee",
            f".out.py.unroller-tmp-{os.getppid()}-cccc",
            f".other.py.unroller-tmp-{dead}-dddd",
            "m.txt",
            "out.py",
        ]
    )


def test_replacing_keeps_the_file_mode(work: Path):
    assert invoke("generate", "m.txt", "-o", "out.py").exit_code == 0
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((work / "out.py").stat().st_mode) == 0o666 & ~umask  # not mkstemp's 0600
    os.chmod(work / "out.py", 0o640)
    (work / "m.txt").write_text(CHANGED, encoding="utf-8")
    assert invoke("generate", "m.txt", "-o", "out.py").exit_code == 0
    assert stat.S_IMODE((work / "out.py").stat().st_mode) == 0o640
    assert (work / "out.py").read_text() == fresh()


def test_a_large_read_limit_reserves_no_memory(tmp_path: Path):
    """read_bounded asks for what the file holds, not for its limit: ``read(limit + 1)``
    reserves the limit first, so a 16 GiB checkpoint limit once made every ``--resume``
    a MemoryError on a small machine. Run under a 3 GiB address-space cap."""
    small = tmp_path / "small.bin"
    small.write_bytes(b"abc")
    code = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))\n"
        "from unroller.api import read_bounded\n"
        "assert read_bounded(sys.argv[1], 64 << 30) == b'abc'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(small)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr[-2000:]
