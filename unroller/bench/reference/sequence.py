"""References of the spec-v2 benchmark models: transformers, a 1-D conv net, MobileNetV2.

Each is built from standard ``torch.nn`` modules (``nn.MultiheadAttention(batch_first=True)``,
``nn.TransformerEncoderLayer``, ``nn.LayerNorm``, ``nn.Embedding``, ``nn.Conv1d``,
``nn.BatchNorm1d``, ``nn.ReLU6``) with the attribute tree of its model file, so the
generated module's state dict loads into it and back with strict=True:

- ``VitTiny`` (``vit_tiny.txt``): torchvision's VisionTransformer layout and names;
- ``GptTiny`` (``gpt_tiny.txt``): token + position embedding, two causal pre-norm
  ``nn.TransformerEncoderLayer``s, a per-token cross-entropy; ``GptSmall``
  (``gpt_small.txt``) the same at context 256, width 256, 6 layers, 8 heads;
- ``BertEncoder`` (``bert_encoder.txt``): token + position embedding and a layer norm,
  four post-norm ``nn.TransformerEncoderLayer``s without a mask, BERT's masked-token head
  and a cross-entropy over the masked positions;
- ``TcnSmall`` (``tcn_small.txt``): residual Conv1d/BatchNorm1d stages;
- ``MobileNetV2`` (``mobilenet_v2.txt``): torchvision's MobileNetV2 layout and names.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from unroller.bench.reference.base import Reference, StageRunner

# --------------------------------------------------------------------------- ViT


class VitEncoderBlock(nn.Module):
    """torchvision's EncoderBlock: x + attn(ln_1(x)), then + mlp(ln_2(.)); dropout 0."""

    def __init__(self, hidden: int, heads: int, mlp_dim: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden, eps=1e-6)
        self.self_attention = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(hidden, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(hidden, mlp_dim), nn.GELU(), nn.Dropout(0.0), nn.Linear(mlp_dim, hidden)
        )

    def forward(self, x: Tensor) -> Tensor:
        y = self.ln_1(x)
        y, _ = self.self_attention(y, y, y, need_weights=False)
        x = x + y
        return x + self.mlp(self.ln_2(x))


class VitTiny(Reference):
    """benchmarks/models/vit_tiny.txt: 4x4 patches of a 32x32 image, hidden 64, 4 heads,
    MLP 128, 2 layers, class token, learned position embedding, 10 classes."""

    def __init__(self, hidden: int = 64, layers: int = 2, num_classes: int = 10):
        super().__init__()
        self.conv_proj = nn.Conv2d(3, hidden, kernel_size=4, stride=4)
        self.class_token = nn.Parameter(torch.zeros(1, 1, hidden))
        self.encoder = nn.Module()
        self.encoder.pos_embedding = nn.Parameter(torch.empty(1, 65, hidden).normal_(std=0.02))
        self.encoder.layers = nn.Module()
        for i in range(layers):
            self.encoder.layers.add_module(
                f"encoder_layer_{i}", VitEncoderBlock(hidden, 4, 2 * hidden)
            )
        self.encoder.ln = nn.LayerNorm(hidden, eps=1e-6)
        self.heads = nn.Module()
        self.heads.head = nn.Linear(hidden, num_classes)

    def preds(self, inputs: Sequence[Tensor], run: StageRunner) -> tuple[Tensor, ...]:
        (x,) = inputs
        tokens = self.conv_proj(x).flatten(2).permute(0, 2, 1)
        cls = self.class_token.expand(x.shape[0], -1, -1)
        h = torch.cat([cls, tokens], dim=1) + self.encoder.pos_embedding
        for block in self.encoder.layers.children():
            h = run(block, h)
        h = self.encoder.ln(h)
        return (self.heads.head(h[:, 0]),)

    def criterion(self, preds, inputs, targets) -> Tensor:
        return F.cross_entropy(preds[0], targets[0])

    def segments(self) -> dict[str, list[nn.Module]]:
        return {name: [m] for name, m in self.encoder.layers.named_children()}


# --------------------------------------------------------------------------- GPT


