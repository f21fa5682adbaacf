"""Graph -> step IR -> the platform's Jinja template -> black -> source text.

``render`` resolves the stash plan, checks the options against it and the platform,
has ``unroller.compiler.lower`` lay out the step programs (training step, ``predict()``, pipeline
stages) pass by pass, has ``unroller.compiler.outline`` turn block runs into shared functions,
then fills the platform's template with the rendered lines and formats it with black.
The header records what generated the module, and a checksum of the body lets
``unroll check`` tell a generated file from one edited by hand.
"""

from __future__ import annotations

import functools
import hashlib
import json
import textwrap
from collections.abc import Callable
from typing import Any

import black
import jinja2

from unroller import __version__
from unroller.compiler import safe
from unroller.compiler.dtypes import TORCH_DTYPE_NAMES
from unroller.compiler.graph import Graph, Value, explicit_kwargs
from unroller.compiler.ir import (
    RECOMPUTE_SECTION,
    Assign,
    CallExpr,
    Const,
    Global,
    Return,
    Step,
    render_expr,
    render_steps,
)
from unroller.compiler.lower import Lowering, LoweringContext, PieceLoop, base_name
from unroller.compiler.lower.context import const_kwargs
from unroller.compiler.lower.shards import row_units, shard_units
from unroller.compiler.names import RESERVED
from unroller.compiler.options import PROCESS_STAGES, Options
from unroller.compiler.outline import Function, Outliner
from unroller.compiler.pipeline import (
    Boundary,
    Pipeline,
    boundaries,
    split,
    split_instances,
    stage_inputs,
)
from unroller.compiler.platforms import Platform
from unroller.compiler.platforms import platform as get_platform
from unroller.compiler.precision import DEFAULT as PRECISION_DEFAULT
from unroller.compiler.precision import get as get_precision
from unroller.compiler.schemes import CompressionConfig
from unroller.compiler.stash import StashPlan, plan_stash, wire_codec
from unroller.errors import ModelError
from unroller.resources import resource_dir

HEADER_TAG = "# unroller: "
CHECKSUM_TAG = "# unroller-checksum: "
# Generated code favours one line per step over the 100 columns of hand-written code.
GENERATED_LINE_LENGTH = 120


def render_training(
    steps: list[Step], loops: list[PieceLoop], stage_block: str | None = None
) -> list[safe.Code]:
    """``render_steps`` of the training program, with each segment run in pieces as a
    ``for`` loop: its header step (``zip`` of the pieces) becomes the ``for`` line, the
    steps up to the loop's last one its body, and what the header step releases (the
    whole-batch tensors) is released after the loop."""
    if not loops:
        return render_steps(steps, stage_block)
    where = {id(step): i for i, step in enumerate(steps)}
    lines: list[safe.Code] = []
    start = 0
    for loop in loops:
        header = loop.header
        at, end = where[id(header)], where[id(loop.last)]
        lines += _continued(render_steps(steps[start:at]), start)
        assign = header.statements[0]
        assert isinstance(assign, Assign)
        names = ", ".join(safe.identifier(t.name) for t in assign.targets if t is not None)
        lines.append(safe.Code(f"# {safe.comment_text(header.comment)}"))
        lines.append(safe.Code(f"for {names} in {render_expr(assign.value)}:"))
        body = _continued(render_steps(steps[at + 1 : end + 1]), 1)
        lines += [safe.Code("    " + line if line else line) for line in body]
        if header.release:
            lines.append(safe.Code(f"del {', '.join(map(safe.identifier, header.release))}"))
        start = end + 1
    return lines + _continued(render_steps(steps[start:]), start)


def _continued(lines: list[safe.Code], start: int) -> list[safe.Code]:
    """Lines of a later part of the backward: without the section heading again."""
    if start and len(lines) >= 2 and not lines[0] and lines[1].startswith("# ---- "):
        return lines[2:]
    return lines


