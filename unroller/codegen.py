"""Graph -> step program -> Jinja template -> black -> source text.

``emit_gpu`` lays out the training step as explicit code: every forward kernel call,
then the seed gradient of the loss, then every backward kernel call in reverse
topological order, summing gradients where a value has several consumers, handing
parameter gradients to ``K.accumulate``, and deleting each tensor right after its
last use. The template only arranges these lines into a module.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from dataclasses import dataclass, field
from typing import Any

import black
import jinja2

from unroller import __version__, safe
from unroller.errors import ModelError
from unroller.graph import Graph, Node, Value
from unroller.pipeline import Pipeline, split
from unroller.resources import resource_dir
from unroller.schedule import RESERVED, Namer, Step, release_dead
from unroller.schemes import SCHEMES, Codec, CompressionConfig, builtin, resolve
from unroller.stash import Form, Stashed, StashPlan, plan_stash

PLATFORMS = ("gpu", "ipu")
HEADER_TAG = "# unroller: "
CHECKSUM_TAG = "# unroller-checksum: "
# Generated code favours one line per step over the 100 columns of hand-written code.
GENERATED_LINE_LENGTH = 120


@dataclass
class Options:
    """Everything besides the model text that determines the generated file."""

    platform: str = "gpu"
    scheme: str = "nocompress"
    compress_config: str | None = None  # a TOML file; replaces the scheme's rules
    opt_level: int = 1  # 0: no compression and no masks
    num_ipus: int = 1  # ipu: pipeline stages, one per IPU
    stage_starts: tuple[str, ...] = ()  # ipu: first node of each stage after the first
    resolution: int | None = None  # image inputs resized to this many rows (benchmarks)
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """What the header records, so `unroll check` can regenerate the same file."""
        found: dict[str, Any] = {"platform": self.platform, "scheme": self.scheme}
        if self.compress_config is not None:
            found["compress_config"] = self.compress_config
        if self.opt_level != 1:
            found["opt_level"] = self.opt_level
        if self.num_ipus != 1:
            found["num_ipus"] = self.num_ipus
        if self.stage_starts:
            found["stage_starts"] = list(self.stage_starts)
        if self.resolution is not None:
            found["resolution"] = self.resolution
        return {**found, **self.extra}

    @classmethod
    def from_header(cls, header: dict[str, Any]) -> Options:
        known = {"generator", "source", "sha256", "platform", "scheme", "compress_config"}
        known |= {"compress_config_sha256", "opt_level", "num_ipus", "stage_starts", "resolution"}
        return cls(
            platform=header.get("platform", "gpu"),
            scheme=header.get("scheme", "nocompress"),
            compress_config=header.get("compress_config"),
            opt_level=header.get("opt_level", 1),
            num_ipus=header.get("num_ipus", 1),
            stage_starts=tuple(header.get("stage_starts", ())),
            resolution=header.get("resolution"),
            extra={k: v for k, v in header.items() if k not in known},
        )

    def compression(self) -> CompressionConfig:
        return resolve(self.scheme, self.compress_config, self.opt_level)


literal = safe.literal  # repr() of a type-checked constant
kwargs_text = safe.kwargs  # key=literal, ... with identifier keys


class Emitter:
    """Builds the step program of one graph for one platform (and pipeline split)."""

    def __init__(
        self,
        graph: Graph,
        plan: StashPlan | None = None,
        platform: str = "gpu",
        pipeline: Pipeline | None = None,
    ):
        self.graph = graph
        self.node_named = {node.name: node for node in graph.nodes}
        self.platform = platform
        self.default_kernels = f"unroller.runtime.{platform}"
        self.pipeline = pipeline or Pipeline(1, {})
        self.plan = plan if plan is not None else plan_stash(graph, builtin("nocompress"))
        self.codec_names: dict[Codec, str] = {}
        for codec in self.plan.codecs():
            base = f"CODEC_{codec.name.upper()}"
            same = sum(1 for c in self.codec_names if c.name == codec.name)
            self.codec_names[codec] = f"{base}_{same + 1}" if same else base
        self.names = Namer(RESERVED | set(self.codec_names.values()))
        self.kernel_alias: dict[str, str] = {self.default_kernels: "K"}
        for value in graph.inputs:
            self.names(value.name)
        for node in graph.nodes:
            self.names(node.output.name)
        self.restored: dict[tuple[str, Form], str] = {}
        for node in graph.nodes:
            self.check_supported(node)

    def check_supported(self, node: Node) -> None:
        """Refuse, at generate time, what the platform's kernels cannot run."""
        module = importlib.import_module(self.kernel_module(node))
        why = getattr(module, "unsupported", lambda op, args: None)(node.op.name, node.args)
        if why:
            raise ModelError(f"{node.name}: {why} (platform {self.platform})", node.loc)

    def kernel_module(self, node: Node) -> str:
        module = node.op.kernels.get(self.platform)
        if module is None:
            raise ModelError(
                f"operator '{node.op.name}' has no kernels for platform {self.platform}", node.loc
            )
        return module

    def stage(self, node: Node | None) -> int:
        return self.pipeline.stage(node.name) if node is not None else 0

    # -- identifiers -------------------------------------------------------------------

    def ident(self, value: Value) -> str:
        return self.names(value.name)

    def grad(self, value: Value) -> str:
        return self.names(f"grad:{value.name}", f"grad_{self.ident(value)}")

    def extra(self, node: Node, name: str) -> str:
        return self.names(f"extra:{node.name}:{name}", f"{self.ident(node.output)}_{name}")

    def kernels(self, node: Node) -> str:
        module = self.kernel_module(node)
        if module not in self.kernel_alias:
            self.kernel_alias[module] = f"K{len(self.kernel_alias) + 1}"
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
            stage=self.stage(node),
        )

    # -- backward ----------------------------------------------------------------------

    def raw_ident(self, key: str) -> str:
        """The identifier of a saved tensor as the forward pass made it."""
        if ":" in key:
            node_name, extra = key.split(":", 1)
            return self.extra(self.node_named[node_name], extra)
        return self.names(key)

    def packed_ident(self, key: str, form: Form) -> str:
        suffix = "bits" if form.kind == "mask" else form.codec.name
        base = self.raw_ident(key)
        return self.names(f"packed:{key}:{form}", f"{base}_{suffix}")

    def restored_ident(self, key: str, form: Form) -> str:
        suffix = "mask" if form.kind == "mask" else "restored"
        return self.names(f"restored:{key}:{form}", f"{self.raw_ident(key)}_{suffix}")

    def saved_expr(self, node: Node, entry: str) -> str:
        found = self.plan.form_for(node, entry)
        if found is not None and found[1].kind != "raw":
            return self.restored_ident(found[0].key, found[1])
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
            if self.platform == "ipu":
                extra_lines.append(f"grads[{p.key!r}] = {ident}")
                reads.append("grads")
            else:
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
            stage=self.stage(node),
        )

    # -- whole methods -----------------------------------------------------------------

    def saved_extras(self, node: Node) -> set[str]:
        if not node.needs_backward:
            return set()
        return {e.name for e in node.extras if e.name in node.op.saved}

    def stash_step(self, stashed: Stashed, blocks: tuple[str, ...]) -> Step:
        """Right after the tensor is made: compress it (once per form) and record the bytes."""
        raw = self.raw_ident(stashed.key)
        lines, writes, packs = [], [], []
        for form in stashed.forms:
            source = raw
            if form.kind == "mask" and form.mask_kernel:
                reader = self.node_named[form.mask_node]
                args = ", ".join(a for a in [raw, kwargs_text(reader.backward_kwargs)] if a)
                source = f"{self.kernels(reader)}.{form.mask_kernel}({args})"
            ident = self.packed_ident(stashed.key, form)
            codec = self.codec_names[form.codec]
            lines.append(f"{ident} = {codec}.compress({source})")
            writes.append(ident)
            packs.append(f"({codec}, {ident})")
        lines.append(f"K.stash(stash, {stashed.key!r}, {raw}, {', '.join(packs)})")
        comment = f"keep {stashed.key} as {' + '.join(f.label() for f in stashed.forms)}"
        return Step(
            "forward",
            lines,
            reads=["stash", raw, *writes],
            writes=writes,
            comment=comment,
            blocks=blocks,
            stage=self.stage(self.graph.nodes[stashed.producer] if stashed.producer >= 0 else None),
        )

    def stash_raw_step(self, entries: list[Stashed]) -> Step:
        """At the end of the forward pass: record what is kept uncompressed."""
        items = ", ".join(f"{s.key!r}: {self.raw_ident(s.key)}" for s in entries)
        return Step(
            "forward",
            [f"K.stash_raw(stash, {{{items}}})"],
            reads=["stash", *(self.raw_ident(s.key) for s in entries)],
            writes=[],
            comment="kept as they are for backward",
            stage=self.pipeline.num_ipus - 1,
        )

    def restore_steps(self, node: Node) -> list[Step]:
        """Right before a backward step: decompress what it reads, unless already done."""
        steps = []
        for stashed, _, form in self.plan.reads_of(node):
            if form.kind == "raw" or (stashed.key, form) in self.restored:
                continue
            ident = self.restored_ident(stashed.key, form)
            self.restored[(stashed.key, form)] = ident
            packed = self.packed_ident(stashed.key, form)
            logical = form.type or stashed.type
            shape = tuple(logical.shape[1:])
            dtype = "torch.bool" if form.kind == "mask" else f"{self.grad(node.output)}.dtype"
            line = (
                f"{ident} = {self.codec_names[form.codec]}.decompress({packed}, {shape!r}, {dtype})"
            )
            steps.append(
                Step(
                    "backward",
                    [line],
                    reads=[packed, self.grad(node.output)],
                    writes=[ident],
                    comment=f"restore {stashed.key}: {form.label()}",
                    stage=self.stage(node),
                )
            )
        return steps

    def training_steps(self) -> list[Step]:
        graph = self.graph
        stash_after: dict[int, list[Stashed]] = {}
        for stashed in self.plan.entries:
            stash_after.setdefault(stashed.producer, []).append(stashed)
        steps = [
            Step(
                "forward",
                ["stash = self.stash_log = []"],
                reads=[],
                writes=["stash"],
                comment="what is kept for backward, with its bytes (stash_report())",
            )
        ]
        if self.platform == "ipu":
            steps.append(
                Step(
                    "forward",
                    ["grads = {}"],
                    reads=[],
                    writes=["grads"],
                    comment="parameter gradients, by state-dict name",
                )
            )

        def compressed(found: list[Stashed]) -> list[Stashed]:
            return [s for s in found if s.forms != [Form("raw")]]

        steps += [self.stash_step(s, ()) for s in compressed(stash_after.get(-1, []))]
        for n in graph.nodes:
            steps.append(self.forward_step(n, self.saved_extras(n)))
            blocks = tuple(b.text for b in n.blocks)
            steps += [self.stash_step(s, blocks) for s in compressed(stash_after.get(n.index, []))]
        raw = [s for s in self.plan.entries if s.forms == [Form("raw")]]
        if raw:
            steps.append(self.stash_raw_step(raw))
        loss = self.ident(graph.loss)
        steps.append(
            Step(
                "backward",
                [f"{self.grad(graph.loss)} = torch.ones_like({loss})"],
                reads=[loss],
                writes=[self.grad(graph.loss)],
                comment="d loss / d loss = 1",
                stage=self.stage(graph.loss.producer),
            )
        )
        owned: dict[int, bool] = {id(graph.loss): True}
        for node in reversed(graph.nodes):
            if node.needs_backward:
                steps += self.restore_steps(node)
                steps.append(self.backward_step(node, owned))
        # A forward step whose output is saved by a backward step must keep it alive:
        # liveness sees the read in the backward step, so nothing more to do here.
        release_dead(steps, keep={loss, "grads"})
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


