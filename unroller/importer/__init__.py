"""``unroll import``: an existing network (a ``torch.nn.Module`` or an ONNX file) as model text.

The flow mirrors the generator's: a front end captures the network (``torch_frontend``:
``torch.export``, then ``torch.fx`` where export fails; ``onnx_frontend``: the ONNX graph)
and maps every node to a registry operator (``aten_ops``, ``onnx_ops``), producing an
``ImportedModel`` (``model``): statements named after the module tree, with the module
class of every path. ``emit`` writes it as model text, recovering a ``block`` for each
submodule class that repeats with the same structure. Nothing is approximated: a node
is mapped only where the registry operator computes the same value and gradient, and
every node that cannot be mapped is reported at once (``UnmappedError``).

Each front end's mapper is a core holding the walk's state (``torch_frontend._Mapper``,
``onnx_frontend._Mapper``) with its parts in modules beside it: single-node helpers
(``torch_nodes``, ``onnx_nodes``), the view an op mapper gets (``torch_view``,
``onnx_view``), collapsed module calls (``torch_collapse``, ``onnx_collapse``), and the
parts only one front end has (``torch_patterns``, ``torch_checks``, ``onnx_shapes``). Both
op tables are built by ``registry.op_table``.
"""
