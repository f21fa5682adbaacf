"""Hugging Face's RMSNorm, as one ``rmsnorm`` statement, and its float64 twin for ``verify``.

Llama, Mistral, Qwen2 and over a hundred other ``transformers`` models define their own
RMSNorm class, each a word-for-word copy of ``LlamaRMSNorm`` ("Copied from" in their
sources): ``x`` cast to float32, ``x * rsqrt(mean(x**2) + eps)``, cast back to ``x``'s dtype,
times ``weight``. Traced, that is pow, mean, add, rsqrt and mul, which no registry operator
computes one by one; as a module it is ``torch.nn.RMSNorm`` (torch computes half-precision
inputs in float32 too). A class is recognised by its source, not by its name: its
``forward`` and ``__init__`` are Llama's, statement for statement (with its own class name;
comments and docstrings, which copies reword, aside), so a
class that only looks alike (Gemma's ``1 + weight``, OLMo 2's) is never taken for it. Gemma's
(``1 + weight``), T5's ``T5LayerNorm`` and OLMo 2's ``Olmo2RMSNorm`` (the same arithmetic as
Llama's, written in their own words) are recognised the same way, each against its own
source.

In float64, the only precision ``verify`` judges at 1e-10, the original's cast to float32
rounds where the generated code (float64 throughout) does not. ``float64_twin`` gives what
the module computes without that cast, ``torch.nn.RMSNorm`` holding the same weight
parameter, and ``verify`` compares the step against the original with its RMSNorms so
replaced, saying so in its notes; the float32 agreement of the two is tested on its own
(tests/importer/test_import_llama.py).

OLMo's ``OlmoLayerNorm`` (``F.layer_norm`` of the input cast to float32, no weight) is the
same case for a module the importer maps op by op, as ``layernorm``: the importer traces in
float32, where its ``.to(torch.float32)`` and the ``.to(orig_dtype)`` after it are one and
the same no-op node, so no text can keep the cast; and keeping it as a rounding of the
norm's input and output would still not be the original's float32 arithmetic, forward and
backward (about 1e-7 apart). Its twin is ``torch.nn.LayerNorm`` without weight or bias,
bit for bit the same in float32 (tests/importer/test_import_olmo.py).
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


@functools.cache
def is_olmo2_rmsnorm(cls: type) -> bool:
    """``Olmo2RMSNorm``'s ``forward`` and ``__init__`` word for word (OLMo 2, OLMo 3,
    FlexOlmo, ...): Llama's arithmetic with the weight multiplied before the cast back, which
    changes nothing in float32 or float64 (a float32 norm times a float64 weight is float64
    either way); in half precision it is ``torch.nn.RMSNorm``'s rounding."""
    return _copy_of(cls, "olmo2.modeling_olmo2", "Olmo2RMSNorm", ("forward", "__init__"))


@functools.cache
def is_olmo_layernorm(cls: type) -> bool:
    """``OlmoLayerNorm``'s ``forward`` and ``__init__`` word for word: ``F.layer_norm``
    without weight or bias, eps ``OLMO_LAYERNORM_EPS``, of the input cast to float32. The
    importer maps it op by op (``layernorm``); only verify's twin needs to know it."""
    return _copy_of(cls, "olmo.modeling_olmo", "OlmoLayerNorm", ("forward", "__init__"))


#: the eps OlmoLayerNorm's forward writes (a literal of the source is_olmo_layernorm matches)
OLMO_LAYERNORM_EPS = 1e-5


def _plain_rmsnorm(cls: type) -> bool:
    """Llama's, T5's or OLMo 2's: the norm times ``weight``, ``variance_epsilon`` its eps."""
    return is_llama_rmsnorm(cls) or is_t5_layernorm(cls) or is_olmo2_rmsnorm(cls)


def is_hf_rmsnorm(cls: type) -> bool:
    """A Hugging Face RMSNorm this module maps: Llama's, Gemma's, T5's or OLMo 2's."""
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
    dtype, sharing its weight parameter (the state dict keeps its keys); for OLMo's
    LayerNorm, ``torch.nn.LayerNorm`` without weight or bias; None for any other module."""
    if is_olmo_layernorm(type(module)):
        shape = tuple(module.normalized_shape)
        return torch.nn.LayerNorm(
            shape, eps=OLMO_LAYERNORM_EPS, elementwise_affine=False, bias=False
        )
    if is_gemma_rmsnorm(type(module)):
        return OffsetRMSNorm(module.weight, float(module.eps))
    if not _plain_rmsnorm(type(module)):
        return None
    twin = torch.nn.RMSNorm(tuple(module.weight.shape), eps=float(module.variance_epsilon))
    twin.weight = module.weight
    return twin


def twins_note(root: torch.nn.Module, swapped: list[str]) -> str:
    """verify's note on the modules ``swap_float64_twins`` replaced under ``root`` (their
    paths ``swapped``): which norms, compared as what, and why, so a reader of the report
    knows the original was not stepped word for word."""
    shown = ", ".join(swapped[:3]) + (f" and {len(swapped) - 3} more" if len(swapped) > 3 else "")
    layer = [p for p in swapped if isinstance(root.get_submodule(p), torch.nn.LayerNorm)]
    if not layer:
        return (
            f"{shown}: Hugging Face RMSNorm, which casts its input to float32 inside; compared "
            "as torch.nn.RMSNorm with the same weight (what it computes in float32 and "
            "half precision), since in float64 its cast rounds where the generated code does not"
        )
    if len(layer) == len(swapped):
        kinds, twins = "OLMo's LayerNorm", "torch.nn.LayerNorm"
    else:
        kinds = "Hugging Face RMSNorm and OLMo's LayerNorm"
        twins = "torch.nn.RMSNorm and torch.nn.LayerNorm"
    return (
        f"{shown}: {kinds}, which casts its input to float32 inside; compared as {twins} "
        "(what it computes in float32), since in float64 its cast rounds where the generated "
        "code does not"
    )


def swap_float64_twins(root: torch.nn.Module) -> list[str]:
    """Replace every module under ``root`` that has a ``float64_twin`` (the RMSNorms above,
    OLMo's LayerNorm) by it, in place; the paths replaced."""
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
