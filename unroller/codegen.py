"""Graph -> step program -> Jinja template -> black -> source text.

``emit_gpu`` lays out the training step as explicit code: every forward kernel call,
then the seed gradient of the loss, then every backward kernel call in reverse
topological order, summing gradients where a value has several consumers, handing
parameter gradients to ``K.accumulate``, and deleting each tensor right after its
last use. The template only arranges these lines into a module.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import black
import jinja2

from unroller import __version__
from unroller.errors import ModelError
from unroller.graph import Graph, Node, Value
from unroller.resources import resource_dir
from unroller.schedule import Namer, Step, release_dead

PLATFORMS = ("gpu",)
SCHEMES = ("nocompress",)
HEADER_TAG = "# unroller: "
CHECKSUM_TAG = "# unroller-checksum: "
DEFAULT_KERNELS = "unroller.runtime.gpu"
# Generated code favours one line per step over the 100 columns of hand-written code.
GENERATED_LINE_LENGTH = 120


@dataclass
class Options:
    """Everything besides the model text that determines the generated file."""

    platform: str = "gpu"
    scheme: str = "nocompress"
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"platform": self.platform, "scheme": self.scheme, **self.extra}


def literal(value: Any) -> str:
    """A Python literal for a validated constant (numbers, bools, strings, tuples)."""
    return repr(value)


def kwargs_text(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={literal(v)}" for k, v in kwargs.items())


class GpuEmitter:
    """Builds the step program of the gpu platform for one graph."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.names = Namer()
        self.kernel_alias: dict[str, str] = {DEFAULT_KERNELS: "K"}
        for value in graph.inputs:
            self.names(value.name)
        for node in graph.nodes:
            self.names(node.output.name)

    # -- identifiers -------------------------------------------------------------------

    def ident(self, value: Value) -> str:
        return self.names(value.name)

    def grad(self, value: Value) -> str:
        return self.names(f"grad:{value.name}", f"grad_{self.ident(value)}")

    def extra(self, node: Node, name: str) -> str:
        return self.names(f"extra:{node.name}:{name}", f"{self.ident(node.output)}_{name}")

    def kernels(self, node: Node) -> str:
        module = node.op.kernels.get("gpu")
        if module is None:
            raise ModelError(f"operator '{node.op.name}' has no kernels for platform gpu", node.loc)
        if module not in self.kernel_alias:
            self.kernel_alias[module] = (
                "K" if module == DEFAULT_KERNELS else f"K{len(self.kernel_alias) + 1}"
            )
        return self.kernel_alias[module]

    @staticmethod
    def param(key: str) -> str:
        return f"P[{key!r}]"

    # -- forward -----------------------------------------------------------------------

    def forward_step(self, node: Node, saved_extras: set[str], eval_mode: bool = False) -> Step:
        op = node.op
        inputs = [self.ident(v) for v in node.inputs]
        tensors = [self.param(p.key) if p.present else "None" for p in node.params]
        tensors += [self.param(b.key) for b in node.buffers]
        call_args = ", ".join(a for a in [*inputs, *tensors, kwargs_text(node.kernel_kwargs)] if a)
        func = f"{op.name}_eval" if eval_mode and op.has_eval else op.name
        outputs = [self.ident(node.output)]
        writes = [self.ident(node.output)]
        if op.extras and not (eval_mode and op.has_eval):
            for extra in node.extras:
                if extra.name in saved_extras:
                    outputs.append(self.extra(node, extra.name))
                    writes.append(outputs[-1])
                else:
                    outputs.append("_")
        line = f"{', '.join(outputs)} = {self.kernels(node)}.{func}({call_args})"
        return Step(
            "forward",
            [line],
            reads=inputs,
            writes=writes,
            comment=node.text,
            blocks=tuple(b.text for b in node.blocks),
        )

    # -- backward ----------------------------------------------------------------------

    def saved_expr(self, node: Node, entry: str) -> str:
        names = node.input_names
        if entry in names:
            return self.ident(node.inputs[names.index(entry)])
        if entry == "output":
            return self.ident(node.output)
        for p in (*node.params, *node.buffers):
            if p.name == entry:
                return self.param(p.key)
        return self.extra(node, entry)

    def backward_step(self, node: Node, owned: dict[int, bool]) -> Step:
        """One backward kernel call, gradient sums for fan-out, parameter accumulation.

        ``owned`` maps each value that already has a gradient to whether that tensor is
        exclusively ours (then later contributions are added in place, as autograd's
        input buffers do) or may alias another gradient (then the sum is out of place).
        """
        op = node.op
        grad_out = self.grad(node.output)
        saved = [self.saved_expr(node, entry) for entry in op.saved]
        reads = [grad_out] + [s for s in saved if not s.startswith("P[")]
        outputs: list[str] = []
        extra_lines: list[str] = []
        writes: list[str] = []
        for position, value in enumerate(node.inputs):
            if not value.requires_grad:
                outputs.append("_")
            elif id(value) not in owned:
                owned[id(value)] = not op.grad_aliases
                outputs.append(self.grad(value))
                writes.append(outputs[-1])
            else:
                partial = self.names(
                    f"partial:{node.name}:{position}",
                    f"{self.grad(value)}_from_{self.ident(node.output)}",
                )
                outputs.append(partial)
                writes.append(partial)
                total = self.grad(value)
                if owned[id(value)]:
                    extra_lines.append(f"{total} += {partial}")
                else:
                    extra_lines.append(f"{total} = {total} + {partial}")
                    owned[id(value)] = True
                reads += [total, partial]
        for p in node.params:
            if not p.present:
                outputs.append("_")
                continue
            ident = self.names(f"pgrad:{p.key}", f"grad_{self.ident(node.output)}_{p.name}")
            outputs.append(ident)
            writes.append(ident)
            extra_lines.append(f"{self.kernels(node)}.accumulate({self.param(p.key)}, {ident})")
            reads.append(ident)
        needs = f"needs={tuple(node.needs)!r}"
        call_args = ", ".join(
            a for a in [grad_out, *saved, kwargs_text(node.backward_kwargs), needs] if a
        )
        targets = ", ".join(outputs) if len(outputs) > 1 else f"({outputs[0]},)"
        line = f"{targets} = {self.kernels(node)}.{op.name}_backward({call_args})"
        return Step(
            "backward",
            [line, *extra_lines],
            reads=reads,
            writes=writes,
            comment=node.text,
            blocks=tuple(b.text for b in node.blocks),
        )

    # -- whole methods -----------------------------------------------------------------

    def saved_extras(self, node: Node) -> set[str]:
        if not node.needs_backward:
            return set()
        return {e.name for e in node.extras if e.name in node.op.saved}

    def training_steps(self) -> list[Step]:
        graph = self.graph
        steps = [self.forward_step(n, self.saved_extras(n)) for n in graph.nodes]
        loss = self.ident(graph.loss)
        steps.append(
            Step(
                "backward",
                [f"{self.grad(graph.loss)} = torch.ones_like({loss})"],
                reads=[loss],
                writes=[self.grad(graph.loss)],
                comment="d loss / d loss = 1",
            )
        )
        owned: dict[int, bool] = {id(graph.loss): True}
        for node in reversed(graph.nodes):
            if node.needs_backward:
                steps.append(self.backward_step(node, owned))
        # A forward step whose output is saved by a backward step must keep it alive:
        # liveness sees the read in the backward step, so nothing more to do here.
        release_dead(steps, keep={loss})
        return steps

    def predict_steps(self) -> list[Step]:
        graph = self.graph
        needed: set[int] = {id(v) for v in graph.preds}
        for node in reversed(graph.nodes):
            if id(node.output) in needed:
                needed.update(id(v) for v in node.inputs)
        for value in graph.inputs:
            if value.kind == "target" and id(value) in needed:
                raise ModelError(
                    f"a prediction depends on target '{value.name}'; predict() takes only inputs",
                    value.loc,
                )
        steps = [
            self.forward_step(n, set(), eval_mode=True)
            for n in graph.nodes
            if id(n.output) in needed
        ]
        release_dead(steps, keep={self.ident(v) for v in graph.preds})
        return steps


