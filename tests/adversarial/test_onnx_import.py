"""Hostile ONNX files for ``unroll import FILE.onnx`` (and ``unroll weights``).

Each file is built here with ``onnx.helper`` (a few hundred bytes) and must end in one
``unroll: error: ...`` line naming the file, exit status 2, no traceback, nothing on
standard output, in bounded memory and time:

- constant folding is bounded *before* anything is allocated: a ``ConstantOfShape``,
  ``Expand``, ``Tile``, ``Range``, ``Pad`` or sparse ``Constant`` whose inferred size is
  past the bound is refused, naming the node (a 332-byte file once made the import
  allocate 1.2 GiB), and so is a chain of constants past the memory budget;
- graphs ``onnx.checker`` rejects (duplicate initializers, a value assigned twice, cycles,
  raw data shorter than the shape, string attributes where numbers belong) and tensors it
  lets through (string weights, typed data of the wrong length) are refused;
- a constant that cannot be computed, an infinite or NaN attribute, hostile metadata
  (deeply nested, megabytes long) and deeply nested subgraphs are one-line errors;
- an empty, garbage, missing or oversized file, a folder, a FIFO or a device is refused
  naming the file; external data must be a regular file inside the model's folder.

Cases run the Typer app in process under an alarm; one bomb also runs the real ``unroll``
process under a memory cap, so a regression fails instead of exhausting the machine.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import time_limit

onnx = pytest.importorskip("onnx")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from tests.adversarial import cli_cases  # noqa: E402
from tests.adversarial.cli_cases import invoke  # noqa: E402
from unroller.importer import onnx_frontend  # noqa: E402

UNROLL = Path(sys.executable).with_name("unroll")
INPUT = "x: f32[N, 4]"


def refused(result, *phrases: str) -> str:
    return cli_cases.refused(result, *phrases, quiet=True)


@pytest.fixture(autouse=True)
def alarm():
    """No case may block or run away: a FIFO, a bomb, quadratic metadata parsing."""
    with time_limit(30, TimeoutError("ran for 30 s")):
        yield


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def model(nodes, inits=(), opset: int = 17, **kwargs):
    """A graph from x: f32[N, 4] to y: f32[N, 4]."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])
    graph = helper.make_graph(nodes, "g", [x], [y], initializer=list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], **kwargs)


def ints(name: str, values) -> TensorProto:
    return numpy_helper.from_array(np.array(values, np.int64), name)


def floats(name: str, values) -> TensorProto:
    return numpy_helper.from_array(np.array(values, np.float32), name)


def save(folder: Path, content, name: str = "m.onnx") -> Path:
    path = folder / name
    data = content if isinstance(content, bytes) else content.SerializeToString()
    path.write_bytes(data)
    return path


def import_file(path: Path, *phrases: str) -> str:
    return refused(invoke("import", str(path), "--input", INPUT), str(path), *phrases)


def reshaped_by(nodes, inits, value: str):
    """``nodes`` computing the constant ``value``, made live: x is reshaped by its shape."""
    tail = [
        helper.make_node("Shape", [value], ["big_shape"]),
        helper.make_node("Reshape", ["x", "big_shape"], ["y"]),
    ]
    return model(list(nodes) + tail, inits)


# ---------------------------------------------------------------- 1. constant bombs

HUGE = [20000, 20000]  # 400 M elements: 1.6 GB as float32, 3.2 GB as int64

SPARSE = helper.make_sparse_tensor(floats("v", [1.0]), ints("i", [5]), HUGE)

BOMBS = {
    "Constant": ([helper.make_node("Constant", [], ["c"], sparse_value=SPARSE)], []),
    "ConstantOfShape": ([helper.make_node("ConstantOfShape", ["s"], ["c"])], [ints("s", HUGE)]),
    "Expand": (
        [helper.make_node("Expand", ["one", "s"], ["c"])],
        [floats("one", [1.0]), ints("s", HUGE)],
    ),
    "Tile": (
        [helper.make_node("Tile", ["row", "r"], ["c"])],
        [floats("row", [[1.0, 2.0]]), ints("r", [20000, 10000])],
    ),
    "Range": (
        [helper.make_node("Range", ["a", "b", "d"], ["c"])],
        [ints("a", 0), ints("b", 10**9), ints("d", 1)],
    ),
    "Pad": (
        [helper.make_node("Pad", ["row", "p"], ["c"])],
        [floats("row", [[1.0]]), ints("p", [0, 0, 20000, 20000])],
    ),
}


