"""The benchmark registry: ``BENCHMARKS[name]`` describes ``benchmarks/models/NAME.txt``.

A ``Benchmark`` ties a model file to its reference, its synthetic batches and its sizes,
and builds the generated module at any resolution, so the harness and the tests treat
every network alike:

- ``build(resolution)``: the reference module at that input size (``None``: the size
  the model file declares); ``make_batch(batch, resolution, seed)``: deterministic
  float32 inputs and targets in declaration order.
- ``model_text(resolution)``, ``generate(options)``, ``model_class(options)``: the model
  text at a resolution and the generated module from it.
- ``native_resolution``, ``paper_batch``, ``quick_resolution``: the declared input size,
  the batch the authors of the published benchmarks used, and the reduced size the
  quick preset uses on a 2-core CPU.

Resolutions. ``unroller.compiler.options.Options(resolution=R)`` makes the generator rewrite every
``[N, C, H, W]`` input and target to ``H = R``. The ResNets (adaptive pooling) and the
U-Nets (fully convolutional; R a multiple of 8) need nothing more. OpticalDamage's
linear layers depend on the size, so ``model_text(R)`` rewrites them; ``generate`` and
``model_class`` generate from that text, labelled with the model file's path. The
header of such a generated file records the sha256 of the rewritten text, so
``unroll check`` cannot regenerate it: write these to temporary directories.

The model files are found in the checkout (``unroller.bench.paths``);
``with_models_dir(DIR)`` points a benchmark at another folder.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from unroller.api import compression_config, generate_from_text, graph_from_text
from unroller.bench.paths import benchmark_models_dir
from unroller.bench.reference import batches
from unroller.bench.reference.base import Reference
from unroller.bench.reference.blocks import UNET_RULE
from unroller.bench.reference.published import (
    OPTICAL_RULE,
    EMDenoise,
    OpticalDamage,
    QuickResNet,
    ResNet34,
    ResNetLike,
    SLSTRCloud,
    UNetLike,
    rewrite_opticaldamage,
)
from unroller.bench.reference.sequence import (
    CONTEXT_RULE,
    CONTEXT_STEP,
    BertEncoder,
    GptSmall,
    GptTiny,
    MobileNetV2,
    TcnSmall,
    VitTiny,
    rewrite_context,
)
from unroller.compiler.options import Options
from unroller.materialize import materialize

#: the quick preset's sequence lengths of the two larger transformers: gpt_small at a
#: quarter of its context (6 layers of width 256 at 256 tokens cost ~5x gpt_small at 64
#: per step; its quick run at 64 tokens took ~130 CPU-seconds, 2.5x gpt_tiny's whole quick
#: run), bert_encoder at its full 128 tokens (~70 CPU-seconds, cheaper per step than
#: gpt_small at 64)
GPT_SMALL_QUICK_CONTEXT = 64
BERT_QUICK_LENGTH = 128

#: why the sequence models run at their declared size only
FIXED_SIZE_RULE = (
    "the declared size is built into the model (a position embedding or a 1-D signal "
    "length), so only the native size works"
)


@dataclass(frozen=True)
class Benchmark:
    """One benchmark network: ``benchmarks/models/NAME.txt`` and its reference.

    ``paper_batch`` is the batch the authors of the published benchmarks used; for the
    models that are not from that work (``from_paper`` false) it is the batch this
    project's harness uses (32). Valid resolutions are the positive multiples of
    ``resolution_step`` (``resolution_rule`` says why).
    """

    name: str
    description: str
    native_resolution: int
    paper_batch: int
    quick_resolution: int
    resolution_step: int
    from_paper: bool
    reference: Callable[[int], Reference]  # resolution -> reference module
    batch_fn: Callable[[torch.Generator, int, int], list[Tensor]]  # (gen, batch, R)
    text_rewrite: Callable[[str, int], str] | None = None  # (file text, R) -> text at R
    resolution_rule: str = "any size works"  # why resolutions are multiples of the step
    models_dir: Path | None = None  # None: the checkout's benchmarks/models/

    def with_models_dir(self, directory: Path | None) -> Benchmark:
        """The same benchmark reading its model file from ``directory``."""
        return dataclasses.replace(self, models_dir=directory)

    @property
    def path(self) -> Path:
        """The model file."""
        return benchmark_models_dir(self.models_dir) / f"{self.name}.txt"

    @property
    def label(self) -> str:
        """How generated code names its source: the model file, relative to the repo."""
        return f"benchmarks/models/{self.name}.txt"

    def valid_resolution(self, resolution: int) -> bool:
        return resolution >= self.resolution_step and resolution % self.resolution_step == 0

    def check_resolution(self, resolution: int | None) -> int:
        """``resolution`` (``None``: the native one), or ValueError naming the valid ones."""
        if resolution is None:
            return self.native_resolution
        if not self.valid_resolution(resolution):
            step = self.resolution_step
            raise ValueError(
                f"{self.name} needs a resolution that is a positive multiple of {step} "
                f"({step}, {2 * step}, ..., native {self.native_resolution}), got "
                f"{resolution}: {self.resolution_rule}"
            )
        return resolution

    def build(self, resolution: int | None = None) -> Reference:
        """The reference module at input size ``resolution`` (default: native), with
        PyTorch's default initialisation."""
        return self.reference(self.check_resolution(resolution))

    def make_batch(self, batch: int, resolution: int | None = None, seed: int = 0) -> list[Tensor]:
        """Deterministic float32 inputs and targets (int64 class indices), in declaration
        order, at input size ``resolution`` (default: native)."""
        gen = torch.Generator().manual_seed(seed)
        return self.batch_fn(gen, batch, self.check_resolution(resolution))

    def segments(self, module: Reference) -> dict[str, list[nn.Module]]:
        """The stages ``module.forward_checkpointed`` checkpoints, in order."""
        return module.segments()

    def model_text(self, resolution: int | None = None) -> str:
        """The model file's text, rewritten for ``resolution`` where the model has
        size-dependent layers (OpticalDamage); otherwise the file's text unchanged (the
        generator resizes the inputs itself: ``Options(resolution=R)``)."""
        text = self.path.read_text(encoding="utf-8")
        resolution = self.check_resolution(resolution)
        if self.text_rewrite is None or resolution == self.native_resolution:
            return text
        return self.text_rewrite(text, resolution)

    def generate(self, options: Options | None = None) -> str:
        """The generated module's source for ``options`` (its ``resolution`` included)."""
        options = options or Options()
        text = self.model_text(options.resolution)
        return generate_from_text(text, options, label=self.label)

    def model_class(
        self, options: Options | None = None, directory: Path | None = None, readable: bool = True
    ):
        """Generate, write to ``directory`` (a new temp dir by default) as
        ``NAME_PLATFORM_SCHEME_RESOLUTION.py``, import; returns the generated ``Model``
        class. ``readable=False``: the file not laid out by black (most of a render's
        time), for a module that is run and never read (``materialize``)."""
        options = options or Options()
        text = self.model_text(options.resolution)
        resolution = self.check_resolution(options.resolution)
        graph = graph_from_text(text, self.label, options.resolution, options.precision)
        return materialize(
            graph,
            self.label,
            options,
            compression_config(options, graph),
            folder=directory,
            file_name=f"{self.name}_{options.platform}_{options.scheme}_{options.precision}_{resolution}.py",
            readable=readable,
        ).Model


BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in [
        Benchmark(
            name="resnet34",
            description="ResNet-34 on CIFAR-10 (3x32x32, 10 classes, cross-entropy)",
            native_resolution=32,
            paper_batch=32,
            quick_resolution=32,
            resolution_step=1,
            from_paper=True,
            reference=lambda r: ResNet34(),
            batch_fn=batches.batch_cifar,
        ),
        Benchmark(
            name="emdenoise",
            description="EMDenoise U-Net (1x256x256, MSE against the clean image)",
            native_resolution=256,
            paper_batch=32,
            quick_resolution=64,
            resolution_step=8,
            resolution_rule=UNET_RULE,
            from_paper=True,
            reference=lambda r: EMDenoise(),
            batch_fn=batches.batch_emdenoise,
        ),
        Benchmark(
            name="slstrcloud",
            description="SLSTRCloud U-Net (9x256x256, sigmoid + BCE against a {0,1} mask)",
            native_resolution=256,
            paper_batch=4,
            quick_resolution=64,
            resolution_step=8,
            resolution_rule=UNET_RULE,
            from_paper=True,
            reference=lambda r: SLSTRCloud(),
            batch_fn=batches.batch_slstrcloud,
        ),
        Benchmark(
            name="opticaldamage",
            description="OpticalDamage autoencoder (1x200x200, latent 512, MSE to the input)",
            native_resolution=200,
            paper_batch=8,
            quick_resolution=64,
            resolution_step=4,
            from_paper=True,
            reference=OpticalDamage,
            batch_fn=batches.batch_opticaldamage,
            text_rewrite=rewrite_opticaldamage,
            resolution_rule=OPTICAL_RULE,
        ),
        Benchmark(
            name="quick",
            description="ResNet-8 on CIFAR-10-like 3x32x32 images, for quick runs",
            native_resolution=32,
            paper_batch=32,
            quick_resolution=32,
            resolution_step=1,
            from_paper=False,
            reference=lambda r: QuickResNet(),
            batch_fn=batches.batch_cifar,
        ),
        Benchmark(
            name="resnet_like",
            description="ResNet-14-like on 3x32x32 (white-noise images), cross-entropy",
            native_resolution=32,
            paper_batch=32,
            quick_resolution=32,
            resolution_step=1,
            from_paper=False,
            reference=lambda r: ResNetLike(),
            batch_fn=batches.batch_resnet_like,
        ),
        Benchmark(
            name="unet_like",
            description="EMDenoise-shaped U-Net on 1x64x64 (uniform noise images), MSE",
            native_resolution=64,
            paper_batch=32,
            quick_resolution=64,
            resolution_step=8,
            resolution_rule=UNET_RULE,
            from_paper=False,
            reference=lambda r: UNetLike(),
            batch_fn=batches.batch_unet_like,
        ),
        Benchmark(
            name="vit_tiny",
            description="ViT (4x4 patches, 2 layers, width 64) on 3x32x32 images, cross-entropy",
            native_resolution=32,
            paper_batch=32,
            quick_resolution=32,
            resolution_step=32,
            resolution_rule=FIXED_SIZE_RULE,
            from_paper=False,
            reference=lambda r: VitTiny(),
            batch_fn=batches.batch_cifar,
        ),
        Benchmark(
            name="gpt_tiny",
            description="GPT-style character LM (context 64, 2 causal layers, width 64)",
            native_resolution=64,
            paper_batch=32,
            quick_resolution=64,
            resolution_step=64,
            resolution_rule=FIXED_SIZE_RULE,
            from_paper=False,
            reference=lambda r: GptTiny(),
            batch_fn=batches.batch_text,
        ),
        Benchmark(
            name="gpt_small",
            description="GPT-style character LM (context 256, 6 causal layers, width 256, "
            "8 heads)",
            native_resolution=256,
            paper_batch=32,
            quick_resolution=GPT_SMALL_QUICK_CONTEXT,
            resolution_step=CONTEXT_STEP,
            resolution_rule=CONTEXT_RULE,
            from_paper=False,
            reference=lambda r: GptSmall(context=r),
            batch_fn=batches.batch_text,
            text_rewrite=rewrite_context,
        ),
        Benchmark(
            name="bert_encoder",
            description="BERT-style masked character encoder (sequence 128, 4 post-norm "
            "layers, width 128, 4 heads)",
            native_resolution=128,
            paper_batch=32,
            quick_resolution=BERT_QUICK_LENGTH,
            resolution_step=CONTEXT_STEP,
            resolution_rule=CONTEXT_RULE,
            from_paper=False,
            reference=lambda r: BertEncoder(length=r),
            batch_fn=batches.batch_masked_text,
            text_rewrite=rewrite_context,
        ),
        Benchmark(
            name="tcn_small",
            description="1-D conv net on 4x128 time series (3 residual stages), 5 classes",
            native_resolution=128,
            paper_batch=32,
            quick_resolution=128,
            resolution_step=128,
            resolution_rule=FIXED_SIZE_RULE,
            from_paper=False,
            reference=lambda r: TcnSmall(),
            batch_fn=batches.batch_timeseries,
        ),
        Benchmark(
            name="mobilenet_v2",
            description="torchvision MobileNetV2 (width 1.0) on 3x32x32 images, 10 classes",
            native_resolution=32,
            paper_batch=32,
            quick_resolution=32,
            resolution_step=1,
            from_paper=False,
            reference=lambda r: MobileNetV2(),
            batch_fn=batches.batch_cifar,
        ),
    ]
}
