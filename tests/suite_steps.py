"""Float64 steps of a suite model's generated module beside its torch.nn reference, shared
by the recompute tests (single ops, segments, segment pieces): one way to build the pair,
take a step and compare, so the exactness the tests ask for is the same everywhere; and
the measured step peak the memory model is held to."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from conftest import rel_err

from unroller.bench.reference import BENCHMARKS, make_inputs
from unroller.bench.reference import SUITE_REFERENCES as REFERENCES
from unroller.bench.reference import suite_model_path as model_path
from unroller.compiler.options import Options


def suite_pair(build, stem: str, options: Options, readable: bool = False):
    """(generated module, reference) of suite model ``stem`` in float64, same weights
    (``readable``: the module laid out by black, for a test that reads it)."""
    torch.manual_seed(0)
    ref = REFERENCES[stem]().double()
    gen = build(model_path(stem), options, readable=readable).Model().double()
    gen.load_state_dict(ref.state_dict())
    return gen, ref


def suite_step(gen, ref, stem: str, batch: int, seed: int):
    """One step of both on the same batch and dropout seed: (loss, reference loss)."""
    inputs = make_inputs(stem, batch, seed=seed)
    torch.manual_seed(100 + seed)
    ref_loss = ref(*inputs)[0]
    ref_loss.backward()
    torch.manual_seed(100 + seed)
    return gen(*inputs), ref_loss


def flat_grads(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter gradient, in name order, as one vector."""
    return torch.cat([p.grad.flatten() for _, p in sorted(model.named_parameters())])


def assert_grads_and_buffers_match(gen, ref, tol: float) -> None:
    """Every parameter gradient (or its absence) and every buffer of ``gen`` as ``ref``'s,
    to ``tol`` relative (integer buffers exactly)."""
    ref_params = dict(ref.named_parameters())
    for name, param in gen.named_parameters():
        want = ref_params[name].grad
        assert (param.grad is None) == (want is None), name
        if want is not None:
            assert rel_err(param.grad, want) <= tol, (name, rel_err(param.grad, want))
    ref_buffers = dict(ref.named_buffers())
    for name, buf in gen.named_buffers():
        if buf.is_floating_point():
            assert rel_err(buf, ref_buffers[name]) <= tol, name
        else:
            assert torch.equal(buf, ref_buffers[name]), name


def bench_step(tmp_path: Path, name: str, options: Options, batch: int):
    """One float64 step of a benchmark's generated module and of its torch.nn reference
    (same weights, same batch): (loss, module, reference loss, reference, source)."""
    bench = BENCHMARKS[name]
    torch.manual_seed(0)
    ref = bench.build().double()
    inputs = [t.double() if t.is_floating_point() else t for t in bench.make_batch(batch)]
    ref_loss = ref(*inputs)[0]
    ref_loss.backward()
    gen = bench.model_class(options, tmp_path)().double()
    gen.load_state_dict(ref.state_dict())
    source = Path(sys.modules[type(gen).__module__].__file__).read_text()
    return gen(*inputs), gen, ref_loss, ref, source


def measured_peak(graph, config, batch: int, options: Options | None = None) -> int:
    """The profiler's peak of one float32 step (after a warm-up step) of the module
    generated from ``graph`` under ``config`` (``options``: the rest of what generates
    it), on seeded inputs: what the memory model's predictions are checked against."""
    from unroller.analysis.inputs import make_inputs as graph_inputs
    from unroller.api import import_generated, write_atomic
    from unroller.bench.profiling import profile_step
    from unroller.compiler.codegen import render

    source = render(graph, "m.txt", options or Options(), config=config)
    with tempfile.TemporaryDirectory() as folder:
        module = import_generated(write_atomic(Path(folder) / "m.py", source))
    torch.manual_seed(0)
    model = module.Model()
    inputs = [t.float() if t.is_floating_point() else t for t in graph_inputs(graph, batch, 0)]
    model(*inputs)
    model.zero_grad(set_to_none=True)
    return profile_step(lambda: model(*inputs), "")["peak_bytes"]
