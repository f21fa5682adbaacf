"""Static check that generated code calls only operations its platform supports.

``lint_module(path)`` reads a generated module with :mod:`ast` (nothing is imported or run),
follows its imports into the kernel modules it calls (``unroller.runtime.<platform>``,
``unroller.compress``, and modules of operators added through ``UNROLLER_OPS``) and whatever
those import in turn, and lists every torch call it finds, each checked against the platform's
list of supported operations, ``unroller/<platform>_supported.toml`` (for ``ipu``: PopTorch's
list). An unsupported call reached through imports is reported at its own file and line, with
the chain that reaches it: the line of the linted module that names the kernel, then each
helper named on the way (``gen.py:57:17 K2.clip -> kern.py:5:12 _h -> kern.py:9:12
torch.ops.aten.hardtanh``).

What counts as a torch call (import aliases resolved per module: ``import torch as T``,
``import torch.nn.functional as F``, ``from torch import nn``, ``from torch import ops``,
``from torch.nn import functional as F``, ``from torch.nn.functional import pad``,
``from torch.ops import aten``, ``__import__("torch")``, ``importlib.import_module("torch")``,
and simple assignments such as ``_aten = torch.ops.aten``):

* ``torch.X(...)``, ``torch.linalg.X(...)``, ``torch.nn.functional.X(...)`` / ``F.X(...)``;
* ``torch.nn.X(...)``: a module constructor, allowed if the list names the module, with its
  argument restrictions (``MaxPool2d(return_indices=True)`` is an error);
* ``<expr>.X(...)`` where ``X`` is a ``torch.Tensor`` method (at lint time) and the receiver
  is not an imported module, ``self``/``cls``, ``super()``, a str/list/dict/tuple/set literal
  or a parameter annotated as one of those (``s: str`` makes ``s.split(",")`` no call).
  Names that are also str/list/dict/set methods (``split``, ``index``, ``sort``, ``values``,
  ``add``) are counted as tensor calls when they are on the list anyway; otherwise they are
  warnings ("unknown receiver, check by hand"), never errors;
* ``torch.ops.aten.X``, ``torch.ops.aten.X.default`` (and any ``torch.ops`` access) anywhere:
  always an error;
* a torch function or ``torch.nn`` module class named without being called (``acts =
  {"erf": torch.erf}``, ``F.gelu`` passed as an argument): checked as a call to it, since it
  may be called later through a variable (a restricted one, whose arguments are then unseen,
  is a warning); ``isinstance``/``issubclass``/``except`` class arguments and annotations do
  not count;
* a tensor method taken as a bound method (``f = x.erf``, ``getattr(x, "erf")``) on a
  receiver that may be a tensor: data attributes of other objects share these names
  (``device.type``), so only a name the platform does not support is reported, as a warning;
* ``getattr(torch..., "name")`` with a string literal is checked as the call it names;
  ``getattr(torch..., name)`` with anything else is an error (cannot be checked);
* a class derived from ``torch.autograd.Function``: an error (PopTorch has no custom
  backward).

Dynamic calls the linter cannot resolve are never passed silently. ``getattr`` with a
non-literal name on a torch object is an error (above); on a followed module (``getattr(K2,
name)``) all of that module is checked and the access is a warning; on any other object it is
a warning (it may yield a torch function or tensor method). ``__import__``/``importlib.
import_module`` with a non-literal name is a warning; so are ``eval``/``exec`` and a torch
module passed on as a value (``run(torch.nn.functional, x)``; assigning it to a name, ``F2 =
torch.nn.functional``, is an alias and followed). Calls through variables, containers and parameters (``fn(x)``,
``table[k](x)``) are not reported by themselves: every torch function or tensor method that
can end up in such a variable is reported where the code names it (the reference rules
above), and every function of a followed module that the checked code names is checked.

Argument restrictions (interpolate's mode, conv_transpose dilation, max_pool return_indices,
topk sorted, ...) are checked when the value is a literal in the call; a value the linter
cannot see is a warning.

Which code counts: all of the module linted. Its imports are resolved by name as Python
would at run time, without importing anything (the finders of ``sys.meta_path``, with the
linted module's folder first on ``sys.path``, as when it runs as a script; the folders of the
``UNROLLER_OPS`` registry files are searched last), and followed:

* modules of the ``unroller`` package (the package roots): all of a module imported as a
  module (``import unroller.runtime.ipu as K``, ``from unroller import compress``), whether
  or not it is reached at run time; from a module whose names are imported (``from
  unroller.runtime.gpu import accumulate, tensors``) only the top-level statements defining
  those names count, with the top-level definitions they use, transitively, and the top-level
  statements that bind nothing (they run at import); a name that is not bound at the top
  level makes the whole module count. A star import (``from unroller.runtime.shared import
  *``) imports by name what it binds: the module's literal ``__all__``, else every public
  name it binds at the top level (a computed ``__all__`` is not evaluated: more is checked,
  never less), through its own star imports in turn, less the names the importing module
  defines again after it; where those names cannot be known, the whole module counts;
* any other module whose source is not part of Python or an installed library (stdlib,
  site-packages), or whose top-level package is named as kernels by the operator registry
  (user operator modules, their helpers, ``import X as K2``): only what the checked code
  names in it (``K2.clip``, ``getattr(K2, "clip")``, ``from X import clip``) counts, with
  what that uses, transitively, as for names imported from the package; a module used other
  than through a constant attribute (passed around, ``getattr`` with a variable) counts whole;
* ``torch``, ``poptorch`` (installed or not), the standard library and installed
  third-party libraries (``numpy``) are not followed.

A followed module that cannot be found, is not a Python source file (a compiled extension),
cannot be read or parsed, is not a regular file, is larger than ``MAX_SOURCE_BYTES`` or is not
text in its declared encoding (UTF-8 by default) is an error; so is an entry that cannot be
read. An import of a non-package module that cannot be found but is never used is a warning.
``importlib.import_module("literal")`` is not followed (the runtime uses it for PopTorch and
its emulation, on the host).

Excluded everywhere: the bodies of functions marked host-only (and, in a module checked in
part, the definitions only they use). The marker is a comment ``# unroller-lint: host-only``
on the function's ``def`` line (or any line of its header, up to the colon), or the text
``unroller-lint: host-only`` in its docstring. Use it only for code that runs on the host,
outside the traced graph (parameter bookkeeping, stash accounting, the runner). The report
lists every function excluded this way.

Not checked: Python operators on tensors (``a + b``, ``a @ b``, ``a >> 1``), builtins applied
to tensors (``abs(t)``, ``sum(ts)``), slice bounds, dtypes, torch classes named without being
called (other than ``torch.nn`` modules), and the values generated code passes to the
kernels. Parent packages of an imported module (``unroller/__init__.py``) are not scanned
unless imported by name.

Each module is read once per run, however many linted modules import it.
``unroll lint`` is a thin wrapper: ``report = lint_paths(paths, platform)``, print
``report.format()``, exit 1 unless ``report.ok``.

The package, one job a module: ``supported`` (the supported list), ``kinds`` (the kinds of
finding), ``report`` (findings and the report's text), ``hostonly`` (the marker),
``torchnames`` (what a torch name or expression stands for), ``restrictions`` (argument
checks), ``selection`` (the statements a by-name import needs), ``stars`` (what a star
import binds), ``scanner`` (one module; its import records in ``imports``, its checks of
torch calls in ``calls``), ``source`` (bounded reading), ``resolve`` (finding imported
modules) and ``linter`` (the run over many modules, and the chains).
"""

from __future__ import annotations

from .hostonly import HOST_ONLY_TAG
from .linter import lint_module, lint_paths
from .report import Hop, HostOnly, LintCall, LintReport
from .source import MAX_SOURCE_BYTES
from .supported import SupportedOps, supported_ops, supported_ops_path

__all__ = [
    "HOST_ONLY_TAG",
    "MAX_SOURCE_BYTES",
    "Hop",
    "HostOnly",
    "LintCall",
    "LintReport",
    "SupportedOps",
    "lint_module",
    "lint_paths",
    "supported_ops",
    "supported_ops_path",
]
