"""Runtime kernels imported by generated training code (``from unroller.runtime import gpu as K``)."""