class GptTiny(Reference):
    """benchmarks/models/gpt_tiny.txt: a character LM, context 64, vocabulary 128,
    width 64, 4 heads, 2 causal ``nn.TransformerEncoderLayer``s (norm_first, gelu).
    The sizes are arguments so ``GptSmall`` is the same network, larger."""

    def __init__(
        self,
        vocab: int = 128,
        context: int = 64,
        width: int = 64,
        layers: int = 2,
        heads: int = 4,
    ):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, width)
        self.pos_emb = nn.Parameter(torch.empty(context, width).normal_(std=0.02))
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(
                width,
                heads,
                4 * width,
                dropout=0.0,
                activation="gelu",
                batch_first=True,
                norm_first=True,
            )
            for _ in range(layers)
        )
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def preds(self, inputs: Sequence[Tensor], run: StageRunner) -> tuple[Tensor, ...]:
        (ids,) = inputs
        h = self.tok_emb(ids) + self.pos_emb
        length = ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(length, dtype=h.dtype)
        for layer in self.layers:
            h = run(lambda t, layer=layer: layer(t, src_mask=mask, is_causal=True), h)
        return (self.head(self.ln_f(h)),)

    def criterion(self, preds, inputs, targets) -> Tensor:
        return F.cross_entropy(preds[0].permute(0, 2, 1), targets[0])

    def segments(self) -> dict[str, list[nn.Module]]:
        return {f"layers.{i}": [m] for i, m in enumerate(self.layers)}


class GptSmall(GptTiny):
    """benchmarks/models/gpt_small.txt: ``GptTiny`` at width 256, 6 layers, 8 heads and
    context 256 (``context``: the harness's quick preset runs a shorter one, the model
    text rewritten to match)."""

    def __init__(self, context: int = 256):
        super().__init__(vocab=128, context=context, width=256, layers=6, heads=8)


#: why the context of gpt_small and the sequence of bert_encoder come in steps
CONTEXT_RULE = (
    "the sequence length is the model's size: the harness rewrites the input, the target "
    "and the position embedding to it, in steps of 16 tokens"
)
CONTEXT_STEP = 16


def rewrite_context(text: str, length: int) -> str:
    """A token model's text (``gpt_small.txt``, ``bert_encoder.txt``) at sequence length
    ``length``: the ``ids`` input, the ``y`` target and ``pos_emb``'s first dim (each must
    occur exactly once). Width and length may be the same number, so each edit is tied to
    its statement, never to the number."""
    edits = [
        r"(input\s+ids\s*:\s*i64\[\s*N\s*,\s*)\d+(\s*\])",
        r"(target\s+y\s*:\s*i64\[\s*N\s*,\s*)\d+(\s*\])",
        r"(pos_emb\s*=\s*parameter\(\s*shape\s*=\s*\(\s*)\d+(\s*,)",
    ]
    for pattern in edits:
        text, count = re.subn(pattern, rf"\g<1>{length}\g<2>", text)
        if count != 1:
            raise RuntimeError(
                f"expected one match of {pattern!r} to rewrite for sequence length {length}, "
                f"found {count}"
            )
    return text


# --------------------------------------------------------------------------- BERT


class BertEncoder(Reference):
    """benchmarks/models/bert_encoder.txt: a masked character model, sequence 128 (the
    ``length`` argument), width 128, 4 heads, MLP 512, 4 post-norm
    ``nn.TransformerEncoderLayer``s (norm_first=False, gelu, no mask), BERT's masked-token
    head with an untied decoder, a cross-entropy over the masked positions (targets -100
    elsewhere, F.cross_entropy's default ignore_index)."""

    def __init__(
        self, vocab: int = 128, length: int = 128, width: int = 128, layers: int = 4, heads: int = 4
    ):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, width)
        self.pos_emb = nn.Parameter(torch.empty(length, width).normal_(std=0.02))
        self.emb_ln = nn.LayerNorm(width)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(
                width,
                heads,
                4 * width,
                dropout=0.0,
                activation="gelu",
                batch_first=True,
                norm_first=False,
            )
            for _ in range(layers)
        )
        self.mlm = _MlmHead(width, vocab)

    def preds(self, inputs: Sequence[Tensor], run: StageRunner) -> tuple[Tensor, ...]:
        (ids,) = inputs
        h = self.emb_ln(self.tok_emb(ids) + self.pos_emb)
        for layer in self.layers:
            h = run(layer, h)
        return (run(self.mlm, h),)

    def criterion(self, preds, inputs, targets) -> Tensor:
        return F.cross_entropy(preds[0].permute(0, 2, 1), targets[0])

    def segments(self) -> dict[str, list[nn.Module]]:
        """The layers and the masked-token head, as the model text's blocks."""
        return {**{f"layers.{i}": [m] for i, m in enumerate(self.layers)}, "mlm": [self.mlm]}


