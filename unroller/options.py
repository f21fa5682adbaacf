"""What besides the model text determines a generated module: platform, scheme or config
file, recompute, segments and their pieces, parallelism. ``Options`` is recorded in each
generated file's header (``as_dict``) and read back from it (``from_header``) so that
``unroll check`` regenerates the same file."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from unroller.errors import ConfigError
from unroller.graph import Graph
from unroller.schemes import AUTO, CompressionConfig, resolve
from unroller.stash import SEGMENT_AUTO


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
    recompute: bool = False  # remake cheap ops' outputs in the backward (stash.plan_recompute)
    #: block instances re-run in the backward (stash.plan_segments): "blocks", globs on
    #: instance names, or "auto" (the planner's choice, with the auto scheme)
    recompute_segments: tuple[str, ...] = ()
    #: recomputed segments run their recompute and backward in this many pieces of the
    #: batch where they can (stash.plan_pieces); 1: whole
    segment_pieces: int = 1
    #: or, when not 0, in pieces of at most this many samples (``split``), whatever the batch
    segment_piece_size: int = 0
    data_parallel: bool = False  # all-reduce gradient buckets in the backward (distributed.py)
    bucket_bytes: int | None = None  # data parallel: bucket size (None: BUCKET_BYTES, 25 MiB)
    pipeline: int = 1  # gpu: stages over processes (unroller.pipeline_parallel); 1: none
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
        if self.recompute:
            found["recompute"] = True
        if self.recompute_segments:
            found["recompute_segments"] = list(self.recompute_segments)
        if self.segment_pieces != 1:
            found["segment_pieces"] = self.segment_pieces
        if self.segment_piece_size:
            found["segment_piece_size"] = self.segment_piece_size
        if self.data_parallel:
            found["data_parallel"] = True
        if self.bucket_bytes is not None:
            found["bucket_bytes"] = self.bucket_bytes
        if self.pipeline != 1:
            found["pipeline"] = self.pipeline
        return {**found, **self.extra}

    @classmethod
    def from_header(cls, header: dict[str, Any]) -> Options:
        known = {"generator", "source", "sha256", "platform", "scheme", "compress_config"}
        known |= {"compress_config_sha256", "opt_level", "num_ipus", "stage_starts", "resolution"}
        known |= {"recompute", "recompute_segments", "data_parallel", "bucket_bytes", "pipeline"}
        known |= {"segment_pieces", "segment_piece_size"}
        segments = header.get("recompute_segments", [])
        pieces = header.get("segment_pieces", 1)
        size = header.get("segment_piece_size", 0)
        return cls(
            platform=header.get("platform", "gpu"),
            scheme=header.get("scheme", "nocompress"),
            compress_config=header.get("compress_config"),
            opt_level=header.get("opt_level", 1),
            num_ipus=header.get("num_ipus", 1),
            stage_starts=tuple(header.get("stage_starts", ())),
            resolution=header.get("resolution"),
            recompute=header.get("recompute") is True,
            recompute_segments=(
                tuple(segments)
                if isinstance(segments, list) and all(isinstance(s, str) for s in segments)
                else ()
            ),
            segment_pieces=(
                pieces if isinstance(pieces, int) and not isinstance(pieces, bool) else 1
            ),
            segment_piece_size=size if isinstance(size, int) and not isinstance(size, bool) else 0,
            data_parallel=header.get("data_parallel") is True,
            bucket_bytes=header.get("bucket_bytes"),
            pipeline=header.get("pipeline", 1),
            extra={k: v for k, v in header.items() if k not in known},
        )

    @property
    def planned(self) -> bool:
        """Does the ``auto`` scheme plan the config per model (``plan.auto_config``)?"""
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
        if SEGMENT_AUTO in self.recompute_segments:
            raise ConfigError(
                "--recompute-segments auto is the planner's choice: it needs --scheme auto "
                "(or unroll plan); otherwise name the block instances, or give 'blocks'"
            )
        config = self.with_flags(resolve(self.scheme, self.compress_config, self.opt_level))
        extra = tuple(s for s in self.recompute_segments if s not in config.segments)
        return dataclasses.replace(config, segments=config.segments + extra) if extra else config

    def with_flags(self, config: CompressionConfig) -> CompressionConfig:
        """``config`` with ``--recompute`` applied: a planned config gets it too (its
        segments are the planner's, so named segments are folded in by ``compression``)."""
        if self.recompute and not config.recompute:
            return dataclasses.replace(config, recompute=True)
        return config
