"""``python -m unroller.bench.reference``: check the test suite's references by hand.

For every reference of ``tests/models/``: its declarations agree with the model file's,
one float64 training step gives a finite loss and a gradient for every parameter, and
``predict`` gives predictions of the training step's shapes; prints its state-dict keys
(what a generated module must have) and the loss.
"""

from __future__ import annotations

import time

import torch

from unroller.bench.reference.suite_models import (
    DECLS,
    SUITE_REFERENCES,
    declared_in_file,
    make_inputs,
    num_inputs,
)


def self_check() -> None:
    for stem, factory in SUITE_REFERENCES.items():
        expected = [(d.kind, d.name, d.dtype, d.dims) for d in DECLS[stem]]
        assert declared_in_file(stem) == expected, (stem, declared_in_file(stem))
        torch.manual_seed(0)
        ref = factory().double()
        args = make_inputs(stem, 2)
        t0 = time.perf_counter()
        loss, *preds = ref(*args)
        loss.backward()
        dt = time.perf_counter() - t0
        assert loss.dim() == 0 and torch.isfinite(loss)
        missing = [n for n, p in ref.named_parameters() if p.grad is None]
        assert not missing, (stem, missing)
        eval_preds = ref.predict(*args[: num_inputs(stem)])
        assert [p.shape for p in eval_preds] == [p.shape for p in preds]
        keys = list(ref.state_dict())
        print(
            f"== {stem}: {len(keys)} state-dict keys, loss {loss.item():.6f}, "
            f"preds {[tuple(p.shape) for p in preds]}, step {dt * 1e3:.1f} ms"
        )
        for k in keys:
            print(f"   {k}")


if __name__ == "__main__":
    self_check()
