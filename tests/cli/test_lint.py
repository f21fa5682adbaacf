"""unroller.lint: the IPU supported-operations check of generated modules and their kernels.

Fixtures are small modules written to tmp dirs; a temporary directory stands in for the
``unroller`` package through ``package_roots``, so these tests do not depend on
``unroller/runtime/ipu.py``.
"""

from __future__ import annotations

import ast
import functools
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import unroller
from unroller.lint import LintReport, lint_module, lint_paths, supported_ops
from unroller.lint import supported as lint_supported

ROOT = Path(__file__).resolve().parents[2]
COMPRESS = ROOT / "unroller" / "compress"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def fake_package(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    """A stand-in `unroller` package under tmp_path/pkg; returns the package_roots."""
    pkg = tmp_path / "pkg"
    write(pkg / "__init__.py", "")
    for rel, text in files.items():
        path = pkg / rel
        for parent in path.relative_to(pkg).parents:
            init = pkg / parent / "__init__.py"
            if not init.exists():
                write(init, "")
        write(path, text)
    return {"unroller": pkg}


def lint_source(tmp_path: Path, text: str, name: str = "model.py", **kwargs) -> LintReport:
    return lint_module(write(tmp_path / "gen" / name, text), **kwargs)


def found(report: LintReport, severity: str = "error") -> list[tuple]:
    return [
        (c.file.name, c.line, c.col, c.name, c.detail)
        for c in sorted(report.calls, key=lambda c: (str(c.file), c.line, c.col))
        if c.severity == severity
    ]


# ---------------------------------------------------------------- the supported list


def _torch_has(name: str) -> bool:
    try:
        functools.reduce(getattr, name.split("."), torch)
    except AttributeError:
        return False
    return True


def test_every_listed_name_exists_in_torch():
    ops = supported_ops("ipu")
    missing = [n for n in ops.names["torch"] if not _torch_has(n)]
    missing += [f"F.{n}" for n in ops.names["functional"] if not hasattr(F, n)]
    missing += [f"Tensor.{n}" for n in ops.names["tensor"] if not hasattr(torch.Tensor, n)]
    missing += [f"nn.{n}" for n in ops.names["module"] if not hasattr(torch.nn, n)]
    assert missing == []


def test_nn_modules_map_to_listed_functionals_and_restrictions_name_listed_calls():
    ops = supported_ops("ipu")
    table = lint_supported.tomllib.loads((ROOT / "unroller" / "ipu_supported.toml").read_text())
    for module, fn in table["nn"].items():
        assert module in ops.listed["module"]
        assert fn == "" or fn in ops.listed["functional"], (module, fn)
    kinds = {"torch.nn.functional.": "functional", "Tensor.": "tensor", "torch.nn.": "module"}
    for canonical in ops.restrictions:
        kind, name = next(
            ((k, canonical[len(p) :]) for p, k in kinds.items() if canonical.startswith(p)),
            ("torch", canonical[len("torch.") :]),
        )
        assert ops.lookup(kind, name)[0], canonical


@pytest.mark.parametrize(
    "kind, name, allowed",
    [
        ("torch", "cos", True),
        ("torch", "linalg.vector_norm", True),
        ("torch", "erf", False),
        ("torch", "empty", False),
        ("torch", "tensor", False),
        ("torch", "rand_like", False),
        ("torch", "relu_", True),  # in-place form of a listed op
        ("functional", "interpolate", True),
        ("functional", "upsample_bilinear", False),
        ("functional", "max_pool2d_with_indices", False),
        ("functional", "gelu", True),
        ("tensor", "new_zeros", True),
        ("tensor", "new_ones", True),
        ("tensor", "new_full", False),
        ("tensor", "new_empty", False),
        ("tensor", "fill_", True),
        ("tensor", "index_fill_", True),
        ("tensor", "uniform_", True),
        ("tensor", "clamp_", True),
        ("tensor", "copy_", False),
        ("tensor", "item", False),
        ("tensor", "view", True),  # extra: a view
        ("tensor", "view_", False),  # in-place forms come from listed names only
        ("module", "ConvTranspose2d", True),
        ("module", "UpsamplingBilinear2d", False),
        ("module", "Module", True),  # extra: a container
    ],
)
def test_lookup(kind, name, allowed):
    assert supported_ops("ipu").lookup(kind, name)[0] is allowed


def test_unknown_platform():
    with pytest.raises(ValueError, match="no list of supported operations for platform 'gpu'"):
        lint_paths([], platform="gpu")


# ---------------------------------------------------------------- allowed calls


ALLOWED = """\
import math

import torch
import torch.nn.functional as F


class Box:
    def view(self):
        return self

    def go(self, x, w, s: str, p):
        y = F.conv2d(x, w).clamp_(min=0)
        y = torch.cat([y, y], 1).view(-1).reshape(2, -1).float()
        z = F.interpolate(x, scale_factor=2, mode="nearest")
        z = F.interpolate(x, None, 2, "bicubic")
        z = F.max_pool2d(x, 2, return_indices=False) + F.max_pool2d(x, 2)
        z = F.conv_transpose2d(x, w, dilation=1) + F.conv_transpose2d(x, w, dilation=(1, 1))
        z = F.conv_transpose2d(x, w, None, 1, 0, 0, 1, (1, 1))
        v, i = x.topk(3) + torch.topk(x, 3, sorted=True)
        n = x.new_zeros(()).expand(2, 3) + x.new_ones(())
        with torch.no_grad():
            q = torch.where(x > 0, x, torch.zeros_like(x)).sum(dim=-1)
        parts = p.split(",")
        words = "a,b".split(",") + s.split(",") + [3, 1].index(1)
        m = torch.nn.Conv2d(3, 4, 3)
        b = torch.nn.BatchNorm2d(4)
        return self.view(), math.prod([2, 3]), super().view(), parts, words, m, b, y, z, v, n, q
"""


def test_allowed_calls_pass(tmp_path):
    report = lint_source(tmp_path, ALLOWED)
    assert report.ok, report.format()
    assert report.warnings == []
    names = [c.name for c in report.calls]
    assert "Tensor.clamp_" in names and "torch.nn.Conv2d" in names and "Tensor.split" in names
    # self.view(), math.prod, super().view(), str literals and `s: str` are not tensor calls
    assert names.count("Tensor.view") == 1
    assert names.count("Tensor.split") == 1  # p.split: receiver unknown, allowed anyway
    assert names.count("Tensor.index") == 0
    split = next(c for c in report.calls if c.name == "Tensor.split")
    assert "receiver not known" in split.reason
    assert report.files == [(tmp_path / "gen" / "model.py").resolve()]
    assert report.summary() == f"{len(report.calls)} torch calls in 1 files, 0 not supported"


# ---------------------------------------------------------------- forbidden calls

FORBIDDEN = """\
import torch
import torch.nn.functional as F
from torch.ops import aten

_aten = torch.ops.aten


def forward(x, w, name):
    a = torch.ops.aten.gelu(x)
    b = _aten.convolution(x, w)
    c = F.interpolate(x, scale_factor=2, mode="bilinear")
    d = F.max_pool2d_with_indices(x, 2)
    e = F.max_pool2d(x, 2, return_indices=True)
    f = torch.erf(x) + x.erf()
    g = getattr(torch, name)(x)
    h = F.conv_transpose2d(x, w, dilation=2)
    return a, b, c, d, e, f, g, h
"""


def test_each_forbidden_form_is_reported_at_its_place(tmp_path):
    report = lint_source(tmp_path, FORBIDDEN)
    assert found(report) == [
        ("model.py", 3, 1, "torch.ops.aten", ""),
        ("model.py", 5, 19, "torch.ops.aten", ""),
        ("model.py", 9, 24, "torch.ops.aten.gelu", ""),
        ("model.py", 10, 15, "torch.ops.aten.convolution", ""),
        ("model.py", 11, 11, "torch.nn.functional.interpolate", "mode='bilinear'"),
        ("model.py", 12, 11, "torch.nn.functional.max_pool2d_with_indices", ""),
        ("model.py", 13, 11, "torch.nn.functional.max_pool2d", "return_indices=True"),
        ("model.py", 14, 15, "torch.erf", ""),
        ("model.py", 14, 26, "Tensor.erf", ""),
        ("model.py", 15, 9, "getattr(torch, name)", ""),
        ("model.py", 16, 11, "torch.nn.functional.conv_transpose2d", "dilation=2"),
    ]
    kinds = {c.line: c.kind for c in report.errors}
    assert kinds[9] == kinds[10] == "aten"
    assert kinds[15] == "dynamic"
    assert not report.ok
    text = report.format(relative_to=tmp_path)
    lines = text.splitlines()
    assert (
        "gen/model.py:11:11: error: torch.nn.functional.interpolate(mode='bilinear') is not "
        "supported on the IPU (Upsample: nearest and bicubic modes only, no bilinear)"
    ) in lines
    assert (
        "gen/model.py:12:11: error: torch.nn.functional.max_pool2d_with_indices() is not "
        "supported on the IPU (not in the PopTorch (Graphcore SDK 3.x) list of supported "
        "operations)"
    ) in lines
    assert "gen/model.py:5:19: error: torch.ops.aten is not supported on the IPU" in text
    assert lines[-1] == f"{len(report.torch_calls)} torch calls in 1 files, 11 not supported"


ALIASES = """\
import torch as T
from torch import nn
from torch.nn import functional as G
from torch.nn.functional import interpolate as up
from torch import erf

F2 = T.nn.functional
aten2 = T.ops.aten


def f(x):
    return (
        T.erf(x),
        nn.functional.interpolate(x, mode="bilinear"),
        G.max_pool2d_with_indices(x, 2),
        up(x, scale_factor=2, mode="bilinear"),
        erf(x),
        F2.conv_transpose2d(x, x, None, 1, 0, 0, 1, 2),
        aten2.mul(x, x),
        getattr(T, "erf")(x),
        getattr(G, "interpolate")(x),
        T.Tensor.topk(x, 3, 0, True, False),
    )
"""


def test_import_aliases_are_resolved(tmp_path):
    report = lint_source(tmp_path, ALIASES)
    assert found(report) == [
        ("model.py", 8, 15, "torch.ops.aten", ""),
        ("model.py", 13, 11, "torch.erf", ""),
        ("model.py", 14, 23, "torch.nn.functional.interpolate", "mode='bilinear'"),
        ("model.py", 15, 11, "torch.nn.functional.max_pool2d_with_indices", ""),
        ("model.py", 16, 9, "torch.nn.functional.interpolate", "mode='bilinear'"),
        ("model.py", 17, 9, "torch.erf", ""),
        ("model.py", 18, 12, "torch.nn.functional.conv_transpose2d", "dilation=2"),
        ("model.py", 19, 15, "torch.ops.aten.mul", ""),
        ("model.py", 20, 9, "torch.erf", ""),
        ("model.py", 22, 18, "Tensor.topk", "sorted=False"),
    ]
    ok = [c.name for c in report.calls if c.severity == "ok"]
    assert ok == ["torch.nn.functional.interpolate"]  # getattr with a literal: checked


MODULES = """\
import torch
from torch import nn

layers = [
    nn.ConvTranspose2d(4, 4, 3, dilation=2),
    nn.ConvTranspose2d(4, 4, 3, 1, 0, 0, 1, True, (2, 2)),
    nn.ConvTranspose2d(4, 4, 3, dilation=(1, 1)),
    nn.MaxPool2d(2, return_indices=True),
    nn.MaxPool2d(2),
    nn.Upsample(scale_factor=2, mode="bilinear"),
    nn.Upsample(scale_factor=2),
    nn.UpsamplingBilinear2d(scale_factor=2),
    nn.InstanceNorm2d(4),
    nn.InstanceNorm2d(4, affine=True),
    nn.EmbeddingBag(10, 3, padding_idx=0),
    nn.LSTM(4, 4),
    torch.nn.Module(),
]


class Fn(torch.autograd.Function):
    pass
"""


def test_module_constructors_and_autograd_function(tmp_path):
    report = lint_source(tmp_path, MODULES)
    assert found(report) == [
        ("model.py", 5, 8, "torch.nn.ConvTranspose2d", "dilation=2"),
        ("model.py", 6, 8, "torch.nn.ConvTranspose2d", "dilation=(2, 2)"),
        ("model.py", 8, 8, "torch.nn.MaxPool2d", "return_indices=True"),
        ("model.py", 10, 8, "torch.nn.Upsample", "mode='bilinear'"),
        ("model.py", 12, 8, "torch.nn.UpsamplingBilinear2d", ""),
        ("model.py", 13, 8, "torch.nn.InstanceNorm2d", "affine=False (default)"),
        ("model.py", 15, 8, "torch.nn.EmbeddingBag", "padding_idx=0"),
        ("model.py", 21, 10, "subclass of torch.autograd.Function", ""),
    ]
    assert found(report, "warning") == [("model.py", 16, 8, "torch.nn.LSTM", "")]


def test_restriction_values_the_linter_cannot_see_are_warnings(tmp_path):
    report = lint_source(
        tmp_path,
        """\
        import torch.nn.functional as F


        def f(x, mode, kw, args, d, lst):
            return (
                F.interpolate(x, mode=mode),
                F.interpolate(x, **kw),
                F.max_pool2d(x, *args),
                d.values(),
                lst.index(1),
            )
        """,
    )
    assert report.ok
    assert found(report, "warning") == [
        ("model.py", 6, 11, "torch.nn.functional.interpolate", "mode=mode"),
        ("model.py", 7, 11, "torch.nn.functional.interpolate", "mode=?"),
        ("model.py", 8, 11, "torch.nn.functional.max_pool2d", "return_indices=?"),
        ("model.py", 9, 11, "Tensor.values", ""),
        ("model.py", 10, 13, "Tensor.index", ""),
    ]
    assert "unknown receiver" in report.warnings[3].reason
    assert "1 to check by hand" not in report.summary()
    assert report.summary().endswith(", 0 not supported, 5 to check by hand")


def test_columns_count_characters_and_nothing_is_imported_or_run(tmp_path):
    report = lint_source(
        tmp_path,
        """\
        import does_not_exist_anywhere
        import torch

        raise SystemExit("the linter must not run this")
        s = "héé"; y = torch.erf(s)
        """,
    )
    assert found(report) == [("model.py", 5, 22, "torch.erf", "")]


def test_star_import_from_torch_is_an_error(tmp_path):
    report = lint_source(tmp_path, "from torch.nn.functional import *\n\ny = gelu(x)\n")
    assert found(report) == [("model.py", 1, 1, "from torch.nn.functional import *", "")]
    assert report.errors[0].kind == "dynamic"


def test_syntax_error_is_reported(tmp_path):
    report = lint_source(tmp_path, "def f(:\n    pass\n")
    assert [(c.kind, c.line) for c in report.errors] == [("syntax", 1)]
    assert ": error: syntax error: " in report.format()


# ---------------------------------------------------------------- following imports

KERNELS = {
    "runtime/ipu.py": """\
        import torch
        import torch.nn.functional as F

        from . import helpers
        from .helpers import pool
        from unroller.compress import codec


        def conv2d(x, w):
            return F.conv2d(x, w)


        def gelu(x):
            return torch.erf(x)
        """,
    "runtime/helpers.py": """\
        import torch.nn.functional as F


        def pool(x):
            return F.max_pool2d_with_indices(x, 2)
        """,
    "compress/__init__.py": """\
        from .codec import Codec
        """,
    "compress/codec.py": """\
        import torch


        class Codec:
            def compress(self, t):
                return (torch.round(t * 127).to(torch.int8), torch.rand_like(t))
        """,
}

GENERATED = """\
import torch

import unroller.runtime.ipu as K
from unroller import compress as C

CODEC = C.Codec()


def step(x, w):
    y = K.conv2d(x, w)
    packed = CODEC.compress(y)
    return K.gelu(y), torch.ones_like(y), packed
"""


def test_imported_kernel_modules_are_followed(tmp_path):
    roots = fake_package(tmp_path, KERNELS)
    report = lint_source(tmp_path, GENERATED, package_roots=roots)
    pkg = roots["unroller"].resolve()
    assert report.files == [
        (tmp_path / "gen" / "model.py").resolve(),
        pkg / "runtime" / "ipu.py",
        pkg / "compress" / "__init__.py",
        pkg / "runtime" / "helpers.py",
        pkg / "compress" / "codec.py",
    ]
    assert found(report) == [
        ("codec.py", 6, 60, "torch.rand_like", ""),
        ("helpers.py", 5, 14, "torch.nn.functional.max_pool2d_with_indices", ""),
        ("ipu.py", 14, 18, "torch.erf", ""),
    ]
    errors = {c.name: c.file for c in report.errors}
    assert errors["torch.erf"] == pkg / "runtime" / "ipu.py"
    ok = {c.name for c in report.calls if c.allowed}
    assert ok == {"torch.ones_like", "torch.nn.functional.conv2d", "torch.round", "Tensor.to"}


def test_missing_package_module_is_an_error(tmp_path):
    roots = fake_package(tmp_path, {"runtime/other.py": ""})
    report = lint_source(
        tmp_path, "import torch\nimport unroller.runtime.ipu as K\n", package_roots=roots
    )
    assert [(c.kind, c.name, c.line, c.col) for c in report.errors] == [
        ("import", "unroller.runtime.ipu", 2, 1)
    ]
    assert report.format(relative_to=tmp_path).splitlines()[0] == (
        "gen/model.py:2:1: error: cannot find module unroller.runtime.ipu under the package "
        "roots: its torch calls cannot be checked"
    )


def test_lint_paths_scans_a_shared_kernel_module_once(tmp_path):
    roots = fake_package(tmp_path, KERNELS)
    write(tmp_path / "gen" / "a.py", GENERATED)
    write(tmp_path / "gen" / "sub" / "b.py", GENERATED)
    report = lint_paths([tmp_path / "gen"], package_roots=roots)
    names = [f.name for f in report.files]
    assert names == ["a.py", "b.py", "ipu.py", "__init__.py", "helpers.py", "codec.py"]
    assert [c.name for c in report.errors].count("torch.erf") == 1
    with pytest.raises(FileNotFoundError):
        lint_paths([tmp_path / "nope.py"])


def test_default_roots_follow_the_installed_unroller_package(tmp_path):
    report = lint_source(
        tmp_path, "import unroller.runtime.gpu as K\nfrom unroller import compress as C\n"
    )
    pkg = Path(unroller.__file__).resolve().parent
    assert pkg / "runtime" / "gpu.py" in report.files
    assert pkg / "compress" / "dct.py" in report.files
    assert any(c.kind == "aten" and c.file.name == "gpu.py" for c in report.errors)


GPU_HELPERS = {
    "runtime/gpu.py": """\
        import torch

        _aten = torch.ops.aten


        def conv2d(x, w):
            return _aten.convolution(x, w)


        def _copy(grad):
            return grad.clone()


        def accumulate(param, grad):
            param.grad = _copy(grad)


        def tensors(root):  # unroller-lint: host-only
            return _host_helper(root)


        def _host_helper(root):
            return torch.empty(3)


        def relu(x):
            return _aten.relu(x)
        """,
    "runtime/ipu.py": """\
        import torch

        from unroller.runtime.gpu import accumulate, tensors


        def add(a, b):
            return torch.add(a, b)
        """,
}


def test_names_imported_from_a_module_check_only_what_they_use(tmp_path):
    roots = fake_package(tmp_path, GPU_HELPERS)
    report = lint_source(tmp_path, "import unroller.runtime.ipu as K\n", package_roots=roots)
    gpu = roots["unroller"].resolve() / "runtime" / "gpu.py"
    assert report.ok, report.format()
    # accumulate -> _copy (clone) is checked; conv2d, relu and `_aten = torch.ops.aten` are not
    # used; _host_helper is used only by the host-only `tensors`
    assert [(c.file.name, c.line, c.name) for c in report.calls] == [
        ("ipu.py", 7, "torch.add"),
        ("gpu.py", 11, "Tensor.clone"),
    ]
    assert [h.name for h in report.host_only] == ["tensors"]
    assert report.partial == {gpu: ("accumulate", "tensors")}
    assert (
        "pkg/runtime/gpu.py: note: imported by name: only accumulate, tensors and what they "
        "use were checked"
    ) in report.format(relative_to=tmp_path).splitlines()


def test_a_module_imported_whole_anywhere_is_checked_whole(tmp_path):
    roots = fake_package(tmp_path, GPU_HELPERS)
    write(tmp_path / "gen" / "a.py", "import unroller.runtime.ipu as K\n")
    write(tmp_path / "gen" / "b.py", "import unroller.runtime.gpu as G\n")
    report = lint_paths([tmp_path / "gen"], package_roots=roots)
    assert report.partial == {}
    assert [(c.file.name, c.line, c.name) for c in report.errors] == [
        ("gpu.py", 3, "torch.ops.aten"),
        ("gpu.py", 7, "torch.ops.aten.convolution"),
        ("gpu.py", 23, "torch.empty"),  # _host_helper: a plain function of a whole module
        ("gpu.py", 27, "torch.ops.aten.relu"),
    ]


def test_an_imported_name_pulls_in_the_definitions_it_uses(tmp_path):
    roots = fake_package(tmp_path, GPU_HELPERS)
    report = lint_source(tmp_path, "from unroller.runtime.gpu import relu\n", package_roots=roots)
    assert [(c.line, c.name) for c in report.errors] == [
        (3, "torch.ops.aten"),
        (27, "torch.ops.aten.relu"),
    ]
    # a name the module does not bind at the top level: all of the module is checked
    report = lint_source(
        tmp_path, "from unroller.runtime.gpu import nothing_here\n", package_roots=roots
    )
    assert report.partial == {} and len(report.errors) == 4


STAR_KERNELS = {
    # a family module with a literal __all__: only the names it lists are exported
    "runtime/listed.py": """\
        import torch

        __all__ = ["relu"]


        def relu(x):
            return _inner(x)


        def _inner(x):
            return torch.erf(x)


        def unlisted(x):
            return torch.special.erfinv(x)
        """,
    # no __all__: every public name it binds, none of the private ones
    "runtime/family.py": """\
        import torch


        def lstm(x):
            return torch.logit(x)


        def unsupported(x):
            return torch.nonzero(x)


        def gpu_only(x):
            return torch.empty_like(x)


        def _private(x):
            return torch.flip(x, (0,))
        """,
    # gathers the families; its __all__ is computed, so its public names count
    "runtime/shared.py": """\
        from unroller.runtime.family import *  # noqa: F403
        from unroller.runtime.listed import *  # noqa: F403

        __all__ = sorted(name for name in dir() if not name.startswith("_"))
        """,
    # takes them by a relative star import, then replaces one with its own
    "runtime/ipu.py": """\
        import torch

        from .shared import *  # noqa: F403


        def unsupported(x):
            return torch.add(x, x)
        """,
}


def test_star_imports_follow_each_exported_name_to_its_definition(tmp_path):
    """``from X import *`` of a followed module binds X's literal ``__all__``, else its public
    top-level names (with what its own star imports bind): each is followed as an imported
    name is, through chains of star imports; a private or unlisted name is not, nor a name
    the importing module defines again after the star import."""
    roots = fake_package(tmp_path, STAR_KERNELS)
    report = lint_source(tmp_path, "import unroller.runtime.ipu as K\n", package_roots=roots)
    pkg = roots["unroller"].resolve() / "runtime"
    assert [(c.file.name, c.line, c.name) for c in report.errors] == [
        ("family.py", 5, "torch.logit"),
        ("family.py", 13, "torch.empty_like"),  # exported: a computed __all__ is not read
        ("listed.py", 11, "torch.erf"),
    ]
    erf = next(c for c in report.errors if c.name == "torch.erf")
    assert [(h.file.name, h.name) for h in erf.chain] == [
        ("model.py", "import unroller.runtime.ipu as K"),
        ("ipu.py", "from unroller.runtime.shared import *"),
        ("shared.py", "from unroller.runtime.listed import *"),
        ("listed.py", "_inner"),
    ]
    assert report.partial[pkg / "listed.py"] == ("relu",)
    assert report.partial[pkg / "family.py"] == ("gpu_only", "lstm", "torch")
    assert "unsupported" not in report.partial[pkg / "shared.py"]


def test_a_name_bound_by_a_star_import_is_followed_alone(tmp_path):
    """A name imported from a module that binds it by a star import: only its definition
    counts, not the module whole nor the other names of the star import."""
    roots = fake_package(tmp_path, STAR_KERNELS)
    report = lint_source(tmp_path, "from unroller.runtime.ipu import lstm\n", package_roots=roots)
    pkg = roots["unroller"].resolve() / "runtime"
    assert [(c.file.name, c.name) for c in report.errors] == [("family.py", "torch.logit")]
    assert report.partial[pkg / "ipu.py"] == ("lstm",)
    assert report.partial[pkg / "family.py"] == ("lstm",)


def test_a_star_import_whose_names_cannot_be_known_counts_whole(tmp_path):
    """A module that star-imports one lint does not follow (its names are unknown): a star
    import of it makes all of it count, as before names were followed."""
    roots = fake_package(
        tmp_path,
        {
            "runtime/opaque.py": """\
                from math import *  # noqa: F403


                def _private(x):
                    return x.erf()
                """,
            "runtime/ipu.py": "from unroller.runtime.opaque import *  # noqa: F403\n",
        },
    )
    report = lint_source(tmp_path, "import unroller.runtime.ipu as K\n", package_roots=roots)
    assert [(c.file.name, c.name) for c in report.errors] == [("opaque.py", "Tensor.erf")]
    assert report.partial == {}


# ---------------------------------------------------------------- host-only functions


def test_host_only_functions_are_excluded_and_listed(tmp_path):
    roots = fake_package(
        tmp_path,
        {"runtime/ipu.py": """\
            import torch


            def accumulate(param, grad):  # unroller-lint: host-only
                param.grad = torch.empty_like(param).copy_(grad)


            def stash(log,
                      t):  # unroller-lint: host-only (bookkeeping)
                log.append(torch.empty(()).element_size())


            class Book:
                def tensors(self, root):
                    \"\"\"State-dict name -> tensor. unroller-lint: host-only\"\"\"
                    return torch.tensor([1])

                def kernel(self, x):
                    # unroller-lint: host-only  (a body comment does not count)
                    return torch.erf(x)
            """},
    )
    report = lint_source(tmp_path, "import unroller.runtime.ipu as K\n", package_roots=roots)
    assert [(h.file.name, h.line, h.col, h.name) for h in report.host_only] == [
        ("ipu.py", 4, 1, "accumulate"),
        ("ipu.py", 8, 1, "stash"),
        ("ipu.py", 14, 5, "Book.tensors"),
    ]
    assert found(report) == [("ipu.py", 20, 22, "torch.erf", "")]
    text = report.format(relative_to=tmp_path)
    assert "pkg/runtime/ipu.py:4:1: note: accumulate is host-only" in text
    assert text.splitlines()[-1] == (
        "1 torch calls in 2 files, 1 not supported; 3 host-only functions not checked"
    )


# ---------------------------------------------------------------- the real compressors

# What `lint_paths([unroller/compress])` reports today (file, call): host-side helpers that are
# not marked host-only (stored_bytes, constant builders) and stochastic rounding's rand_like.
KNOWN_COMPRESS_ERRORS = {
    ("base.py", "torch.tensor"),  # _place_values: constant built through cached_constant
    ("dct_tables.py", "torch.tensor"),  # fold_index: constant built through cached_constant
    ("dct.py", "torch.empty"),  # Dct.stored_bytes (element size of a dtype)
    ("quant.py", "torch.empty"),  # Quant.stored_bytes (element size of a dtype)
    ("quant.py", "torch.rand_like"),  # Quant.compress, stochastic=True
}


def test_real_compress_modules_report_no_new_kind_of_error():
    report = lint_paths([COMPRESS])
    assert {f.name for f in report.files} >= {"base.py", "bits.py", "dct.py", "quant.py"}
    assert {(c.file.name, c.name) for c in report.errors} <= KNOWN_COMPRESS_ERRORS, report.format()


def test_real_compress_modules_lint_clean():
    report = lint_paths([COMPRESS])
    assert report.ok, report.format()


def test_no_function_of_the_lint_package_is_over_80_lines():
    """Each module of unroller/lint/ has one job and each function one step of it: a function
    that grows past 80 lines (decorators included) is to be split, not extended."""
    pkg = ROOT / "unroller" / "lint"
    long = []
    for path in sorted(pkg.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                length = (node.end_lineno or node.lineno) - first + 1
                if length > 80:
                    long.append(f"{path.name}:{node.lineno} {node.name}: {length} lines")
    assert len(list(pkg.glob("*.py"))) > 1
    assert long == []


def test_the_lint_package_keeps_its_public_names_and_default_root():
    """``from unroller.lint import ...`` is the interface (cli, tests); the default package
    root is the unroller package, not the lint subpackage."""
    from unroller import lint
    from unroller.lint import resolve

    for name in lint.__all__:
        assert hasattr(lint, name), name
    assert lint.HOST_ONLY_TAG == "unroller-lint: host-only"
    assert lint.MAX_SOURCE_BYTES == 16 * 1024 * 1024
    assert resolve._DEFAULT_ROOTS == {"unroller": Path(unroller.__file__).resolve().parent}
    assert lint.supported_ops_path("ipu") == ROOT / "unroller" / "ipu_supported.toml"
