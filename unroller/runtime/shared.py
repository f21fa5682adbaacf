"""Every kernel and helper both platforms share, in one namespace: what ``unroller.runtime.gpu``
and ``unroller.runtime.ipu`` take with ``from unroller.runtime.shared import *`` before their
own definitions (a platform's own definition of a name then replaces the shared one, as ipu's
``unsupported`` and gpu's ``linear_backward`` do).

The kernels live in their family modules (``common``: the helpers generated code calls and
the elementwise, linear and loss kernels; ``shapeops``: the shape and tensor ops; ``norms``;
``positions``; ``precision``; ``recurrent``), each of which says in its ``__all__`` what it shares, so a
shared kernel is written and listed once: adding one touches only its family module (and
this module's imports, for a new family), never the platform modules.

Everything here reaches the IPU, so it uses only operations PopTorch runs: ``unroll lint
--platform ipu`` follows the star imports, from ipu through this module into each family
module, to the definitions behind every name they export.
"""

from __future__ import annotations

from unroller.runtime.common import *  # noqa: F403
from unroller.runtime.common import _exports
from unroller.runtime.norms import *  # noqa: F403
from unroller.runtime.positions import *  # noqa: F403
from unroller.runtime.precision import *  # noqa: F403
from unroller.runtime.recurrent import *  # noqa: F403
from unroller.runtime.shapeops import *  # noqa: F403

__all__ = _exports(globals())
