"""unroller: generate PyTorch training code whose backward pass is unrolled.

Every gradient is explicit code, so each activation saved for backward can be stored
compressed between the forward op that made it and the backward step that reads it.
"""

__version__ = "0.1.0"
