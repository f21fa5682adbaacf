"""The kinds of finding a lint report holds (``LintCall.kind``).

Shared by the supported list (which kinds it lists names of), the scanner (which it finds)
and the report (how each is shown), so none of those imports another only for these names."""

TORCH, FUNCTIONAL, TENSOR, MODULE = "torch", "functional", "tensor", "module"
ATEN, OPS, DYNAMIC, AUTOGRAD = "aten", "ops", "dynamic", "autograd"
OPS_REFERENCE = "ops-reference"  # torch.ops used other than by calling: `_aten = torch.ops.aten`
IMPORT, SYNTAX, READ = "import", "syntax", "read"
_NOT_CALLS = (IMPORT, SYNTAX, READ, OPS_REFERENCE)
