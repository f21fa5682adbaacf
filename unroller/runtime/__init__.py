"""Runtime kernels imported by generated training code (``from unroller.runtime import gpu as K``).

``gpu`` (plain PyTorch) and ``ipu`` (PopTorch-safe) hold each platform's kernels; ``common``
holds what they share (the helpers generated code calls, the ``needs`` helpers and the
kernels whose code is the same on both), as do ``shapeops``, ``norms``, ``positions`` and
``recurrent`` for their families, and ``shared`` gathers all of these into the one namespace
both platforms take with a star import, so neither copies the other nor lists them;
``conventions`` holds the parameters and defaults of each kernel the two formulate
differently, ``derived`` the kernels made from a platform's own (the 1-D pools from the 2-D
ones).
"""