def render_steps(steps: list[Step], staged: bool = False) -> list[str]:
    """Lines of a method body: block and statement comments, code, and releases.

    With ``staged``, consecutive steps of one pipeline stage go inside
    ``with poptorch.Block(...)`` so PopTorch places them on that stage's IPU.
    """
    lines: list[str] = []
    current_blocks: tuple[str, ...] = ()
    section = ""
    stage = None
    indent = ""
    for step in steps:
        if step.section != section or (staged and step.stage != stage):
            if step.section != section:
                section = step.section
                lines.append("")
                lines.append(f"# ---- {section} " + "-" * 60)
            if staged:
                stage = step.stage
                lines.append(
                    f'with poptorch.Block(user_id="{section}{stage}", ipu_id={stage}):'
                    f"  # IPU {stage}"
                )
                indent = "    "
            current_blocks = ()
        start = len(lines)
        if step.blocks != current_blocks:
            common = 0
            while (
                common < min(len(step.blocks), len(current_blocks))
                and step.blocks[common] == current_blocks[common]
            ):
                common += 1
            for depth, text in enumerate(step.blocks[common:], start=common):
                lines.append(f"# {'  ' * depth}[block] {safe.comment_text(text)}")
            current_blocks = step.blocks
        if step.comment:
            prefix = "  " * len(step.blocks)
            lines.append(f"# {prefix}{safe.comment_text(step.comment)}")
        lines.extend(safe.code(line) for line in step.lines)
        if step.release:
            lines.append(f"del {', '.join(step.release)}")
        lines[start:] = [indent + line if line else line for line in lines[start:]]
    return [safe.Code(line) for line in lines]


