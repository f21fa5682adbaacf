"""``unroller.pipeline_parallel.PipelineStage``: the name docs/language.md gives for driving
the stages of a ``--pipeline K`` module, kept for code written against it. The pipeline
over processes is ``unroller.parallel.pipeline``."""

from unroller.parallel.pipeline import *  # noqa: F401,F403
from unroller.parallel.pipeline import PipelineStage  # noqa: F401