@pytest.mark.parametrize("op", sorted(BOMBS))
def test_constant_bomb_is_refused_before_it_is_allocated(work: Path, op: str):
    """The size comes from shape inference; the message proves nothing was computed."""
    nodes, inits = BOMBS[op]
    path = save(work, reshaped_by(nodes, inits, "c"))
    assert path.stat().st_size < 400
    import_file(path, f"{op} node", "'c' would hold", "elements")


def test_constant_chain_past_the_budget_is_refused(work: Path, monkeypatch):
    """Each constant is within the per-constant bound, together they are not."""
    monkeypatch.setattr(onnx_frontend, "CONST_BUDGET_BYTES", 16 * 2**20)
    nodes = [helper.make_node("ConstantOfShape", ["s"], ["c0"])]
    for k in range(1, 6):  # 8 MiB of int64 each
        nodes.append(helper.make_node("Add", [f"c{k - 1}", "one"], [f"c{k}"]))
    cos = helper.make_attribute("value", numpy_helper.from_array(np.array([1], np.int64)))
    nodes[0].attribute.append(cos)
    inits = [ints("s", [2**20]), ints("one", 1)]
    import_file(save(work, reshaped_by(nodes, inits, "c5")), "memory budget")


def test_bomb_under_a_memory_cap(work: Path):
    """The real process, limited to far less than the bomb needs: a clean exit 2."""
    nodes, inits = BOMBS["ConstantOfShape"]
    path = save(work, reshaped_by(nodes, inits, "c"))
    cap = 1536 * 2**20  # the bomb needs 3 GiB; the importer runs in a few hundred MiB

    def limit():
        resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))

    done = subprocess.run(
        [str(UNROLL), "import", str(path), "--input", INPUT],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limit,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "would hold" in lines[0], done.stderr[-2000:]
    assert done.stdout == ""


# ---------------------------------------------------------------- 2. invalid graphs


def test_duplicate_initializers(work: Path):
    w = floats("w", [1.0, 2.0, 3.0, 4.0])
    import_file(save(work, model([helper.make_node("Add", ["x", "w"], ["y"])], [w, w])), "w")


def test_value_assigned_twice(work: Path):
    nodes = [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Sigmoid", ["x"], ["y"])]
    import_file(save(work, model(nodes)), "single static assignment")


def test_raw_data_shorter_than_the_shape(work: Path):
    w = floats("w", [1.0, 2.0, 3.0, 4.0])
    w.raw_data = b"\0" * 4
    import_file(save(work, model([helper.make_node("Add", ["x", "w"], ["y"])], [w])), "'w'")


def test_typed_data_shorter_than_the_shape(work: Path):
    w = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[1000, 1000], float_data=[1.0])
    text = import_file(save(work, model([helper.make_node("Add", ["x", "w"], ["y"])], [w])))
    assert "'w'" in text


def test_string_weights(work: Path):
    w = helper.make_tensor("w", TensorProto.STRING, [4], [b"a", b"b", b"c", b"d"])
    path = save(work, model([helper.make_node("Add", ["x", "w"], ["y"])], [w]))
    import_file(path, "'w' holds STRING data")


def test_string_constant(work: Path):
    """A Constant node's string value is refused where it is computed."""
    nodes = [
        helper.make_node("Constant", [], ["k"], value_string="abc"),
        helper.make_node("Shape", ["k"], ["ks"]),
        helper.make_node("Reshape", ["x", "ks"], ["y"]),
    ]
    import_file(save(work, model(nodes)), "Constant node")


# ---------------------------------------------------------------- 3. former tracebacks


def test_cycle(work: Path):
    nodes = [
        helper.make_node("Add", ["x", "b"], ["a"]),
        helper.make_node("Relu", ["a"], ["b"]),
        helper.make_node("Relu", ["b"], ["y"]),
    ]
    import_file(save(work, model(nodes)), "'b'")


def test_cycle_past_the_checker(work: Path, monkeypatch):
    """The importer's own check, should the checker ever let a cycle through."""
    monkeypatch.setattr(onnx.checker, "check_model", lambda m: None)
    nodes = [
        helper.make_node("Relu", ["b"], ["a"], name="first"),
        helper.make_node("Relu", ["a"], ["b"]),
        helper.make_node("Add", ["x", "b"], ["y"]),
    ]
    import_file(save(work, model(nodes)), "Relu node 'first'", "reads 'b'")


def test_constant_that_cannot_be_computed(work: Path):
    nodes = [
        helper.make_node("Gather", ["s", "at"], ["g"], name="pick"),
        helper.make_node("Reshape", ["x", "g"], ["y"]),
    ]
    inits = [ints("s", [-1, 4]), ints("at", [0, 7])]
    import_file(save(work, model(nodes, inits)), "Gather node 'pick'", "cannot compute")


def test_constant_of_unknown_size(work: Path):
    """NonZero's size depends on the values: not computed without a bound."""
    nodes = [
        helper.make_node("NonZero", ["s"], ["nz"], name="nz"),
        helper.make_node("Shape", ["nz"], ["nzs"]),
        helper.make_node("Reshape", ["x", "nzs"], ["y"]),
    ]
    import_file(save(work, model(nodes, [ints("s", [1, 0, 1])])), "NonZero node 'nz'")


def test_expensive_op_on_constants(work: Path):
    """A convolution of constants is not evaluated (its cost is not linear in its size)."""
    nodes = [
        helper.make_node("Conv", ["a", "k"], ["c"], name="conv", pads=[9, 9, 9, 9]),
        helper.make_node("Shape", ["c"], ["cs"]),
        helper.make_node("Reshape", ["x", "cs"], ["y"]),
    ]
    inits = [floats("a", np.ones((1, 1, 4, 4))), floats("k", np.ones((1, 1, 3, 3)))]
    import_file(save(work, model(nodes, inits)), "Conv node 'conv'", "does not evaluate")


def test_string_attribute_where_a_number_belongs(work: Path):
    node = helper.make_node("LeakyRelu", ["x"], ["y"], alpha="abc")
    import_file(save(work, model([node])), "alpha")


def test_string_attribute_past_the_checker(work: Path, monkeypatch):
    monkeypatch.setattr(onnx.checker, "check_model", lambda m: None)
    node = helper.make_node("Flatten", ["x"], ["y"], axis="abc", name="flat")
    import_file(save(work, model([node])), "Flatten node 'flat'", "cannot read")


@pytest.mark.parametrize(
    "metadata",
    ["-" * 100000 + "1", "[" * 100000, "[" + "'a'," * 3_000_000 + "]"],
    ids=["unary-chain", "nesting", "megabytes"],
)
def test_hostile_metadata_is_ignored_quickly(work: Path, metadata: str):
    """Module-path metadata that is not a short list of names is ignored, in linear time
    (ast.literal_eval ran out of memory on the first and took half a minute on the last)."""
    node = helper.make_node("Relu", ["x"], ["y"])
    entry = node.metadata_props.add()
    entry.key, entry.value = "pkg.torch.onnx.name_scopes", metadata
    result = invoke("import", str(save(work, model([node]))), "--input", INPUT)
    assert result.exit_code == 0, result.output
    assert "relu(x)" in result.stdout


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    tag, length = (number << 3) | 2, len(payload)
    out = bytearray([tag])
    while True:
        byte, length = length & 0x7F, length >> 7
        out.append(byte | (0x80 if length else 0))
        if not length:
            return bytes(out) + payload


def test_deeply_nested_subgraphs(work: Path):
    """200 If nodes inside each other's branches (written as bytes: protobuf will not
    build it): the parser's depth limit is a one-line error naming the file."""
    out = helper.make_tensor_value_info("o", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Relu", ["c"], ["o"])], "g", [], [out])
    data = graph.SerializeToString()
    for _ in range(200):
        attribute = onnx.AttributeProto(name="then_branch", type=onnx.AttributeProto.GRAPH)
        node = helper.make_node("If", ["cond"], ["o"]).SerializeToString()
        node += _field(5, attribute.SerializeToString() + _field(6, data))
        data = _field(1, node)
    head = model([helper.make_node("Relu", ["x"], ["y"])])
    content = head.SerializeToString() + _field(7, data)  # a second graph field: merged
    import_file(save(work, content), "not an ONNX model")


# ---------------------------------------------------------------- 4. non-finite attributes


@pytest.mark.parametrize("op", ["LeakyRelu", "Elu"])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_attribute(work: Path, op: str, value: float):
    node = helper.make_node(op, ["x"], ["y"], name="act", alpha=value)
    text = import_file(save(work, model([node])), f"{op} node 'act'", "attribute alpha")
    assert "internal error" not in text


def test_non_finite_constant_argument(work: Path):
    """A Pad value of -inf (a constant input, not an attribute) is refused at its node."""
    node = helper.make_node("Pad", ["x", "p", "v"], ["y"], name="pad")
    inits = [ints("p", [0, 1, 0, 1]), floats("v", -np.inf)]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 6])
    graph = helper.make_graph([node], "g", [x], [y], initializer=inits)
    content = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    text = import_file(save(work, content), "Pad node 'pad'", "value=-inf")
    assert "internal error" not in text


