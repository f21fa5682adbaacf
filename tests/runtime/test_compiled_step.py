"""``Model(compile=True)``: the generated step under torch.compile, and the codecs' compiled
formulation (fused codecs).

Fast suite: the compiled formulation of every codec, run eagerly, gives the same bits as the
other formulations; a tiny model's step captured by torch.compile (the "eager" backend: the
graph capture and its side effects, without code generation) gives exactly the eager step's
loss, gradients, running statistics and stash log, and a second batch size reuses the graph.
Under SLOW=1: the quick model compiled by inductor, against the eager step.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from compressors.test_compressors import FAST_COMPRESSORS, FLOATS, randn, roundtrip
from conftest import generated_text, rel_err

from tests.codec_agreement import assert_agree, native_dct, same_bits
from unroller.api import import_generated, write_atomic
from unroller.compiler.options import Options
from unroller.compress import Bits, FewBit, Quant, base

# A tiny network with every kind of kept tensor: a dct-compressed conv input, a ReLU mask,
# batch-norm statistics, a pooled map.
TINY = """
model tiny {
    input x: f32[N, 3, 8, 8]
    target y: i64[N]
    c1 = conv2d(x, out_channels=4, kernel_size=3, padding=1, bias=false)
    b1 = batchnorm2d(c1)
    r1 = relu(b1)
    c2 = conv2d(r1, out_channels=6, kernel_size=3, padding=1)
    r2 = relu(c2)
    pool = adaptive_avgpool2d(r2, output_size=1)
    flat = flatten(pool)
    fc = linear(flat, out_features=3)
    loss = cross_entropy(fc, y)
    return loss, fc
}
"""


def _model_class(tmp_path, text: str, scheme: str, resolution: int | None = None):
    options = Options(scheme=scheme, resolution=resolution)
    path = tmp_path / f"m_{scheme.replace('-', '_')}_{resolution}.py"
    write_atomic(path, generated_text(text, options, label="m.txt"))
    return import_generated(path, f"compile14_{tmp_path.name}_{path.stem}").Model


def _step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor):
    model.zero_grad(set_to_none=True)
    loss = model(x, y)
    return loss, {k: p.grad.clone() for k, p in model.named_parameters()}


def _compare(eager, compiled, x, y, bound: float) -> None:
    """Loss and every gradient within ``bound`` (relative), same stash log."""
    want_loss, want = _step(eager, x, y)
    loss, got = _step(compiled, x, y)
    assert rel_err(loss, want_loss) <= bound
    assert got.keys() == want.keys()
    for key in want:
        assert rel_err(got[key], want[key]) <= bound, key
    assert compiled.stash_report() == eager.stash_report()


# the compiled formulation, run eagerly -----------------------------------------------------


def _agree(codec, x: torch.Tensor, dtype=None, seed: int = 0) -> None:
    """The compiled formulation's round trip (forced outside torch.compile) equals the fast
    one's bit for bit, packed tensors and decompressed tensor (within the native DCT
    kernel's contract where the fast one ran it: tests/codec_agreement.py)."""
    torch.manual_seed(seed)
    packed_fast, y_fast = roundtrip(codec, x, dtype)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(base, "_is_compiling", lambda: True)
        assert base.use_compiled_path(x) and not base.use_fast_path(x)
        torch.manual_seed(seed)
        packed, y = roundtrip(codec, x, dtype)
    assert_agree(codec, (packed_fast, y_fast), (packed, y), native_dct(codec, x.dtype), codec)


@pytest.mark.parametrize("dtype", FLOATS)
def test_compiled_formulation_bit_identical(dtype):
    x = randn((3, 5, 11, 17), seed=3, dtype=dtype) * 3
    x[0, 1, 2, 3], x[1, 2, 0, 0], x[2, 0, 4, 4] = float("nan"), float("inf"), -float("inf")
    x[1, 3] = torch.finfo(dtype).max * 0.9  # a huge constant channel
    x[1, 3, 1, 1] = -torch.finfo(dtype).max * 0.9  # and its range past the max: halving
    x[2, 1] = 0.0
    for codec in FAST_COMPRESSORS:
        _agree(codec, x)
    _agree(Bits(), x > 0.2)
    _agree(Bits(), x > 0.2, torch.float32)
    _agree(Quant(bits=4), x.flatten(1))
    _agree(Quant(bits=2, group_size=3), x.flatten(1)[:, :7])


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_compiled_code_packing_matches(bits):
    g = torch.Generator().manual_seed(bits)
    for n, m in [(1, 1), (2, 7), (3, 8), (2, 9), (4, 64)]:
        codes = torch.randint(0, 1 << bits, (n, m + 3), generator=g)[:, 3:]
        packed = base.pack_codes(codes, bits)
        assert torch.equal(base.pack_codes_compiled(codes, bits), packed)
        assert torch.equal(base.unpack_codes_compiled(packed, bits, m).long(), codes)


