"""unroller: generate PyTorch training code whose backward pass is unrolled.

Every gradient is explicit code, so each activation saved for backward can be stored
compressed between the forward op that made it and the backward step that reads it.
"""

__version__ = "0.1.0"


def unroll(*args, **kwargs):
    """A torch.nn module's unrolled, compressed training step (``unroller.oneshot.unroll``)."""
    from unroller.oneshot import unroll as _unroll

    return _unroll(*args, **kwargs)


def __getattr__(name: str):
    """``unroller.analysis.verify``: the module ``unroller/analysis/verify.py``, which is also callable as
    ``unroller.analysis.verify(module, inputs, target)`` (``unroller.oneshot.verify``); imported on
    first use, as a submodule import would set the attribute anyway."""
    if name == "verify":
        import importlib

        return importlib.import_module("unroller.analysis.verify")
    raise AttributeError(f"module 'unroller' has no attribute {name!r}")