# ---------------------------------------------------------------- 5. the file itself


def test_empty_file_is_named(work: Path):
    import_file(save(work, b""), "empty")


def test_garbage_is_named(work: Path):
    import_file(save(work, b"\xff\xff\xff\xff"), "not an ONNX model")


def test_weights_of_an_empty_file_is_named(work: Path):
    path = save(work, b"")
    refused(invoke("weights", str(path), "-o", "w.pt"), str(path), "empty")
    assert not (work / "w.pt").exists()


def test_missing_file(work: Path):
    import_file(work / "missing.onnx", "no such file")


def test_folder(work: Path):
    (work / "d.onnx").mkdir()
    import_file(work / "d.onnx", "folder")


def test_fifo_never_blocks(work: Path):
    os.mkfifo(work / "p.onnx")
    import_file(work / "p.onnx", "FIFO")


def test_device_is_not_read(work: Path):
    os.symlink("/dev/zero", work / "z.onnx")
    import_file(work / "z.onnx", "character device")


def test_oversized_file(work: Path, monkeypatch):
    monkeypatch.setattr(onnx_frontend, "MAX_FILE_BYTES", 64)
    import_file(save(work, model([helper.make_node("Relu", ["x"], ["y"])])), "larger than")


def _external(folder: Path, location: str, values=(2.0,), offset: int = 0) -> Path:
    """y = x * s with the scalar s kept in the external file ``location``."""
    from onnx.external_data_helper import set_external_data

    s = floats("s", np.array(values[0] if len(values) == 1 else values))
    set_external_data(s, location=location, offset=offset, length=4 * len(values))
    s.ClearField("raw_data")
    s.data_location = TensorProto.EXTERNAL
    return save(folder, model([helper.make_node("Mul", ["x", "s"], ["y"])], [s]))