def layer_lines(graph: Graph) -> list[tuple[str, str, str]]:
    """(comment, state-dict prefix, constructor) for each node that has parameters.

    The constructor leaves out keywords equal to the registry default, which the registry
    keeps equal to the torch.nn class's own (``torch.nn.Conv2d(3, 64, (3, 3), bias=False)``).
    The layers of a block instance take one comment, the block call, above the first: each
    line names its layer (``"layer1.0.conv1"``) and the block's statements are shown once,
    in its functions; the comment is "" for the others.
    """
    layers = []
    instance = None
    for node in graph.nodes:
        if not (node.params or node.buffers) or node.shares:  # shares: its layer is made
            continue
        spec = node.op.module
        env = {**node.args, **node.derived}
        kwargs = explicit_kwargs(node.op, {k: env[k] for k in spec.kwargs})
        ctor = CallExpr(
            Global(spec.cls),
            tuple(Const(env[a]) for a in spec.args),
            const_kwargs({**kwargs, **dict(spec.fixed)}),
        )
        comment = node.text
        if node.blocks:
            comment = "" if node.blocks[0] is instance else f"[block] {node.blocks[0].text}"
        instance = node.blocks[0] if node.blocks else None
        layers.append(
            (safe.comment_text(comment), safe.literal(node.name), safe.code(render_expr(ctor)))
        )
    return layers


def tie_lines(graph: Graph) -> list[tuple[str, str, str]]:
    """(comment, tied parameter's key, the key of the tensor it is) for each tie
    (``tied_PARAM=``), made after every layer exists."""
    return [
        (
            safe.comment_text(f"{node.name}.{name} is {key}"),
            safe.literal(f"{node.name}.{name}"),
            safe.literal(key),
        )
        for node in graph.nodes
        if not node.shares  # its layer's ties, made once
        for name, key in node.ties.items()
    ]


