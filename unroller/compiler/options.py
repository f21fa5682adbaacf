"""What besides the model text determines a generated module: platform, scheme or config
file, recompute, segments and their pieces, parallelism.

``Options`` is declared once: each field's metadata (``option``) holds its flag and help
text, from which the command line builds its shared options (``unroller.cli.options``);
its header record (``as_dict``, read back by ``from_header`` so that ``unroll check``
regenerates the same file) follows the fields' order. Every constructor path
(``Options(...)``, ``dataclasses.replace``, ``from_header``) validates: a value or a
combination the generator cannot honour is an ``OptionValueError`` naming the field, so a
library caller gets the command line's refusal, with its own argument names."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from unroller.compiler.graph import Graph
from unroller.compiler.platforms import PLATFORMS
from unroller.compiler.precision import NAMES as PRECISION_NAMES
from unroller.compiler.schemes import AUTO, SCHEMES, CompressionConfig, resolve
from unroller.compiler.stash import SEGMENT_AUTO
from unroller.errors import ConfigError, OptionValueError

MAX_SEGMENT_PIECES = 4096
"""The most pieces ``--segment-pieces`` takes (a piece of one sample at batch 4096), and
the largest ``--segment-piece-size``."""

PROCESS_STAGES = (2, 3, 4, 5, 6, 7, 8)
"""The process counts ``--pipeline`` accepts besides 1 (their stages split by ``pipeline.split``)."""

SEGMENT_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.*?[]!-")
"""What a segment pattern may hold: a block instance name or glob (as a config's globs)."""

MAX_SEGMENT_NAME = 200  # characters of one segment pattern
MAX_SEGMENTS = 1000  # segment patterns (as a config's rules)
MAX_RESOLUTION = 65536  # rows of an image input
#: ``--max-time-ratio``: its default (``search.AUTO_TIME_RATIO`` says it again, for the
#: library's callers) and the range taken (1: no slower than the uncompressed step)
DEFAULT_TIME_RATIO = 1.2
MIN_TIME_RATIO, MAX_TIME_RATIO = 1.0, 100.0
MAX_BUCKET_BYTES = 2**40  # bytes of one data-parallel gradient bucket
MAX_PATH = 4096  # characters of a compression config's path

#: tuples; lists taken, headers' lists
LIST_FIELDS = ("stage_starts", "recompute_segments", "segment_keep")

#: Header keys that are not options: what the generator records about the source.
HEADER_ONLY = ("generator", "source", "sha256", "compress_config_sha256")


def _platforms_help() -> str:
    return "; ".join(f"{p.name}: {p.summary}" for p in PLATFORMS.values()) + "."


def _stages_help() -> str:
    """Which platforms pipeline, and the stage counts each accepts."""
    pipelined = [p for p in PLATFORMS.values() if p.pipelined]
    counts = "; ".join(f"{p.name}: {', '.join(map(str, p.stage_counts))}" for p in pipelined)
    return f"Pipeline stages, one per device ({counts})."


def option(
    default: Any = dataclasses.MISSING,
    *,
    flag: str | None,
    help: str = "",
    short: str | None = None,
    metavar: str | None = None,
    recorded: bool = False,
    factory: Callable[[], Any] | None = None,
) -> Any:
    """A field of ``Options`` with what the command line and the header need of it:
    ``flag`` (None: no command-line option), its ``help`` text, a ``short`` flag and a
    ``metavar``; ``recorded``: in every header, not only when it differs from the default.
    The header key is the field's name."""
    metadata = {"flag": flag, "help": help, "short": short, "metavar": metavar}
    metadata["recorded"] = recorded
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class Options:
    """Everything besides the model text that determines the generated file. Frozen, so
    that what was validated stays valid: a changed copy is ``dataclasses.replace``, which
    validates again."""

    platform: str = option(
        "gpu", flag="--platform", short="-p", recorded=True, help=_platforms_help()
    )
    scheme: str = option("nocompress", flag="--scheme", recorded=True, help="Compression scheme.")
    #: a TOML file; replaces the scheme's rules
    compress_config: str | None = option(
        None,
        flag="--compress-config",
        help="TOML file with a default and rules (replaces the scheme's).",
    )
    opt_level: int = option(1, flag="--opt-level", help="0: no compression and no masks.")
    #: ipu: pipeline stages, one per IPU
    num_ipus: int = option(1, flag="--num-ipus", help=_stages_help())
    #: ipu (or --pipeline): first node of each stage after the first
    stage_starts: tuple[str, ...] = option(
        (),
        flag="--stage-starts",
        help="Pipelined platforms: comma-separated first node of each stage after the first "
        "(default: balance parameter + stashed bytes).",
    )
    #: image inputs resized to this many rows (benchmarks)
    resolution: int | None = option(
        None,
        flag="--resolution",
        help="Rewrite the model's image inputs and targets to R rows (as unroll bench).",
    )
    #: remake cheap ops' outputs in the backward (stash.plan_recompute)
    recompute: bool = option(
        False,
        flag="--recompute",
        help="Remake the outputs of cheap ops (activations, pooling, resampling, concat, batch "
        "norm) in the backward from what is kept anyway, instead of keeping them.",
    )
    #: block instances re-run in the backward (stash.plan_segments): "blocks", globs on
    #: instance names, or "auto" (the planner's choice, with the auto scheme)
    recompute_segments: tuple[str, ...] = option(
        (),
        flag="--recompute-segments",
        metavar="blocks|auto|NAMES",
        help="Segment recompute: these top-level block instances keep only their inputs "
        "from the forward (compressed as the scheme compresses them) and run their forward "
        "again when their backward begins. 'blocks': every one that can be; NAMES: "
        "comma-separated instance names or globs ('layers.*'); 'auto': the planner chooses "
        "(--scheme auto, unroll plan).",
    )
    #: recomputed segments run their recompute and backward in this many pieces of the
    #: batch where they can (stash.plan_pieces); 1: whole
    segment_pieces: int = option(
        1,
        flag="--segment-pieces",
        metavar="K",
        help="With --recompute-segments: each recomputed segment runs its recompute and "
        "backward in K pieces of the batch, one at a time, so that their working memory is "
        "a piece's (segments holding an op that couples the batch, batch norm, stay whole; "
        "unroll graph says which). 1: whole.",
    )
    #: or, when not 0, in pieces of at most this many samples (``split``), whatever the batch
    segment_piece_size: int = option(
        0,
        flag="--segment-piece-size",
        metavar="P",
        help="With --recompute-segments, instead of --segment-pieces: pieces of at most P "
        "samples, whatever the batch, so that a segment's working memory is the same at "
        "every batch size (what each extra sample costs is then its kept inputs and "
        "gradients). 0: by --segment-pieces.",
    )
    #: selective segment recompute (stash.kept_statement): statements of the recomputed
    #: segments not run again, "matmuls" or globs on node names
    segment_keep: tuple[str, ...] = option(
        (),
        flag="--segment-keep",
        metavar="matmuls|NAMES",
        help="With --recompute-segments: these statements of the recomputed segments are "
        "not run again; the forward keeps what they make (as the scheme compresses it) and "
        "the recompute starts from it, remaking only the cheap statements between them. "
        "'matmuls': every matrix product (linear layers, convolutions, attention); NAMES: "
        "comma-separated node names or globs ('layers.*.self_attn').",
    )
    #: the auto scheme: the least bytes per sample whose predicted step time is at most
    #: this many times the uncompressed step's (unroller.analysis.search)
    max_time_ratio: float = option(
        DEFAULT_TIME_RATIO,
        flag="--max-time-ratio",
        metavar="R",
        help="--scheme auto: choose, among compressed forms, --recompute, segment recompute "
        "and pieces, the plan with the least memory per sample whose predicted step takes at "
        "most R times the uncompressed step's time (1.2: at most 20% slower).",
    )
    #: all-reduce gradient buckets in the backward (distributed.py)
    data_parallel: bool = option(
        False,
        flag="--data-parallel",
        help="gpu: all-reduce gradient buckets during the backward (unroller.parallel.data); "
        "the file still trains in one process.",
    )
    #: the optimizer step inside the backward (unroller.training.in_backward)
    update_in_backward: bool = option(
        False,
        flag="--update-in-backward",
        help="gpu: after the backward statement that makes a parameter's gradient final, "
        "hand it to the optimizer attached to the module (unroller.training.in_backward), "
        "which updates the parameter and frees the gradient, so the gradients of the whole "
        "network are never alive at once; with none attached the file trains as usual.",
    )
    #: sharded data parallel over FSDP2 (unroller.parallel.shard)
    shard: bool = option(
        False,
        flag="--shard",
        help="gpu: gather each top-level block instance's parameters before its statements "
        "and release them after, and reduce-scatter each gradient once final, for a model "
        "whose blocks unroller.parallel.shard.attach shards with FSDP2's fully_shard; "
        "without a mesh attached the file trains as usual in one process.",
    )
    #: data parallel: bucket size (None: BUCKET_BYTES, 25 MiB); not a command-line option
    bucket_bytes: int | None = option(None, flag=None)
    #: gpu: stages over processes (unroller.parallel.pipeline); 1: none
    pipeline: int = option(
        1,
        flag="--pipeline",
        help="gpu: also emit one generator per pipeline stage, for that many processes "
        "(unroller.parallel.pipeline; stages split by --stage-starts or balanced); the file "
        "still trains in one process. 1: none.",
    )
    #: the dtypes the step computes in (unroller.compiler.precision)
    precision: str = option(
        "fp32",
        flag="--precision",
        metavar="|".join(PRECISION_NAMES),
        help="fp32; bf16-mixed / fp16-mixed: torch.autocast's policy with every cast written "
        "out (float32 parameters and gradients; matmuls, convolutions and attention in the low "
        "dtype; softmax, norms and losses in float32; fp16-mixed takes a GradScaler); bf16 / "
        "fp16: parameters, activations and gradients in that dtype.",
    )
    #: header keys this version does not know, recorded again as they were
    extra: dict[str, Any] = option(flag=None, factory=dict)

    def __post_init__(self) -> None:
        validate(self)

    def as_dict(self) -> dict[str, Any]:
        """What the header records, so `unroll check` can regenerate the same file: the
        fields in their order, each only where it differs from its default (platform and
        scheme always), then ``extra``."""
        found: dict[str, Any] = {}
        for f in OPTION_FIELDS:
            value = getattr(self, f.name)
            if f.metadata["recorded"] or value != f.default:
                found[f.name] = list(value) if isinstance(value, tuple) else value
        return {**found, **self.extra}

    @classmethod
    def from_header(cls, header: dict[str, Any]) -> Options:
        """The options a header records; ``OptionValueError`` when it records one that
        ``Options`` refuses (``render("header")`` names its key)."""
        values: dict[str, Any] = {}
        for f in OPTION_FIELDS:
            if f.name in header:
                value = header[f.name]
                listed = f.name in LIST_FIELDS and isinstance(value, list)
                values[f.name] = tuple(value) if listed else value
        known = {*HEADER_ONLY, *(f.name for f in OPTION_FIELDS)}
        return cls(**values, extra={k: v for k, v in header.items() if k not in known})

    @property
    def planned(self) -> bool:
        """Does the ``auto`` scheme plan the config per model (``search.auto_config``)?"""
        return self.scheme == AUTO and self.compress_config is None and self.opt_level == 1

    def compression(self, graph: Graph | None = None) -> CompressionConfig:
        """The compression config of a built-in scheme or config file, with ``recompute``
        and the named segments folded in. The ``auto`` scheme is planned per model by the
        library layer (``unroller.api.compression_config``), never here: generation stays a
        pure function of the graph and a resolved config, and codegen never imports the
        planner. ``graph`` is accepted (and unused) so callers can resolve any scheme alike.
        """
        if self.planned:
            raise ConfigError(
                "the auto scheme is planned per model: "
                "unroller.api.compression_config(options, graph)"
            )
        config = self.with_flags(resolve(self.scheme, self.compress_config, self.opt_level))
        extra = tuple(s for s in self.recompute_segments if s not in config.segments)
        kept = tuple(s for s in self.segment_keep if s not in config.segment_keep)
        if not extra and not kept:
            return config
        return dataclasses.replace(
            config, segments=config.segments + extra, segment_keep=config.segment_keep + kept
        )

    def with_flags(self, config: CompressionConfig) -> CompressionConfig:
        """``config`` with ``--recompute`` applied: a planned config gets it too (its
        segments are the planner's, so named segments are folded in by ``compression``)."""
        if self.recompute and not config.recompute:
            return dataclasses.replace(config, recompute=True)
        return config


#: The fields that are options (recorded in headers), in their order: all but ``extra``.
OPTION_FIELDS = tuple(f for f in dataclasses.fields(Options) if f.name != "extra")

#: Each option's flag as typed on the command line (``--segment-pieces``); a field that is
#: no command-line option gets the flag it would have.
FLAGS = {f.name: f.metadata["flag"] or "--" + f.name.replace("_", "-") for f in OPTION_FIELDS}


def refused(name: str, template: str, options: Any = None, **values: Any) -> OptionValueError:
    """The error blaming field ``name``: ``template`` with the values of ``options``'s
    fields and ``values`` (see ``OptionValueError``)."""
    found = {f.name: getattr(options, f.name) for f in OPTION_FIELDS} if options else {}
    return OptionValueError(name, template, {**found, **values}, FLAGS)


def _whole(value: Any) -> bool:
    """An ``int`` and not a ``bool`` (True is no number of pieces)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _counts(allowed: tuple[int, ...]) -> str:
    return ", ".join(map(str, allowed))


def _check_name(name: str, value: Any, known: Any, noun: str) -> OptionValueError | None:
    if isinstance(value, str) and value in known:
        return None
    return refused(name, f"unknown {noun} {{{name}!}} (known: {', '.join(known)})", **{name: value})


def _check_segments(value: Any) -> OptionValueError | None:
    """``recompute_segments``: "blocks", "auto" alone, or block instance names / globs."""
    name = "recompute_segments"
    problem = _check_globs(
        name,
        value,
        "segments",
        "bad segment {part!} (blocks, auto, or block instance names / globs",
    )
    if problem is None and SEGMENT_AUTO in value and len(value) > 1:
        return refused(name, "{recompute_segments}: auto stands alone (the planner chooses)")
    return problem


def _check_keep(value: Any) -> OptionValueError | None:
    """``segment_keep``: "matmuls" or node names / globs."""
    return _check_globs(
        "segment_keep", value, "names", "bad name {part!} (matmuls, or node names / globs"
    )


def _check_globs(name: str, value: Any, plural: str, bad: str) -> OptionValueError | None:
    """A tuple of at most ``MAX_SEGMENTS`` name globs of ``SEGMENT_CHARS`` (field ``name``,
    counted as ``plural``; ``bad``: the start of the message for a refused one, which
    names it as ``{part!}``)."""
    if not isinstance(value, tuple) or not all(isinstance(part, str) for part in value):
        return refused(name, f"{{{name}=}}: not a tuple of names", **{name: value})
    if len(value) > MAX_SEGMENTS:
        return refused(
            name, f"{{{name}}}: {len(value)} {plural} (at most {MAX_SEGMENTS})", **{name: value}
        )
    for part in value:
        if not part or len(part) > MAX_SEGMENT_NAME or not set(part) <= SEGMENT_CHARS:
            return refused(
                name,
                f"{{{name}}}: {bad} of letters, digits and _ . * ? [ ] ! -, comma-separated)",
                part=part,
            )
    return None


def _check_number(name: str, value: Any, low: int, high: int, none: bool = False):
    """A whole number from ``low`` to ``high`` (or None, where ``none``)."""
    if (value is None and none) or (_whole(value) and low <= value <= high):
        return None
    return refused(name, f"{{{name}=}}: not a whole number from {low} to {high}", **{name: value})


def _check_one(name: str, value: Any) -> OptionValueError | None:
    """Why one field's value is refused, whatever the others are; None when it is not."""
    if name == "platform":
        return _check_name(name, value, PLATFORMS, "platform")
    if name == "scheme":
        return _check_name(name, value, SCHEMES, "scheme")
    if name == "precision":
        return _check_name(name, value, PRECISION_NAMES, "precision")
    if name == "compress_config":
        ok = value is None or (
            isinstance(value, str) and value and "\0" not in value and len(value) <= MAX_PATH
        )
        return None if ok else refused(name, "{compress_config=}: not a file name", **{name: value})
    if name == "opt_level":
        ok = _whole(value) and value in (0, 1)
        return None if ok else refused(name, "{opt_level=}: must be 0 or 1", **{name: value})
    if name == "stage_starts":
        ok = isinstance(value, tuple) and all(isinstance(v, str) for v in value)
        ok = ok and len(value) <= MAX_SEGMENTS
        return None if ok else refused(name, "{stage_starts=}: not node names", **{name: value})
    if name in ("recompute", "data_parallel", "update_in_backward", "shard"):
        ok = isinstance(value, bool)
        return None if ok else refused(name, f"{{{name}=}}: not True or False", **{name: value})
    if name == "recompute_segments":
        return _check_segments(value)
    if name == "segment_keep":
        return _check_keep(value)
    return _check_count(name, value)


def _check_count(name: str, value: Any) -> OptionValueError | None:
    """The fields that are numbers."""
    if name == "num_ipus":
        allowed = tuple(sorted({n for p in PLATFORMS.values() for n in p.stage_counts}))
        ok = _whole(value) and value in allowed
        return None if ok else refused(name, f"{{num_ipus}} must be one of {_counts(allowed)}")
    if name == "pipeline":
        ok = _whole(value) and value in (1, *PROCESS_STAGES)
        message = f"{{pipeline}} must be one of 1, {_counts(PROCESS_STAGES)}"
        return None if ok else refused(name, message)
    if name == "resolution":
        return _check_number(name, value, 1, MAX_RESOLUTION, none=True)
    if name == "segment_pieces":
        return _check_number(name, value, 1, MAX_SEGMENT_PIECES)
    if name == "max_time_ratio":
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok = number and MIN_TIME_RATIO <= value <= MAX_TIME_RATIO  # nan compares False
        message = f"{{{name}=}}: not a number from {MIN_TIME_RATIO} to {MAX_TIME_RATIO}"
        return None if ok else refused(name, message, **{name: value})
    if name == "segment_piece_size":
        return _check_number(name, value, 0, MAX_SEGMENT_PIECES)
    if name == "bucket_bytes":
        return _check_number(name, value, 1, MAX_BUCKET_BYTES, none=True)
    return None


def check_field(name: str, value: Any) -> OptionValueError | None:
    """Why ``value`` cannot be field ``name`` of ``Options`` whatever the other fields
    are, or None: for a parser that refuses a value before the rest is known (the
    command line's choices), or a config file's keys that are options too. A list is
    taken as a tuple, as ``Options`` takes it."""
    listed = name in LIST_FIELDS and isinstance(value, list)
    return _check_one(name, tuple(value) if listed else value)


def validate(options: Options) -> None:
    """Refuse what ``options`` cannot generate, whatever the model: each field's type and
    range, then the combinations (``_check_combination``). Lists given for the tuple
    fields are taken as tuples."""
    for name in LIST_FIELDS:
        if isinstance(getattr(options, name), list):
            object.__setattr__(options, name, tuple(getattr(options, name)))  # frozen
    for f in OPTION_FIELDS:
        problem = _check_one(f.name, getattr(options, f.name))
        if problem is not None:
            raise problem
    if not isinstance(options.extra, dict) or not all(isinstance(k, str) for k in options.extra):
        raise refused("extra", "{extra=}: not a dict of header keys", extra=options.extra)
    problem = _check_combination(options)
    if problem is not None:
        raise problem


def _check_combination(o: Options) -> OptionValueError | None:
    """What the options rule out together, whatever the model: what the platform takes
    (its ``Platform``, never its name), and what does not combine yet."""
    target = PLATFORMS[o.platform]
    pipelined = " or ".join(f"{{platform={p.name}}}" for p in PLATFORMS.values() if p.pipelined)
    if o.pipeline != 1:
        if not target.process_stages:
            return refused("pipeline", "{pipeline} is not for {platform=}", o)
        if o.data_parallel:
            return refused("pipeline", "{pipeline} and {data_parallel} do not combine yet")
    elif not target.pipelined and (o.num_ipus != 1 or o.stage_starts):
        name = "num_ipus" if o.num_ipus != 1 else "stage_starts"
        return refused(
            name, f"{{num_ipus}} and {{stage_starts}} are for {pipelined} (or {{pipeline}})"
        )
    if o.precision not in target.precisions:
        note = f": {target.precision_note}" if target.precision_note else ""
        return refused(
            "precision",
            f"{{precision=}} is not for {{platform=}} (it takes {', '.join(target.precisions)})"
            + note,
            o,
        )
    if o.num_ipus not in target.stage_counts:
        return refused("num_ipus", f"{{num_ipus}} must be one of {_counts(target.stage_counts)}")
    if o.recompute_segments and (o.num_ipus != 1 or o.pipeline != 1):
        stages = "{num_ipus=}" if o.num_ipus != 1 else "{pipeline=}"
        return refused(
            "recompute_segments",
            f"{{recompute_segments}} does not combine with pipeline stages ({stages}) yet",
            o,
        )
    return _check_pieces(o, target) or _check_planner(o)


def _check_pieces(o: Options, target: Any) -> OptionValueError | None:
    """Segments in pieces: one way of asking, of recomputed segments, where pieces run."""
    if o.segment_pieces != 1 and o.segment_piece_size:
        return refused(
            "segment_piece_size", "{segment_pieces} and {segment_piece_size}: give one of them"
        )
    if o.segment_pieces != 1 or o.segment_piece_size:
        name = "segment_piece_size" if o.segment_piece_size else "segment_pieces"
        if not o.recompute_segments:
            return refused(
                name, f"{{{name}}} splits recomputed segments: give {{recompute_segments}}"
            )
        if target.grads != "accumulate" or target.pipelined:
            return refused(name, f"{{{name}}} is not for {{platform=}}", o)
        if o.data_parallel:
            return refused(name, f"{{{name}}} and {{data_parallel}} do not combine yet")
    if o.update_in_backward or o.shard:
        problem = _check_update(o, target)
        if problem is not None:
            return problem
    if o.data_parallel and target.pipelined:
        replicated = " or ".join(
            f"{{platform={p.name}}}" for p in PLATFORMS.values() if not p.pipelined
        )
        return refused("data_parallel", f"{{data_parallel}} is for {replicated}")
    return None


def _check_update(o: Options, target: Any) -> OptionValueError | None:
    """The optimizer step in the backward and sharding: on a platform whose gradients
    accumulate into ``.grad``, in one program (not with pipeline stages or replicated data
    parallel, yet)."""
    name = "shard" if o.shard else "update_in_backward"
    if target.grads != "accumulate" or target.pipelined:
        return refused(name, f"{{{name}}} is not for {{platform=}}", o)
    if o.data_parallel:
        return refused(name, f"{{{name}}} and {{data_parallel}} do not combine yet")
    if o.pipeline != 1:
        return refused(
            name,
            f"{{{name}}} and {{pipeline}} do not combine yet: sharding inside a stage needs "
            "a mesh of that stage's ranks, which the pipeline's runtime does not make",
        )
    return None


def _check_planner(o: Options) -> OptionValueError | None:
    """``--recompute-segments auto`` and ``--max-time-ratio`` are the planner's: only with
    the planned scheme."""
    if o.max_time_ratio != DEFAULT_TIME_RATIO and not o.planned:
        return refused(
            "max_time_ratio",
            "{max_time_ratio} limits the plan of {scheme=auto}; {scheme=} is not planned",
            o,
        )
    if o.segment_keep and o.planned:
        return refused(
            "segment_keep",
            "{segment_keep} is the planner's choice with {scheme=auto}: it tries keeping the "
            "matrix products itself",
        )
    if o.segment_keep and not o.recompute_segments and o.compress_config is None:
        return refused(
            "segment_keep",
            "{segment_keep} keeps statements of recomputed segments: give {recompute_segments}",
        )
    if SEGMENT_AUTO in o.recompute_segments and not o.planned:
        return refused(
            "recompute_segments",
            "{recompute_segments=auto} is the planner's choice: it needs {scheme=auto} (or "
            "unroll plan); otherwise name the block instances, or give 'blocks'",
        )
    return None


def from_keywords(
    options: Options | None, scheme: str, settings: dict[str, Any], caller: str = "unroll"
) -> Options:
    """``options`` (or the defaults with ``scheme``) with ``settings`` applied by field name,
    as Python callers give them (``recompute_segments="blocks"`` or a list, as on the
    command line); ``dataclasses.replace`` validates them (``OptionValueError`` names the
    Python argument). An unknown name, or both ``scheme`` and ``options``, is refused."""
    names = sorted(f.name for f in dataclasses.fields(Options))
    unknown = sorted(set(settings) - set(names))
    if unknown:
        raise TypeError(
            f"{caller}() got unexpected keyword argument(s) {', '.join(unknown)}; the "
            f"generation options are: {', '.join(names)}"
        )
    if options is not None and scheme != "nocompress":
        raise ValueError(f"{caller}: give scheme= or options= (options.scheme), not both")
    settings = dict(settings)
    for key in LIST_FIELDS:  # "blocks" or "a,b" as on the command line, or a list
        value = settings.get(key)
        if isinstance(value, str):
            settings[key] = tuple(part.strip() for part in value.split(",") if part.strip())
        elif isinstance(value, list):
            settings[key] = tuple(value)
    base = options or Options(scheme=scheme)
    return dataclasses.replace(base, **settings) if settings else base


def option_names() -> frozenset[str]:
    """The ``Options`` field names: the generation keywords of the Python API."""
    return frozenset(f.name for f in dataclasses.fields(Options))