def test_external_data_is_read(work: Path):
    (work / "m.data").write_bytes(b"\0" * 8 + np.float32(2.0).tobytes())
    result = invoke("import", str(_external(work, "m.data", offset=8)), "--input", INPUT)
    assert result.exit_code == 0, result.output
    assert "factor=2.0" in result.stdout


@pytest.mark.parametrize(
    "location", ["../outside.data", "/etc/passwd", "fifo.data", "link", "m\0.data", "."]
)
def test_external_data_outside_or_not_a_file(work: Path, location: str):
    (work.parent / "outside.data").write_bytes(np.float32(2.0).tobytes())
    os.mkfifo(work / "fifo.data")
    os.symlink("/dev/zero", work / "link")
    import_file(_external(work, location))


def test_external_data_too_short(work: Path):
    (work / "m.data").write_bytes(b"\0\0")
    import_file(_external(work, "m.data"), "needs 4 bytes")


# ---------------------------------------------------------------- numbers past the language


def _graph_of(nodes, inits, shape: list):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)
    graph = helper.make_graph(nodes, "g", [x], [y], initializer=list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize(
    "node, inits, phrase",
    [
        (helper.make_node("Pad", ["x", "p"], ["y"]), [ints("p", [0, 2**40, 0, 2**40])], "pad="),
        (
            helper.make_node("Slice", ["x", "a", "b", "ax", "st"], ["y"]),
            [ints("a", [1]), ints("b", [2**62]), ints("ax", [1]), ints("st", [2**62])],
            "step=",
        ),
        (helper.make_node("Gather", ["x", "i"], ["y"], axis=1), [ints("i", 2**62)], "index="),
    ],
    ids=["pad", "slice-step", "gather-index"],
)
def test_integer_past_the_language(work: Path, node, inits, phrase: str):
    """The file's number, not an importer's gap: named at its node, not "internal error"."""
    text = import_file(save(work, model([node], inits)), f"{node.op_type} node", phrase)
    assert "internal error" not in text and "2147483647" in text


def test_negative_inferred_size(work: Path):
    """A pooling window larger than the input: a negative size, refused at its node."""
    node = helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[2**40, 1])
    path = save(work, _graph_of([node], [], ["N", 1, 4, 4]))
    result = invoke("import", str(path), "--input", "x: f32[N, 1, 4, 4]")
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert "internal error" not in result.stderr and "MaxPool" in result.stderr
    assert "not in 1..2147483647" in result.stderr
