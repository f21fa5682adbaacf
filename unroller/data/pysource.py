"""``pysource``: a character-level language-model task on the Python standard library.

Every Python installation ships its standard library as ``.py`` sources
(``sysconfig.get_paths()["stdlib"]``), so this is real text that needs no download.
What is read, and how it becomes windows:

- Files: every ``*.py`` under the stdlib folder, except in folders named
  ``site-packages``, ``dist-packages`` (third-party code, different on every machine),
  ``test``, ``tests`` or ``idle_test`` (the test suite: Debian-like systems ship it
  separately, so leaving it out keeps the corpus the same across packagings), and
  ``__pycache__``. Symbolic links to folders are not followed. On CPython 3.11 that is
  about 730 files and 12 M characters.
- Text: each file decoded as UTF-8 (an undecodable byte becomes U+FFFD), line ends
  normalised to ``\\n``.
- Vocabulary: ``VOCAB_SIZE`` = 128 ids, a character's ASCII code; every non-ASCII
  character is id 127 (``OTHER``: DEL, a control character that the standard library's
  sources do not contain, so the id is free; ``benchmarks/models/gpt_tiny.txt`` says the
  same). A model's logits must have exactly 128 classes. Python sources are almost all
  ASCII (under 0.01 % of the characters are other), so "bits per character" is bits
  per Unicode character of the source with that small bucket merged.
- Split by file, not by position: a file is in the validation split when the first 8
  bytes of the SHA-256 of its path relative to the stdlib folder (``/``-separated),
  read as an integer, are ``< VALIDATION_PERCENT`` % of 2**64, so no file contributes
  to both splits and a file's split never depends on which other files exist. About
  10 % of the files (and characters) are validation.
- Windows: the files of a split are concatenated in the order of their relative paths
  into one stream; window ``k`` is ``stream[k*L : k*L + L + 1]`` for the model's
  context length ``L``, its first ``L`` characters are the input ids ``i64[L]`` and its
  last ``L`` the targets (the next character of each input position). Windows do not
  overlap, so each character of a split is predicted at most once.
- Sizes: an epoch over the whole training stream (some 160,000 windows at ``L`` = 64)
  is more than 2 CPU cores can afford per epoch, so by default ``DEFAULT_TRAIN``
  windows are used for training and ``DEFAULT_TEST`` for validation, taken evenly
  spaced over each split's windows (window ``floor(i * W / K)`` for ``i < K`` of
  ``W``), so they cover every part of the split. ``--train-size`` / ``--test-size``
  choose other counts (at most ``W``: then every window). At ``L`` = 64 the defaults
  are 524,288 training and 131,072 validation characters.

Nothing depends on a seed: the same installation always gives the same tensors (the
description names the Python version and a SHA-256 of both streams); training's own
seed then fixes the batches. The metric is bits per character
(``unroller.training.metrics.bits_per_char``) over every target of the validation windows.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
from torch import Tensor

from unroller.data.core import DatasetError, Signature, Split, TaskData

NAME = "pysource"
TASK = "language_modelling"
VOCAB_SIZE = 128
OTHER = 127  # the id of every character outside ASCII (DEL)
VALIDATION_PERCENT = 10
DEFAULT_TRAIN = 8192  # windows
DEFAULT_TEST = 2048
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})
_NOT_ASCII = re.compile(r"[^\x00-\x7f]")


def stdlib_root() -> Path:
    """The folder of this interpreter's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path) -> list[str]:
    """The corpus's files: relative ``/``-separated paths, sorted."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in EXCLUDED_DIRS and d != "__pycache__"]
        rel = Path(folder).relative_to(root)
        found += [(rel / f).as_posix() for f in files if f.endswith(".py")]
    return sorted(found)


def is_validation(relative_path: str) -> bool:
    """The split of a file, from its relative path alone (not Python's salted hash)."""
    digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < VALIDATION_PERCENT * 2**64 // 100


def encode(text: str) -> bytes:
    """Character ids, one byte each: ASCII codes, ``OTHER`` for anything else."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return _NOT_ASCII.sub(chr(OTHER), text).encode("ascii")


def decode(ids: Tensor | list[int]) -> str:
    """Text of character ids (``OTHER`` shows as U+FFFD), for looking at samples."""
    values = ids.tolist() if isinstance(ids, Tensor) else ids
    return "".join("\ufffd" if i == OTHER else chr(i) for i in values)


@dataclass(frozen=True)
class Corpus:
    """Both splits' character streams and what they were made of."""

    root: str
    train_files: int
    test_files: int
    train: bytes
    test: bytes

    @property
    def sha256(self) -> str:
        digest = hashlib.sha256(self.train)
        digest.update(b"\0split\0")
        digest.update(self.test)
        return digest.hexdigest()


@lru_cache(maxsize=2)
def read_corpus(root: str) -> Corpus:
    """The streams of the stdlib at ``root`` (read once per process)."""
    base = Path(root)
    if not base.is_dir():
        raise DatasetError(f"dataset '{NAME}': the standard library folder {root} does not exist")
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    for rel in source_files(base):
        try:
            raw = (base / rel).read_bytes()
        except OSError:  # unreadable (permissions, a dangling link): not part of the corpus
            continue
        parts[is_validation(rel)].append(encode(raw.decode("utf-8", errors="replace")))
    train, test = b"".join(parts[False]), b"".join(parts[True])
    if not train or not test:
        raise DatasetError(
            f"dataset '{NAME}': no Python sources found under {root} for both splits "
            f"({len(parts[False])} training / {len(parts[True])} validation files)"
        )
    return Corpus(root, len(parts[False]), len(parts[True]), train, test)


def window_starts(stream_length: int, length: int, count: int | None) -> Tensor:
    """Start offsets of ``count`` evenly spaced non-overlapping windows of ``length + 1``
    characters (all of them when ``count`` is None or at least their number)."""
    total = max((stream_length - 1) // length, 0)
    count = total if count is None else min(count, total)
    return torch.arange(count, dtype=torch.int64) * total // max(count, 1) * length


def windows(stream: bytes, length: int, count: int | None) -> Split:
    """Input ids ``[K, length]`` and next-character targets ``[K, length]`` (int64)."""
    ids = torch.frombuffer(bytearray(stream), dtype=torch.uint8)
    starts = window_starts(len(stream), length, count)
    index = starts[:, None] + torch.arange(length + 1, dtype=torch.int64)
    chunk = ids[index].long()
    return Split(chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous())


def check(sig: Signature, name: str = NAME) -> int:
    """Fail unless the model is a character language model this dataset fits; its
    context length ``L``."""
    if sig.task != TASK:
        raise DatasetError(
            f"dataset '{name}' is a {TASK} task (character ids [N, L], next-character "
            f"targets [N, L]), but {sig.describe()} is trained for {sig.task} "
            f"(its loss is {sig.loss_op})"
        )
    (length,) = sig.target_shape or (0,)
    if sig.input_shape != (length,) or sig.input_dtype not in ("i64", "i32"):
        raise DatasetError(
            f"dataset '{name}' gives character ids i64[N, L] and targets i64[N, L] of the same "
            f"L, but {sig.describe()} declares input {sig.input_dtype}{list(sig.input_shape)}"
        )
    if sig.vocab != VOCAB_SIZE:
        raise DatasetError(
            f"dataset '{name}' has a vocabulary of {VOCAB_SIZE} characters (ASCII, id {OTHER} "
            f"for any other), but {sig.describe()} scores {sig.vocab} classes per token"
        )
    if sig.pred_class_dim is None:
        raise DatasetError(
            f"dataset '{name}': cannot tell which dim of the prediction of {sig.describe()} "
            f"holds the {sig.vocab} scores; return the cross_entropy's logits [N, C, L]"
        )
    return length


def build(
    sig: Signature,
    name: str = NAME,
    train_size: int | None = None,
    test_size: int | None = None,
    root: str | Path | None = None,
) -> TaskData:
    """The dataset at the model's context length; ``train_size`` / ``test_size``
    windows (default ``DEFAULT_TRAIN`` / ``DEFAULT_TEST``), evenly spaced."""
    length = check(sig, name)
    corpus = read_corpus(str(root or stdlib_root()))
    train = windows(corpus.train, length, train_size or DEFAULT_TRAIN)
    test = windows(corpus.test, length, test_size or DEFAULT_TEST)
    total_train = window_starts(len(corpus.train), length, None).numel()
    total_test = window_starts(len(corpus.test), length, None).numel()
    description = (
        f"Python {platform.python_version()} standard library .py sources (real, "
        f"the interpreter's stdlib folder, tests and site-packages left out; sha256 "
        f"{corpus.sha256[:12]}), "
        f"split by file: {corpus.train_files} files / {len(corpus.train):,} characters train, "
        f"{corpus.test_files} files / {len(corpus.test):,} validation; {VOCAB_SIZE} ids "
        f"(ASCII, {OTHER} = other); windows of {length}: {len(train):,} of {total_train:,} "
        f"train, {len(test):,} of {total_test:,} validation ({len(test) * length:,} "
        "characters scored), evenly spaced"
    )
    return TaskData(
        name=name, task=TASK, synthetic=False, description=description, train=train, test=test
    )