def render_steps(steps: list[Step]) -> list[str]:
    """Lines of a method body: block and statement comments, code, and releases."""
    lines: list[str] = []
    current_blocks: tuple[str, ...] = ()
    section = ""
    for step in steps:
        if step.section != section:
            section = step.section
            lines.append("")
            lines.append(f"# ---- {section} " + "-" * 60)
            current_blocks = ()
        if step.blocks != current_blocks:
            common = 0
            while (
                common < min(len(step.blocks), len(current_blocks))
                and step.blocks[common] == current_blocks[common]
            ):
                common += 1
            for depth, text in enumerate(step.blocks[common:], start=common):
                lines.append(f"# {'  ' * depth}[block] {text}")
            current_blocks = step.blocks
        if step.comment:
            prefix = "  " * len(step.blocks)
            lines.append(f"# {prefix}{step.comment}")
        lines.extend(step.lines)
        if step.release:
            lines.append(f"del {', '.join(step.release)}")
    return lines


def layer_lines(graph: Graph, names: Namer) -> list[tuple[str, str, str]]:
    """(comment, state-dict prefix, constructor) for each node that has parameters."""
    layers = []
    for node in graph.nodes:
        if not (node.params or node.buffers):
            continue
        env = {**node.args, **node.derived}
        ctor = node.op.module.format(**{k: literal(v) for k, v in env.items()})
        layers.append((node.text, node.name, ctor))
    return layers