class _MlmHead(nn.Module):
    """BERT's masked-token head: dense, GELU, layer norm, decoder (untied)."""

    def __init__(self, width: int, vocab: int):
        super().__init__()
        self.dense = nn.Linear(width, width)
        self.ln = nn.LayerNorm(width)
        self.decoder = nn.Linear(width, vocab)

    def forward(self, h: Tensor) -> Tensor:
        return self.decoder(self.ln(F.gelu(self.dense(h))))


# --------------------------------------------------------------------------- TCN


class _Residual1d(nn.Module):
    def __init__(self, ch: int, k: int = 5):
        super().__init__()
        self.conv1 = nn.Conv1d(ch, ch, k, padding=k // 2, bias=False)
        self.bn1 = nn.BatchNorm1d(ch)
        self.conv2 = nn.Conv1d(ch, ch, k, padding=k // 2, bias=False)
        self.bn2 = nn.BatchNorm1d(ch)

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + x)


class _Down1d(nn.Module):
    def __init__(self, cin: int, ch: int):
        super().__init__()
        self.proj = nn.Conv1d(cin, ch, 1, bias=False)
        self.bn = nn.BatchNorm1d(ch)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.bn(self.proj(F.max_pool1d(x, 2))))


TCN_STAGES = ("stem", "stage1", "down2", "stage2", "down3", "stage3")


class TcnSmall(Reference):
    """benchmarks/models/tcn_small.txt: 4 channels x 128 steps, 5 classes."""

    def __init__(self, num_classes: int = 5):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv1d(4, 32, 7, padding=3, bias=False), nn.BatchNorm1d(32), nn.ReLU()
        )
        self.stage1 = _Residual1d(32)
        self.down2 = _Down1d(32, 64)
        self.stage2 = _Residual1d(64)
        self.down3 = _Down1d(64, 128)
        self.stage3 = _Residual1d(128, k=3)
        self.fc = nn.Linear(128, num_classes)

    def preds(self, inputs: Sequence[Tensor], run: StageRunner) -> tuple[Tensor, ...]:
        (x,) = inputs
        h = x
        for name in TCN_STAGES:
            h = run(getattr(self, name), h)
        return (self.fc(F.adaptive_avg_pool1d(h, 1).flatten(1)),)

    def criterion(self, preds, inputs, targets) -> Tensor:
        return F.cross_entropy(preds[0], targets[0])

    def segments(self) -> dict[str, list[nn.Module]]:
        return {name: [getattr(self, name)] for name in TCN_STAGES}


# --------------------------------------------------------------------------- MobileNetV2


def _conv_bn_relu6(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1):
    """torchvision's Conv2dNormActivation(..., activation_layer=nn.ReLU6): 0, 1, 2."""
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU6(),
    )


class InvertedResidual(nn.Module):
    """torchvision's InvertedResidual: ``conv`` holds [expand,] depthwise, project, bn."""

    def __init__(self, inp: int, oup: int, stride: int, expand_ratio: int):
        super().__init__()
        hidden = inp * expand_ratio
        self.use_res_connect = stride == 1 and inp == oup
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers.append(_conv_bn_relu6(inp, hidden, 1))
        layers += [
            _conv_bn_relu6(hidden, hidden, 3, stride, groups=hidden),
            nn.Conv2d(hidden, oup, 1, bias=False),
            nn.BatchNorm2d(oup),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.conv(x) if self.use_res_connect else self.conv(x)


MOBILENET_SETTINGS = [
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
]


class MobileNetV2(Reference):
    """benchmarks/models/mobilenet_v2.txt: torchvision's MobileNetV2, width 1.0, 10 classes."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        features: list[nn.Module] = [_conv_bn_relu6(3, 32, 3, stride=2)]
        inp = 32
        for t, c, n, s in MOBILENET_SETTINGS:
            for i in range(n):
                features.append(InvertedResidual(inp, c, s if i == 0 else 1, t))
                inp = c
        features.append(_conv_bn_relu6(inp, 1280, 1))
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(1280, num_classes))

    def preds(self, inputs: Sequence[Tensor], run: StageRunner) -> tuple[Tensor, ...]:
        (x,) = inputs
        h = x
        for block in self.features:
            h = run(block, h)
        h = F.adaptive_avg_pool2d(h, 1).flatten(1)
        return (self.classifier(h),)

    def criterion(self, preds, inputs, targets) -> Tensor:
        return F.cross_entropy(preds[0], targets[0])

    def segments(self) -> dict[str, list[nn.Module]]:
        return {f"features.{i}": [m] for i, m in enumerate(self.features)}
