"""Hugging Face's RMSNorm, as one ``rmsnorm`` statement, and its float64 twin for ``verify``.

Llama, Mistral, Qwen2 and over a hundred other ``transformers`` models define their own
RMSNorm class, each a word-for-word copy of ``LlamaRMSNorm`` ("Copied from" in their
sources): ``x`` cast to float32, ``x * rsqrt(mean(x**2) + eps)``, cast back to ``x``'s dtype,
times ``weight``. Traced, that is pow, mean, add, rsqrt and mul, which no registry operator
computes one by one; as a module it is ``torch.nn.RMSNorm`` (torch computes half-precision
inputs in float32 too). A class is recognised by its source, not by its name: its
``forward`` and ``__init__`` are Llama's, statement for statement (with its own class name;
comments and docstrings, which copies reword, aside), so a
class that only looks alike (Gemma's ``1 + weight``, Olmo's) is never taken for it. Gemma's
(``1 + weight``) and T5's ``T5LayerNorm`` (the same arithmetic as Llama's, written in its own
words) are recognised the same way, each against its own source.

In float64, the only precision ``verify`` judges at 1e-10, the original's cast to float32
rounds where the generated code (float64 throughout) does not. ``float64_twin`` gives what
the module computes without that cast, ``torch.nn.RMSNorm`` holding the same weight
parameter, and ``verify`` compares the step against the original with its RMSNorms so
replaced, saying so in its notes; the float32 agreement of the two is tested on its own
(tests/importer/test_import_llama.py).
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import textwrap

import torch

LLAMA_RMSNORM = "transformers.models.llama.modeling_llama.LlamaRMSNorm"


def _source(fn) -> str | None:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return None


def _code(source: str | None, own: str, name: str) -> str | None:
    """What a method's source computes, as text: its syntax tree without comments and
    docstrings, ``own`` (the class's name) read as ``name``. A "Copied from" class whose
    comments name itself (Gemma2's "whilst Gemma2 is", mT5's "MT5 uses") is still the copy."""
    if source is None:
        return None
    try:
        tree = ast.parse(textwrap.dedent(source.replace(own, name)))
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def _copy_of(cls: type, module: str, name: str, parts: tuple[str, ...]) -> bool:
    """Whether ``cls`` is a ``transformers`` class whose methods ``parts`` are those of the
    class ``name`` in ``transformers.models.MODULE``, statement for statement (its own name
    in place of that class's; comments and docstrings aside): how "Copied from" classes are
    recognised, never by their names."""
    if not cls.__module__.startswith("transformers."):
        return False
    try:
        reference = getattr(importlib.import_module(f"transformers.models.{module}"), name)
    except (ImportError, AttributeError):
        return False
    if cls is reference:
        return True
    mine = [_code(_source(getattr(cls, part, None)), cls.__name__, name) for part in parts]
    theirs = [_code(_source(getattr(reference, part, None)), name, name) for part in parts]
    if None in mine or None in theirs:
        return False
    return mine == theirs


@functools.cache
def is_llama_rmsnorm(cls: type) -> bool:
    """``LlamaRMSNorm``'s ``forward`` and ``__init__`` word for word."""
    return _copy_of(cls, "llama.modeling_llama", "LlamaRMSNorm", ("forward", "__init__"))


@functools.cache
def is_gemma_rmsnorm(cls: type) -> bool:
    """``GemmaRMSNorm``'s ``forward``, ``_norm`` and ``__init__`` word for word: the norm
    times ``1 + weight``, in float32 inside (Gemma 1 and its copies)."""
    parts = ("forward", "_norm", "__init__")
    return _copy_of(cls, "gemma.modeling_gemma", "GemmaRMSNorm", parts)


@functools.cache
def is_t5_layernorm(cls: type) -> bool:
    """``T5LayerNorm``'s ``forward`` and ``__init__`` word for word: x * rsqrt(mean(x**2) +
    eps) with the mean in float32, times ``weight`` (T5, mT5, LongT5, Pix2Struct, ...)."""
    return _copy_of(cls, "t5.modeling_t5", "T5LayerNorm", ("forward", "__init__"))


def _plain_rmsnorm(cls: type) -> bool:
    """Llama's or T5's: the norm times ``weight``, ``variance_epsilon`` its eps."""
    return is_llama_rmsnorm(cls) or is_t5_layernorm(cls)


def is_hf_rmsnorm(cls: type) -> bool:
    """A Hugging Face RMSNorm this module maps: Llama's, Gemma's or T5's."""
    return _plain_rmsnorm(cls) or is_gemma_rmsnorm(cls)


def rmsnorm_kwargs(module: torch.nn.Module) -> dict:
    """The ``rmsnorm`` statement's arguments for a Llama- or Gemma-style RMSNorm module."""
    shape = tuple(int(d) for d in module.weight.shape)
    gemma = is_gemma_rmsnorm(type(module))
    found = {
        "normalized_shape": shape[0] if len(shape) == 1 else shape,
        "eps": float(module.eps if gemma else module.variance_epsilon),
        "elementwise_affine": True,
    }
    if gemma:
        found["weight_offset"] = 1.0
    return found


class OffsetRMSNorm(torch.nn.Module):
    """Gemma's RMSNorm in the input's dtype: x * rsqrt(mean(x**2) + eps) * (1 + weight)."""

    def __init__(self, weight: torch.nn.Parameter, eps: float):
        super().__init__()
        self.weight = weight
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return norm * (1.0 + self.weight)


def float64_twin(module: torch.nn.Module) -> torch.nn.Module | None:
    """``torch.nn.RMSNorm`` computing what a Llama-style RMSNorm computes, in the input's
    dtype, sharing its weight parameter (the state dict keeps its keys); None for any
    other module."""
    if is_gemma_rmsnorm(type(module)):
        return OffsetRMSNorm(module.weight, float(module.eps))
    if not _plain_rmsnorm(type(module)):
        return None
    twin = torch.nn.RMSNorm(tuple(module.weight.shape), eps=float(module.variance_epsilon))
    twin.weight = module.weight
    return twin


def swap_float64_twins(root: torch.nn.Module) -> list[str]:
    """Replace every Llama-style RMSNorm under ``root`` by its ``float64_twin``, in place;
    the paths replaced."""
    swapped = []
    for path, module in list(root.named_modules()):
        twin = float64_twin(module) if path else None
        if twin is None:
            continue
        parent_path, _, leaf = path.rpartition(".")
        parent = root.get_submodule(parent_path) if parent_path else root
        setattr(parent, leaf, twin)
        swapped.append(path)
    return swapped