def header_comment(graph: Graph, source_path: str, options: Options) -> str:
    meta = {
        "generator": __version__,
        "source": source_path,
        "sha256": graph.sha256,
        **options.as_dict(),
    }
    return HEADER_TAG + json.dumps(meta, sort_keys=False)


def render(graph: Graph, source_path: str, options: Options) -> str:
    """The complete generated module, formatted, with header and checksum."""
    if options.platform not in PLATFORMS:
        raise ValueError(f"unknown platform '{options.platform}' (known: {', '.join(PLATFORMS)})")
    if options.scheme not in SCHEMES:
        raise ValueError(f"unknown scheme '{options.scheme}' (known: {', '.join(SCHEMES)})")
    emitter = GpuEmitter(graph)
    training = render_steps(emitter.training_steps())
    predict = render_steps(emitter.predict_steps())
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(resource_dir("templates"))),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["pyrepr"] = repr
    template = env.get_template(f"{options.platform}/module.py.j2")
    preds = [emitter.ident(v) for v in graph.preds]
    text = template.render(
        header=header_comment(graph, source_path, options),
        version=__version__,
        source_path=json.dumps(source_path),
        model_name=graph.name,
        options=options,
        kernel_imports=sorted(emitter.kernel_alias.items(), key=lambda kv: kv[1]),
        layers=layer_lines(graph, emitter.names),
        train_args=[emitter.ident(v) for v in graph.inputs],
        predict_args=[emitter.ident(v) for v in graph.model_inputs],
        training=training,
        predict=predict or ["pass"],
        loss=emitter.ident(graph.loss),
        preds=preds,
        signature=[f"{v.name}: {v.type}" for v in graph.inputs],
    )
    text = black.format_str(text, mode=black.Mode(line_length=GENERATED_LINE_LENGTH))
    return add_checksum(text)


def body_checksum(text: str) -> str:
    body = "".join(
        line for line in text.splitlines(keepends=True) if not line.startswith(CHECKSUM_TAG)
    )
    return hashlib.sha256(body.encode("utf-8")).hexdigest()


def add_checksum(text: str) -> str:
    lines = text.splitlines(keepends=True)
    index = next(i for i, line in enumerate(lines) if line.startswith(HEADER_TAG)) + 1
    lines.insert(index, f"{CHECKSUM_TAG}{body_checksum(text)}\n")
    return "".join(lines)


def read_header(text: str) -> dict[str, Any] | None:
    """The metadata a generated file records, or None if it is not a generated file."""
    for line in text.splitlines()[:10]:
        if line.startswith(HEADER_TAG):
            try:
                return json.loads(line[len(HEADER_TAG) :])
            except json.JSONDecodeError:
                return None
    return None


def edited_by_hand(text: str) -> bool:
    """True when a generated file's body no longer matches the checksum it carries."""
    for line in text.splitlines()[:10]:
        if line.startswith(CHECKSUM_TAG):
            return line[len(CHECKSUM_TAG) :].strip() != body_checksum(text)
    return True