def test_host_constant_marks_as_torch_compiler_does():
    """base.host_constant sets what torch.compiler.assume_constant_result sets (it avoids
    importing torch._dynamo); a FewBit codec, whose levels come from a host-side solver,
    compiles in one graph and round-trips as eagerly."""
    marked = torch.compiler.assume_constant_result(lambda: 0)
    assert vars(base.host_constant(lambda: 0)) == vars(marked)
    codec = FewBit(bits=3)
    x = randn((2, 3, 5, 4), seed=2)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def trip(t):
        return codec.decompress(codec.compress(t), (3, 5, 4), t.dtype)

    with torch.no_grad():
        got = torch.compile(trip, backend=backend, fullgraph=True)(x)
        assert same_bits(got, trip(x)) and len(graphs) == 1


def test_compiled_path_only_while_compiling():
    x = torch.ones(2, 3)
    assert not base.use_compiled_path(x)
    assert base.use_fast_path(x)


# the step captured by torch.compile ------------------------------------------------------------


@pytest.mark.parametrize(
    "scheme",
    [
        "dct-dense",
        pytest.param("nocompress", marks=pytest.mark.slow),
        pytest.param("quant", marks=pytest.mark.slow),
    ],
)
def test_captured_step_equals_eager_step(tmp_path, scheme):
    """One graph (no break), the same float64 loss and gradients as the eager step (the
    codecs' compiled formulation is bit-identical; under a lossy scheme the eager step runs
    the convolution backward in pieces and the compiled one whole, so weight gradients may
    differ in the last bits), the same running statistics and stash log; another batch size
    runs the same graph."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model_class = _model_class(tmp_path, TINY, scheme)
    torch.manual_seed(0)
    eager = model_class().double()
    compiled = copy.deepcopy(eager)
    compiled.compile_step = backend
    bound = 0.0 if scheme == "nocompress" else 1e-13
    for n in (4, 5, 3):
        x = torch.randn(n, 3, 8, 8, dtype=torch.float64)
        y = torch.randint(0, 3, (n,))
        _compare(eager, compiled, x, y, bound)
    assert len(graphs) == 1
    for key, value in eager.state_dict().items():
        assert torch.equal(compiled.state_dict()[key], value), key


def test_compile_argument_and_docstring(tmp_path):
    model_class = _model_class(tmp_path, TINY, "nocompress")
    assert model_class().compile_step is False
    assert model_class(compile=True).compile_step is True
    module = sys.modules[model_class.__module__]
    assert "model = Model(compile=True)  # torch.compile the step" in module.__doc__


# inductor (slow) ------------------------------------------------------------------------------

QUICK = "benchmarks/models/quick.txt"


@pytest.mark.slow
@pytest.mark.parametrize(
    "scheme, dtype, bound",
    [("nocompress", torch.float64, 1e-10), ("dct-dense", torch.float64, 1e-10)],
)
def test_inductor_step_float64(tmp_path, scheme, dtype, bound):
    """The quick model at resolution 16 compiled by inductor: float64 gradients equal the
    eager step's to ``bound`` (relative)."""
    text = (Path(__file__).resolve().parents[2] / QUICK).read_text()
    model_class = _model_class(tmp_path, text, scheme, resolution=16)
    torch.manual_seed(0)
    eager = model_class().to(dtype)
    compiled = copy.deepcopy(eager)
    compiled.compile_step = True
    for n in (4, 6):
        x = torch.randn(n, 3, 16, 16, dtype=dtype)
        y = torch.randint(0, 10, (n,))
        _compare(eager, compiled, x, y, bound)


@pytest.mark.slow
def test_inductor_dct_dense_float32_within_codec_error(tmp_path):
    """float32 dct-dense compiled by inductor differs from the eager step by far less than
    the codec's own error (eager dct-dense against eager nocompress)."""
    text = (Path(__file__).resolve().parents[2] / QUICK).read_text()
    dense = _model_class(tmp_path, text, "dct-dense", resolution=16)
    plain = _model_class(tmp_path, text, "nocompress", resolution=16)
    torch.manual_seed(0)
    eager = dense()
    compiled = copy.deepcopy(eager)
    compiled.compile_step = True
    reference = plain()
    reference.load_state_dict(eager.state_dict())
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
    _, exact = _step(reference, x, y)
    _, want = _step(eager, x, y)
    _, got = _step(compiled, x, y)
    for key in want:
        codec_error = rel_err(want[key], exact[key])
        assert rel_err(got[key], want[key]) <= max(0.1 * codec_error, 1e-5), key