def layer_lines(graph: Graph, names: Namer) -> list[tuple[str, str, str]]:
    """(comment, state-dict prefix, constructor) for each node that has parameters."""
    layers = []
    for node in graph.nodes:
        if not (node.params or node.buffers):
            continue
        env = {**node.args, **node.derived}
        ctor = safe.code(node.op.module.format(**{k: literal(v) for k, v in env.items()}))
        layers.append((safe.comment_text(node.text), safe.literal(node.name), ctor))
    return layers


def header_comment(
    graph: Graph, source_path: str, options: Options, config: CompressionConfig
) -> str:
    meta = {
        "generator": __version__,
        "source": source_path,
        "sha256": graph.sha256,
        **options.as_dict(),
    }
    if config.sha256 is not None:
        meta["compress_config_sha256"] = config.sha256
    return HEADER_TAG + json.dumps(meta, sort_keys=False)


def render(
    graph: Graph, source_path: str, options: Options, config: CompressionConfig | None = None
) -> str:
    """The complete generated module, formatted, with header and checksum.

    ``config`` overrides the compression config the options name (tests use it to feed
    configs that no loader would accept, to check the emitter on its own).
    """
    if options.platform not in PLATFORMS:
        raise ValueError(f"unknown platform '{options.platform}' (known: {', '.join(PLATFORMS)})")
    if options.scheme not in SCHEMES:
        raise ValueError(f"unknown scheme '{options.scheme}' (known: {', '.join(SCHEMES)})")
    if config is None:
        config = options.compression()
    plan = plan_stash(graph, config)
    pipeline = None
    if options.platform == "ipu":
        pipeline = split(graph, plan, options.num_ipus, list(options.stage_starts) or None)
    elif options.num_ipus != 1 or options.stage_starts:
        raise ValueError("--num-ipus and stage starts are for the ipu platform")
    emitter = Emitter(graph, plan, options.platform, pipeline)
    staged = pipeline is not None and pipeline.num_ipus > 1
    training = render_steps(emitter.training_steps(), staged)
    predict = render_steps(emitter.predict_steps())
    text = _template(options.platform).render(
        header=safe.comment_text(header_comment(graph, source_path, options, config)),
        codecs=[
            (safe.identifier(name), safe.literal(codec.name), kwargs_text(codec.kwargs))
            for codec, name in emitter.codec_names.items()
        ],
        compression=safe.doc_text(_describe(config)),
        version=safe.doc_text(__version__),
        source_path=safe.doc_text(source_path),
        model_name=safe.doc_text(graph.name),
        platform=safe.doc_text(options.platform),
        scheme=safe.doc_text(options.scheme),
        kernel_imports=[
            (safe.dotted(module), safe.identifier(alias))
            for module, alias in sorted(emitter.kernel_alias.items(), key=lambda kv: kv[1])
        ],
        layers=layer_lines(graph, emitter.names),
        train_args=[safe.identifier(emitter.ident(v)) for v in graph.inputs],
        train_checks=_input_checks(emitter, graph.inputs),
        predict_checks=_input_checks(emitter, graph.model_inputs),
        predict_args=[safe.identifier(emitter.ident(v)) for v in graph.model_inputs],
        training=training,
        predict=predict or [safe.Code("pass")],
        loss=safe.identifier(emitter.ident(graph.loss)),
        preds=[safe.identifier(emitter.ident(v)) for v in graph.preds],
        signature=[safe.doc_text(f"{v.name}: {v.type}") for v in graph.inputs],
        input_specs=safe.literal(
            [
                (v.name, v.kind, v.type.dtype, list(v.type.shape[1:]), _value_range(v))
                for v in graph.inputs
            ]
        ),
        surrogate_groups=[
            (stage, safe.literal(keys)) for stage, keys in _surrogate_groups(graph, pipeline)
        ],
        num_ipus=pipeline.num_ipus if pipeline else 1,
        stages=(
            [(i, safe.doc_text(s)) for i, s in enumerate(["(first node)", *pipeline.starts])]
            if pipeline
            else []
        ),
    )
    text = black.format_str(text, mode=black.Mode(line_length=GENERATED_LINE_LENGTH))
    return add_checksum(text)