def frozen_lines(graph: Graph) -> list[tuple[str, str]]:
    """(comment, key) for each frozen parameter (``frozen=true``): requires_grad off."""
    return [
        (safe.comment_text(f"{p.key} does not train"), safe.literal(p.key))
        for node in graph.nodes
        if not node.shares  # its layer's parameters, frozen once
        for p in node.params
        if p.present and not p.trainable
    ]


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
    graph: Graph,
    source_path: str,
    options: Options,
    config: CompressionConfig,
    readable: bool = True,
) -> str:
    """The complete generated module, formatted, with header and checksum.

    A pure function of its arguments: ``config`` is already resolved (a config file read,
    the ``auto`` scheme planned: ``unroller.api.compression_config``), so rendering never
    runs a model, reads a file or imports the planner. ``options`` says the platform,
    pipeline and what the header records (tests pass configs no loader would accept, to
    check the lowering on its own). ``readable=False``: not formatted by black, for a
    module only run, never read (verify's and the planner's probe modules): the same
    statements, and black is most of a render's time.
    """
    if graph.precision != options.precision:
        raise ValueError(
            f"the graph was built for precision {graph.precision!r} and the options say "
            f"{options.precision!r}: build it with precision={options.precision!r} "
            "(unroller.api.graph_from_text, load_graph)"
        )
    target = get_platform(options.platform)
    plan = plan_stash(graph, config, options.segment_pieces, options.segment_piece_size)
    _check_pieces(plan, target, options)
    pipeline = _split_stages(graph, plan, target, options)
    staged = pipeline is not None and pipeline.num_ipus > 1
    _check_staged(plan, target, options, staged)
    lowering = Lowering(
        graph,
        plan,
        target,
        pipeline,
        options.data_parallel,
        options.bucket_bytes,
        update_in_backward=options.update_in_backward,
        shard=options.shard,
    )
    programs = _programs(lowering, options, pipeline, target.stage_block if staged else None)
    text = _template(target).render(
        **_module_view(graph, lowering.context, source_path, options, config, plan),
        **programs,
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
    return add_checksum(formatted(text, black.format_str) if readable else text)


def _programs(
    lowering: Lowering, options: Options, pipeline: Pipeline | None, stage_block: str | None
) -> dict[str, Any]:
    """The template's fields of the step programs: the training step's and ``predict()``'s
    lines, the block functions, and with ``--pipeline`` each stage's generator."""
    ctx, graph = lowering.context, lowering.graph
    training_steps, predict_steps = lowering.training_steps(), lowering.predict_steps()
    outliner = _outliner(ctx, 2 if options.pipeline != 1 else 1)
    training_steps = outliner.outline(training_steps, lowering.training_keep())
    predict_steps = outliner.outline(predict_steps, lowering.predict_keep(), predict=True)
    for step in training_steps:  # a segment's recompute is part of the backward
        if step.section == RECOMPUTE_SECTION:
            step.section = "backward"
    stage_steps: list[list[Step]] = []
    if options.pipeline != 1 and pipeline is not None:
        crossing = boundaries(graph, pipeline)
        split_up = frozenset(split_instances(graph, pipeline))
        for k in range(pipeline.num_ipus):
            program = lowering.stage_program(k, crossing)
            stage_steps.append(outliner.outline(program, {"stash", "L"}, split=split_up))
    outliner.finish()  # every call known: literals that differ become parameters
    loops = [  # a loop's last step may be a block's, now run by the block's call
        PieceLoop(outliner.stand_in(loop.header), outliner.stand_in(loop.last), loop.segment)
        for loop in lowering.piece_loops
    ]
    process_stages: list[dict[str, Any]] = []
    pipeline_meta: dict[str, safe.Code] = {}
    if stage_steps and pipeline is not None:
        for k, steps in enumerate(stage_steps):
            process_stages.append(_stage_view(ctx, graph, pipeline, crossing, k, steps))
        pipeline_meta = _pipeline_meta(graph, ctx.plan.config, pipeline, crossing)
    recomputed = {s.segment.name for s in ctx.plan.segments}
    selective = {s.segment.name for s in ctx.plan.segments if s.segment.kept}
    return dict(
        functions=[_function_view(f, recomputed, selective) for f in outliner.functions],
        training=render_training(training_steps, loops, stage_block),
        predict=render_steps(predict_steps) or [safe.Code("pass")],
        process_stages=process_stages,
        pipeline_meta=pipeline_meta,
    )


def _outliner(ctx: LoweringContext, programs: int = 1) -> Outliner:
    """Turns block runs into shared functions, with names no model name can take
    (``programs``: how many step programs share them; each may need its own variant of
    a block's function, as the stages of ``--pipeline`` keep different forms)."""

    def global_name(key: tuple[str, ...], base: str) -> str:
        return ctx.names("\0".join(key), base or base_name(key))

    reserved = RESERVED | set(ctx.codec_names.values()) | set(ctx.kernel_alias.values())
    outliner = Outliner(ctx.key_of, base_name, global_name, frozenset(reserved))
    counts: dict[str, int] = {}
    seen: set[str] = set()
    for node in ctx.graph.nodes:
        if node.blocks and node.blocks[0].name not in seen:
            seen.add(node.blocks[0].name)
            counts[node.blocks[0].block] = counts.get(node.blocks[0].block, 0) + programs
    # a recompute function's name is claimed only when a segment is recomputed, so
    # that every other module keeps the names it always had
    extra = (RECOMPUTE_SECTION,) if ctx.plan.segments else ()
    outliner.reserve(sorted(counts), counts, extra)
    return outliner


def _config_name(options: Options) -> str:
    """The compression config as a message names it: its file, or the scheme."""
    if options.compress_config:
        return f"--compress-config {safe.comment_text(options.compress_config)}"
    return f"--scheme {options.scheme}"


def _pieces_source(options: Options) -> str:
    """What asked for segments in pieces, as the user wrote it."""
    if options.segment_pieces != 1:
        return f"--segment-pieces {options.segment_pieces}"
    if options.segment_piece_size:
        return f"--segment-piece-size {options.segment_piece_size}"
    return f"segment_piece_size of {_config_name(options)}"


def _segments_source(options: Options) -> str:
    """What asked for segment recompute, as the user wrote it."""
    if options.recompute_segments:
        return f"--recompute-segments {safe.comment_text(','.join(options.recompute_segments))}"
    return f"recompute_segments of {_config_name(options)}"


def _check_pieces(plan: StashPlan, target: Platform, options: Options) -> None:
    """Refuse a segment in pieces where pieces cannot run: a platform whose gradients do
    not accumulate into ``.grad`` (pieces add into it), or ``--data-parallel`` (whose
    buckets are all-reduced as the backward makes them). The error points at the
    segment's block call and names the option that asked for pieces."""
    pieced = next((s for s in plan.segments if s.in_pieces), None)
    if pieced is None:
        return
    asked = f"segment '{pieced.name}' in {pieced.pieces_text()} ({_pieces_source(options)})"
    if target.grads != "accumulate" or target.pipelined:
        raise ModelError(
            f"{asked}: not for --platform {target.name} (pieces add into .grad)", pieced.call.loc
        )
    if options.data_parallel:
        raise ModelError(f"{asked}: does not combine with --data-parallel yet", pieced.call.loc)


def _check_staged(plan: StashPlan, target: Platform, options: Options, staged: bool) -> None:
    """Refuse segment recompute, and ``--recompute`` under ``--pipeline``, where the step
    is split into stages; the error points at the first statement concerned and names
    both options."""
    stages = (
        f"--num-ipus {options.num_ipus}" if target.pipelined else f"--pipeline {options.pipeline}"
    )
    if plan.segments and staged:
        first = plan.segments[0]
        raise ModelError(
            f"segment '{first.name}' ({_segments_source(options)}): segment recompute is not "
            f"available with more than one pipeline stage ({stages})",
            first.call.loc,
        )
    if options.pipeline == 1 or not staged:
        return
    remade = [(s, n) for s in plan.entries for n, _, f in s.readers if f.kind == "recompute"]
    if remade:
        stashed, node = remade[0]
        source = "--recompute" if options.recompute else f"recompute of {_config_name(options)}"
        raise ModelError(
            f"the backward of '{node.name}' reads '{stashed.key}' remade ({source}): not "
            f"available with {stages}",
            node.loc,
        )


def _split_stages(
    graph: Graph, plan: StashPlan, target: Platform, options: Options
) -> Pipeline | None:
    """The model's pipeline stages: over IPUs for a pipelined platform (``--num-ipus``), over
    processes for ``--pipeline``; None when neither applies. Which platform takes which is
    ``Options``'s own check, made when the options were built."""
    pipeline = None
    starts = list(options.stage_starts) or None
    if target.pipelined:
        pipeline = split(graph, plan, options.num_ipus, starts)
    if options.pipeline != 1:
        pipeline = split(
            graph, plan, options.pipeline, starts, PROCESS_STAGES, "--pipeline", loss_last=True
        )
    return pipeline


def _module_view(
    graph: Graph,
    ctx: LoweringContext,
    source_path: str,
    options: Options,
    config: CompressionConfig,
    plan: StashPlan,
) -> dict[str, Any]:
    """The template's fields that describe the module as a whole: header, imports,
    layers, the inputs' names and checks, the loss and predictions."""
    return dict(
        header=safe.comment_text(header_comment(graph, source_path, options, config)),
        codecs=[
            (safe.identifier(name), safe.literal(codec.name), safe.kwargs(codec.kwargs))
            for codec, name in ctx.codec_names.items()
        ],
        compression=safe.doc_text(_describe(config) + _segments_note(plan) + _remade_note(plan)),
        version=safe.doc_text(__version__),
        source_path=safe.doc_text(source_path),
        model_name=safe.doc_text(graph.name),
        platform=safe.doc_text(ctx.platform.name),
        scheme=safe.doc_text(options.scheme),
        kernel_imports=[
            (safe.dotted(module), safe.identifier(alias))
            for module, alias in sorted(ctx.kernel_alias.items(), key=lambda kv: kv[1])
        ],
        layers=layer_lines(graph),
        ties=tie_lines(graph),
        frozen=frozen_lines(graph),
        train_args=[safe.identifier(ctx.var(v).name) for v in graph.inputs],
        train_targets=_targets([safe.identifier(ctx.var(v).name) for v in graph.inputs]),
        train_checks=_input_checks(ctx, graph.inputs),
        predict_checks=_input_checks(ctx, graph.model_inputs),
        predict_args=[safe.identifier(ctx.var(v).name) for v in graph.model_inputs],
        predict_targets=_targets([safe.identifier(ctx.var(v).name) for v in graph.model_inputs]),
        loss=safe.identifier(ctx.var(graph.loss).name),
        updates_in_backward=ctx.update_in_backward,
        shard_units=safe.literal(shard_units(graph)) if ctx.shard else None,
        row_units=safe.literal(row_units(graph)) if ctx.shard else None,
        preds=[safe.identifier(ctx.var(v).name) for v in graph.preds],
        signature=[safe.doc_text(f"{v.name}: {v.type}") for v in graph.inputs],
        **_precision_view(graph),
        input_specs=safe.literal(
            [
                (v.name, v.kind, v.type.dtype, list(v.type.shape[1:]), value_range(v))
                for v in graph.inputs
            ]
        ),
    )


GENERATED_DOC_WIDTH = 88
"""The width a generated docstring's own lines are wrapped to (black leaves docstrings)."""


def _targets(names: list[safe.Code]) -> safe.Code:
    """Assignment targets for these names: ``a, b`` (or ``(a,)`` for one)."""
    if not names:
        return safe.Code("")
    return safe.Code(f"({names[0]},)" if len(names) == 1 else ", ".join(names))


def _precision_view(graph: Graph) -> dict[str, Any]:
    """The template's fields of ``--precision``: its name and line for the docstring (none
    for fp32), the low dtype of a mixed one (``K.run_step`` takes it, and the step a
    GradScaler), and the dtype a plain low one moves the parameters to."""
    chosen = get_precision(graph.precision)
    if chosen.name == PRECISION_DEFAULT:
        return dict(precision=None, precision_low=None, precision_params=None)

    def torch_name(dtype: str | None) -> safe.Code | None:
        return safe.dotted(f"torch.{TORCH_DTYPE_NAMES[dtype]}") if dtype else None

    lines = textwrap.wrap(f"Precision: {chosen.name}: {chosen.doc}.", GENERATED_DOC_WIDTH)
    return dict(
        precision=[safe.doc_text(line) for line in lines],
        precision_low=torch_name(chosen.low),
        precision_params=torch_name(chosen.dtype),
    )


@functools.lru_cache(maxsize=128)
def formatted(text: str, format_str: Callable[..., str]) -> str:
    """black's formatting of a rendered module, remembered: black takes ~80% of a render
    (0.7 s for a ResNet), and one process often renders the same text again (``unroll
    check`` after generate, the benchmark harness, the tests). Keyed by the formatter too,
    so a stand-in formatter (the fuzz tests') never serves or poisons black's results."""
    return format_str(text, mode=black.Mode(line_length=GENERATED_LINE_LENGTH))


def _stage_view(
    ctx: LoweringContext,
    graph: Graph,
    pipeline: Pipeline,
    crossing: list[Boundary],
    stage: int,
    steps: list[Step],
) -> dict[str, Any]:
    """One stage generator for the template: arguments, docstring and the lines of its
    forward, exchange (``yield``), backward and ``return``."""
    cut = next(i for i, s in enumerate(steps) if s.section == "exchange")
    args = [ctx.var(v).name for v in stage_inputs(graph, pipeline, stage)]
    args += [ctx.var(b.value).name for b in crossing if stage in b.targets]
    nodes = [n.name for n in graph.nodes if pipeline.stage(n.name) == stage]
    doc = (
        f"Pipeline stage {stage} of {pipeline.num_ipus}: {nodes[0]} .. {nodes[-1]}, "
        f"{len(nodes)} statement{'s' if len(nodes) != 1 else ''}. A generator: "
        "unroller.parallel.pipeline runs it."
    )
    backward = render_steps(steps[cut + 1 : -1])
    return {
        "index": stage,
        "args": [safe.identifier(a) for a in args],
        "doc": safe.doc_text(doc),
        "forward": render_steps(steps[:cut]) or [safe.Code("pass")],
        "exchange": _plain_lines(steps[cut]),
        "backward": backward or [safe.Code("pass")],
        "ret": _plain_lines(steps[-1]),
    }


def _plain_lines(step: Step) -> list[safe.Code]:
    """A top-level step as lines of its own: comment, code, releases."""
    lines = [f"# {safe.comment_text(step.comment)}", *step.text()]
    if step.release and not isinstance(step.statements[-1], Return):
        lines.append(f"del {', '.join(safe.identifier(name) for name in step.release)}")
    return [safe.Code(line) for line in lines]


def _pipeline_meta(
    graph: Graph, config: CompressionConfig, pipeline: Pipeline, crossing: list[Boundary]
) -> dict[str, safe.Code]:
    """What the pipeline driver needs to know, as literals: per stage the positions of the
    model inputs its generator takes (in the step's order); per boundary value (name, the
    stage that makes it, the stages that read it, shape ("N": the batch), dtype, whether a
    gradient flows back, the codec it and its gradient travel in: (name, ((parameter,
    value), ...)), None for raw)."""
    rows = []
    for b in crossing:
        readers = [n for n, _ in b.value.consumers if pipeline.stage(n.name) != b.source]
        codec = wire_codec(graph, config, b.value, readers)
        rows.append(
            (
                b.value.name,
                b.source,
                tuple(b.targets),
                tuple(b.value.type.shape),
                b.value.type.dtype,
                b.grad,
                (codec.name, codec.params) if codec is not None else None,
            )
        )
    k = pipeline.num_ipus
    return {
        "stages": safe.literal(k),
        "inputs": safe.literal(
            [
                tuple(graph.inputs.index(v) for v in stage_inputs(graph, pipeline, i))
                for i in range(k)
            ]
        ),
        "boundaries": safe.literal(rows),
    }


def _function_view(
    function: Function, recomputed: set[str] = frozenset(), selective: set[str] = frozenset()
) -> tuple[safe.Code, list[safe.Code], safe.Code, list]:
    """(name, parameters, docstring, body lines) of one block function, for the template;
    ``recomputed``: the block instances recomputed in the backward (segment recompute),
    ``selective`` those of them with kept statements (``segment_keep``)."""
    shown = function.instances[:4]
    more = len(function.instances) - len(shown)
    where = ", ".join(shown) + (f" and {more} more" if more else "")
    if function.section == RECOMPUTE_SECTION:
        doc = (
            f"Forward of block `{function.block}` again, where its backward begins (segment "
            f"recompute), for {where}: from its kept inputs, keeping its stash as the "
            "forward does without recompute."
        )
    else:
        what = {"forward": "Forward", "backward": "Backward", "predict": "Prediction"}
        doc = f"{what[function.section]} of block `{function.block}`, for {where}."
        if function.section == "forward" and set(function.instances) <= selective:
            doc += (
                " Keeps for its own backward only what its kept statements make (selective "
                "recompute): the recompute remakes the rest from those and its inputs."
            )
        elif function.section == "forward" and set(function.instances) <= recomputed:
            doc += " Keeps nothing for its own backward: that recomputes it from its inputs."
    return (
        safe.identifier(function.name),
        [safe.identifier(p) for p in function.signature()],
        safe.doc_text(doc),
        function.body,
    )


def _input_checks(ctx: LoweringContext, values: list[Value]) -> safe.Code:
    """Arguments of ``K.check_inputs``: (name, tensor, dtype, dims after N) per input."""
    return safe.Code(
        ", ".join(
            f"({safe.literal(v.name)}, {safe.identifier(ctx.var(v).name)}, "
            f"{safe.literal(v.type.dtype)}, {safe.literal(tuple(v.type.shape[1:]))})"
            for v in values
        )
    )


def _join(items: list[safe.Code], separator: str = "") -> safe.Code:
    """Jinja's ``join`` for vetted parts: the separator is the template's own text."""
    return safe.Code(separator.join(safe.template_value(item) for item in items))


@functools.cache
def _template(platform: Platform) -> jinja2.Template:
    """The platform's module template, in an environment that emits only vetted text
    (compiled once per platform and process: compiling took ~10% of a render)."""
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
    return env.get_template(platform.template)


def value_range(value: Value) -> int:
    """For synthetic data: the class count of a loss's class-index target, 1 for a
    probability (registry ``target``, which verify's inputs read too)."""
    for node, position in value.consumers:
        if node.op.target == "classes" and position == 1:
            return int(node.inputs[0].type.shape[1])
        if node.op.target == "probabilities" and position == 1:
            return 1
    return 0 if value.type.dtype.startswith("f") else 2


def _surrogate_groups(graph: Graph, pipeline: Pipeline | None) -> list[tuple[int, list[str]]]:
    """Parameter keys with gradients, grouped by the pipeline stage that computes them."""
    groups: dict[int, list[str]] = {}
    for node in graph.nodes:
        # a shared layer's gradients are collected under its keys: one term per key
        if node.needs_backward and not node.shares:
            stage = pipeline.stage(node.name) if pipeline else 0
            groups.setdefault(stage, []).extend(p.key for p in node.params if p.present)
    return sorted((k, v) for k, v in groups.items() if v)


def _segments_note(plan: StashPlan) -> str:
    """The docstring's words on segment recompute ("" without it)."""
    if not plan.segments and not plan.config.segments:
        return ""
    names = [s.name for s in plan.segments]
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    note = f"; blocks recomputed in the backward: {shown or 'none'}"
    if plan.skipped_segments:
        note += f" ({len(plan.skipped_segments)} not recomputable: see unroll graph)"
    pieced = [s for s in plan.segments if s.in_pieces]
    if pieced:
        runs = "recompute and backward" if pieced[0].kept else "forward, recompute and backward"
        note += f", {len(pieced)} of them run in {pieced[0].pieces_text()} ({runs})"
    if plan.unpieced_segments:
        note += f" ({len(plan.unpieced_segments)} whole: see unroll graph)"
    kept = sum(len(s.kept) for s in plan.segments)
    if kept:
        note += (
            f"; {kept} of their statements kept by the forward, not run again (selective "
            "recompute)"
        )
    return note


def _remade_note(plan: StashPlan) -> str:
    """The docstring's words on ``recompute`` ("" without it): how many saved tensors the
    backward remakes, and which the config keeps instead (``recompute_keep``: where
    remaking would raise the step's peak)."""
    if not plan.config.recompute:
        return ""
    remade = sum(1 for s in plan.entries if any(f.kind == "recompute" for f in s.forms))
    note = f"; cheap ops' outputs remade in the backward: {remade}"
    keep = plan.config.recompute_keep
    if keep == ("*",):
        note += " (remaking any would raise the peak: all kept)"
    elif keep:
        shown = ", ".join(keep[:6]) + (f" and {len(keep) - 6} more" if len(keep) > 6 else "")
        note += f" (kept instead, as remaking would raise the peak: {shown})"
    return note


def _describe(config: CompressionConfig) -> str:
    tensor_rules = [r for r in config.rules if r.tensor is not None]
    if config.default is None and not config.rules:
        parts = ["no compression"]
    elif len(tensor_rules) == len(config.rules) and config.default is None:
        counts: dict[str, int] = {}
        for rule in tensor_rules:
            label = rule.codec.label() if rule.codec else "none"
            counts[label] = counts.get(label, 0) + 1
        parts = [f"{len(tensor_rules)} tensors by name"]
        parts += [f"{n} as {label}" for label, n in counts.items()]
        parts.append("the rest raw")
    else:
        parts = [f"default {config.default.label() if config.default else 'none'}"]
        parts += [
            f"rule{' op=' + repr(r.op) if r.op else ''}{' name=' + repr(r.name) if r.name else ''}"
            f"{' tensor=' + repr(r.tensor) if r.tensor else ''}: "
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
