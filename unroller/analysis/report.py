"""What each node keeps for its backward step, and how many bytes that is.

The figures follow the generated code exactly: a node that needs no backward step
saves nothing; a tensor saved by several nodes (a ReLU output read by the ReLU's
backward and by the next convolution's) is stored once and counted once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from unroller.compiler.dtypes import DTYPE_BYTES
from unroller.compiler.graph import Graph, Node
from unroller.compiler.platforms import IPU
from unroller.compiler.shapes import TensorType


@dataclass(frozen=True)
class SavedTensor:
    node: str  # the node whose backward reads it
    entry: str  # the registry's saved entry ("x", "output", "indices", ...)
    key: str  # identity: the value's name, or "node:extra"
    type: TensorType
    activation: bool  # a compressor may replace it

    def nbytes(self, batch: int) -> int:
        return self.type.numel(batch) * DTYPE_BYTES[self.type.dtype]


def saved_tensors(node: Node) -> list[SavedTensor]:
    """Runtime tensors (not parameters) that ``node``'s backward step reads."""
    return [
        SavedTensor(node.name, a.entry, a.key, a.type, a.activation)
        for a in node.saved
        if a.is_tensor
    ]


def graph_report(graph: Graph, batch: int) -> dict[str, Any]:
    """Per node: op, output shape, parameters, bytes saved; totals with sharing removed."""
    rows = []
    seen: set[str] = set()
    total_saved = total_params = 0
    for node in graph.nodes:
        saved = saved_tensors(node)
        new = [s for s in saved if s.key not in seen]
        seen.update(s.key for s in saved)
        n_params = sum(p.nbytes() // DTYPE_BYTES[p.dtype] for p in node.params if p.present)
        param_bytes = sum(p.nbytes() for p in node.params if p.present)
        total_params += 0 if node.shares else n_params  # a shared layer's: counted once
        total_saved += sum(s.nbytes(batch) for s in new)
        rows.append(
            {
                "name": node.name,
                "op": node.op.name,
                "output": str(node.output.type),
                "params": n_params,
                "param_bytes": param_bytes,
                "saved": [f"{s.entry}={s.key}" for s in saved],
                "saved_bytes": sum(s.nbytes(batch) for s in saved),
                "new_saved_bytes": sum(s.nbytes(batch) for s in new),
                "backward": node.needs_backward,
            }
        )
    return {
        "model": graph.name,
        "batch_size": batch,
        "nodes": rows,
        "total_params": total_params,
        "total_saved_bytes": total_saved,
    }


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def format_table(report: dict[str, Any]) -> str:
    header = ("node", "op", "output", "params", "saved for backward")
    rows = [
        (
            r["name"],
            r["op"],
            r["output"],
            f"{r['params']:,}",
            human_bytes(r["new_saved_bytes"])
            + (" (+shared)" if r["saved_bytes"] > r["new_saved_bytes"] else ""),
        )
        for r in report["nodes"]
    ]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    lines.append("")
    lines.append(
        f"model {report['model']}: {report['total_params']:,} parameters; "
        f"saved for backward at batch {report['batch_size']}: "
        f"{human_bytes(report['total_saved_bytes'])} ({report['total_saved_bytes']:,} bytes)"
    )
    return "\n".join(lines)


def format_stash(stash: dict[str, Any], scheme: str) -> str:
    """Per tensor kept for backward: the form it is kept in, raw and stored bytes, and for a
    tensor kept raw, why (a "why raw" column, when some row has a reason)."""
    header: tuple[str, ...] = ("tensor", "kept as", "shape", "raw", "stored")
    rows = [
        (
            r["tensor"],
            r["compressor"],
            "x".join(map(str, r["shape"])),
            human_bytes(r["raw_bytes"]),
            human_bytes(r["stored_bytes"]),
        )
        for r in stash["rows"]
    ]
    if any(r.get("why") for r in stash["rows"]):
        header += ("why raw",)
        rows = [(*row, r.get("why", "")) for row, r in zip(rows, stash["rows"])]
    widths = [max(len(h), *(len(row[i]) for row in rows), 0) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    raw, stored = stash["total_raw_bytes"], stash["total_stored_bytes"]
    ratio = f"{raw / stored:.2f}x smaller" if stored else "nothing stored"
    lines.append("")
    lines.append(
        f"scheme {scheme}: kept for backward {human_bytes(stored)} ({stored:,} bytes) "
        f"instead of {human_bytes(raw)} ({raw:,} bytes): {ratio}"
    )
    return "\n".join(lines)


IPU_SRAM_BYTES = IPU.device_sram_bytes  # the ipu Platform's: one GC200 (about 900 MB)


def format_ipus(report: dict[str, Any]) -> str:
    """Per IPU: parameters, stashed activations raw and stored; bytes crossing boundaries."""
    header = (
        "ipu",
        "first node",
        "nodes",
        "params",
        "stash raw",
        "stash stored",
        f"of {IPU_SRAM_BYTES // 1000**2} MB",
    )
    rows = []
    for r in report["ipus"]:
        used = r["param_bytes"] + r["stash_stored_bytes"]
        rows.append(
            (
                str(r["ipu"]),
                r["first"] or "-",
                str(r["nodes"]),
                human_bytes(r["param_bytes"]),
                human_bytes(r["stash_raw_bytes"]),
                human_bytes(r["stash_stored_bytes"]),
                f"{100 * used / IPU_SRAM_BYTES:.1f}%",
            )
        )
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    for b in report["boundaries"]:
        lines.append(
            f"IPU {b['between'][0]} -> {b['between'][1]}: {human_bytes(b['forward_bytes'])} of "
            f"activations forward, {human_bytes(b['gradient_bytes'])} of gradients back per step"
        )
    lines.append(
        f"(batch {report['batch_size']}; params + stored stash against one GC200's "
        f"{IPU_SRAM_BYTES // 1000**2} MB of SRAM, before code, exchange buffers and temporaries)"
    )
    return "\n".join(lines)


def format_dot(graph: Graph) -> str:
    lines = [f"digraph {json_str(graph.name)} {{", "  rankdir=TB;", "  node [shape=box];"]
    for value in graph.inputs:
        lines.append(
            f"  {json_str(value.name)} [shape=ellipse, label={json_str(f'{value.name}: {value.type}')}];"
        )
    for node in graph.nodes:
        label = f"{node.name}\\n{node.op.name} -> {node.output.type}"
        lines.append(f'  {json_str(node.name)} [label="{label}"];')
        for value in node.inputs:
            lines.append(f"  {json_str(value.name)} -> {json_str(node.name)};")
    lines.append("}")
    return "\n".join(lines)


def json_str(text: str) -> str:
    return json.dumps(text)


def value_table(head: tuple[str, ...], body: list[tuple[str, ...]]) -> str:
    """Rows of compared values as a fixed-width table: the name and shape columns
    left-aligned, the numbers right-aligned, the last column (the verdict) as it is."""
    numbers = len(head) - 1
    widths = [max(len(line[i]) for line in (head, *body)) for i in range(numbers)]
    lines = []
    for line in (head, *body):
        cells = [line[0].ljust(widths[0]), line[1].ljust(widths[1])]
        cells += [cell.rjust(width) for cell, width in zip(line[2:numbers], widths[2:])]
        lines.append("  ".join([*cells, line[numbers]]).rstrip())
    return "\n".join(lines)