def _input_checks(emitter: Emitter, values: list[Value]) -> safe.Code:
    """Arguments of ``K.check_inputs``: (name, tensor, dtype, dims after N) per input."""
    return safe.Code(
        ", ".join(
            f"({safe.literal(v.name)}, {safe.identifier(emitter.ident(v))}, "
            f"{safe.literal(v.type.dtype)}, {safe.literal(tuple(v.type.shape[1:]))})"
            for v in values
        )
    )


def _join(items: list[safe.Code], separator: str = "") -> safe.Code:
    """Jinja's ``join`` for vetted parts: the separator is the template's own text."""
    return safe.Code(separator.join(safe.template_value(item) for item in items))


def _template(platform: str) -> jinja2.Template:
    """The platform's module template, in an environment that emits only vetted text."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(resource_dir("templates"))),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
        trim_blocks=True,
        lstrip_blocks=True,
        finalize=safe.template_value,
    )
    env.filters["join"] = _join
    return env.get_template(f"{platform}/module.py.j2")


def _value_range(value: Value) -> int:
    """For synthetic data: the class count of a cross-entropy target, 1 for a probability."""
    for node, position in value.consumers:
        if node.op.name == "cross_entropy" and position == 1:
            return int(node.inputs[0].type.shape[1])
        if node.op.name in ("bce_loss", "bce_with_logits") and position == 1:
            return 1
    return 0 if value.type.dtype.startswith("f") else 2


def _surrogate_groups(graph: Graph, pipeline: Pipeline | None) -> list[tuple[int, list[str]]]:
    """Parameter keys with gradients, grouped by the pipeline stage that computes them."""
    groups: dict[int, list[str]] = {}
    for node in graph.nodes:
        if node.needs_backward:
            stage = pipeline.stage(node.name) if pipeline else 0
            groups.setdefault(stage, []).extend(p.key for p in node.params if p.present)
    return sorted((k, v) for k, v in groups.items() if v)


def _describe(config: CompressionConfig) -> str:
    if config.default is None and not config.rules:
        parts = ["no compression"]
    else:
        parts = [f"default {config.default.label() if config.default else 'none'}"]
        parts += [
            f"rule{' op=' + repr(r.op) if r.op else ''}{' name=' + repr(r.name) if r.name else ''}: "
            f"{r.codec.label() if r.codec else 'none'}"
            for r in config.rules
        ]
    if config.first_only:
        parts.append("first compressible activation only")
    parts.append("1-bit masks" if config.masks else "no masks")
    return "; ".join(parts)


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
                found = json.loads(line[len(HEADER_TAG) :])
            except (json.JSONDecodeError, RecursionError):
                return None
            return found if isinstance(found, dict) else None
    return None


def edited_by_hand(text: str) -> bool:
    """True when a generated file's body no longer matches the checksum it carries."""
    for line in text.splitlines()[:10]:
        if line.startswith(CHECKSUM_TAG):
            return line[len(CHECKSUM_TAG) :].strip() != body_checksum(text)
    return True


GpuEmitter = Emitter  # the gpu platform's emitter, by its older name
