"""Widely used networks, rewritten from torch.nn so ``unroll import`` can be tested without downloads.

The torchvision wheel on the package registry is built against CUDA torch and does not import
beside the CPU build used here, so the import tests cannot load torchvision's models. Each class
below reproduces the module tree, the forward computation and the ``state_dict()`` key names of
the code it mirrors (named in its docstring), which is what the importer sees through
``torch.export``; only the sizes are knobs, so a float64 training step at batch 2 stays well under
a second on a small CPU. Initialisation follows the original unless a docstring says otherwise
(an all-zero head would make every upstream gradient zero and the comparison vacuous).

This is a plain module of networks and factories, with no tests in it. ``python
tests/import_zoo.py`` builds each one, runs a forward at batch 2 and prints its state-dict size.
"""

from __future__ import annotations

import copy
import math
from collections import OrderedDict
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# --------------------------------------------------------------------------------------------
# ResNet-18 (torchvision.models.resnet)
# --------------------------------------------------------------------------------------------


def conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    """The 3x3 convolution of a residual block: padding 1, no bias (a BatchNorm follows)."""
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


def conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    """The 1x1 projection of a shortcut that changes width or resolution."""
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """torchvision's ``BasicBlock``: two 3x3 convs, an identity or projected shortcut.

    As in torchvision, one ``nn.ReLU(inplace=True)`` module is called twice and the shortcut is
    added in place (``out += identity``): the importer must cope with both.
    """

    expansion = 1

    def __init__(
        self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: Tensor) -> Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """torchvision's ``ResNet`` for ``BasicBlock`` (stem, four stages, global pool, ``fc``)."""

    def __init__(self, layers: list[int], num_classes: int = 1000, width: int = 64) -> None:
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(width, layers[0])
        self.layer2 = self._make_layer(width * 2, layers[1], stride=2)
        self.layer3 = self._make_layer(width * 4, layers[2], stride=2)
        self.layer4 = self._make_layer(width * 8, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(width * 8 * BasicBlock.expansion, num_classes)
        _init_convnet(self)

    def _make_layer(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        """A stage; its first block projects the shortcut when the shape changes."""
        downsample = None
        if stride != 1 or self.inplanes != planes * BasicBlock.expansion:
            downsample = nn.Sequential(
                conv1x1(self.inplanes, planes * BasicBlock.expansion, stride),
                nn.BatchNorm2d(planes * BasicBlock.expansion),
            )
        layers = [BasicBlock(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * BasicBlock.expansion
        layers += [BasicBlock(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.fc(x)


def resnet18(num_classes: int = 10, width: int = 64) -> ResNet:
    """ResNet-18 as ``torchvision.models.resnet18``; ``width`` (64 there) scales every stage."""
    return ResNet([2, 2, 2, 2], num_classes=num_classes, width=width)


def _init_convnet(model: nn.Module) -> None:
    """torchvision's CNN initialisation: He (fan-out) convs, unit BatchNorms, small linears."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d | nn.GroupNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


# --------------------------------------------------------------------------------------------
# VGG-11 with batch norm (torchvision.models.vgg, configuration "A")
# --------------------------------------------------------------------------------------------

VGG_CFG_A: list[int | str] = [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"]


def make_vgg_layers(cfg: list[int | str], batch_norm: bool) -> nn.Sequential:
    """The flat ``features`` Sequential: conv (+BN) + ReLU per number, a 2x2 max pool per "M"."""
    layers: list[nn.Module] = []
    in_channels = 3
    for v in cfg:
        if v == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            continue
        assert isinstance(v, int)
        conv = nn.Conv2d(in_channels, v, kernel_size=3, padding=1)
        if batch_norm:
            layers += [conv, nn.BatchNorm2d(v), nn.ReLU(inplace=True)]
        else:
            layers += [conv, nn.ReLU(inplace=True)]
        in_channels = v
    return nn.Sequential(*layers)


class VGG(nn.Module):
    """torchvision's ``VGG``: ``features``, a 7x7 adaptive average pool, a 3-layer classifier.

    At a 32x32 input the features end at 1x1, so ``avgpool`` replicates each value to 7x7
    (an adaptive pool that upsamples) before the first ``Linear`` of 512*7*7 inputs.
    """

    def __init__(
        self, features: nn.Sequential, num_classes: int, hidden: int, dropout: float
    ) -> None:
        super().__init__()
        self.features = features
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, hidden),
            nn.ReLU(True),
            nn.Dropout(p=dropout),
            nn.Linear(hidden, hidden),
            nn.ReLU(True),
            nn.Dropout(p=dropout),
            nn.Linear(hidden, num_classes),
        )
        _init_convnet(self)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        x = self.avgpool(self.features(x))
        x = torch.flatten(x, 1)
        return self.classifier(x)


def vgg11_bn(num_classes: int = 10, hidden: int = 4096, dropout: float = 0.5) -> VGG:
    """VGG-11-BN as ``torchvision.models.vgg11_bn``; ``hidden`` is the classifier width."""
    return VGG(make_vgg_layers(VGG_CFG_A, batch_norm=True), num_classes, hidden, dropout)


# --------------------------------------------------------------------------------------------
# MobileNetV2 (torchvision.models.mobilenetv2, torchvision.ops.misc)
# --------------------------------------------------------------------------------------------


def _make_divisible(v: float, divisor: int, min_value: int | None = None) -> int:
    """Round a channel count to a multiple of ``divisor``, never more than 10% below ``v``."""
    if min_value is None:
        min_value = divisor
    new_v = max(min_value, int(v + divisor / 2) // divisor * divisor)
    if new_v < 0.9 * v:
        new_v += divisor
    return new_v


class Conv2dNormActivation(nn.Sequential):
    """torchvision.ops' conv + norm + activation, a ``Sequential`` so keys read ``0.weight``.

    The keyword-only knobs are torchvision's too (EfficientNet's projection has no
    activation, ConvNeXt's stem is a biased 4x4 conv with a channels-last LayerNorm); their
    defaults keep the MobileNetV2 layout.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int = 3,
        stride: int = 1,
        groups: int = 1,
        activation_layer: Callable[..., nn.Module] | None = nn.ReLU,
        *,
        padding: int | None = None,
        norm_layer: Callable[..., nn.Module] = nn.BatchNorm2d,
        bias: bool = False,
    ) -> None:
        if padding is None:
            padding = (kernel_size - 1) // 2
        layers = [
            nn.Conv2d(
                in_channels,
                out_channels,
                kernel_size,
                stride,
                padding,
                groups=groups,
                bias=bias,
            ),
            norm_layer(out_channels),
        ]
        if activation_layer is not None:
            layers.append(activation_layer(inplace=True))
        super().__init__(*layers)
        self.out_channels = out_channels


class InvertedResidual(nn.Module):
    """torchvision's MobileNetV2 block: 1x1 expand, 3x3 depthwise, 1x1 linear projection."""

    def __init__(self, inp: int, oup: int, stride: int, expand_ratio: int) -> None:
        super().__init__()
        self.stride = stride
        hidden_dim = int(round(inp * expand_ratio))
        self.use_res_connect = stride == 1 and inp == oup
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers.append(
                Conv2dNormActivation(inp, hidden_dim, kernel_size=1, activation_layer=nn.ReLU6)
            )
        layers += [
            Conv2dNormActivation(
                hidden_dim, hidden_dim, stride=stride, groups=hidden_dim, activation_layer=nn.ReLU6
            ),
            nn.Conv2d(hidden_dim, oup, 1, 1, 0, bias=False),
            nn.BatchNorm2d(oup),
        ]
        self.conv = nn.Sequential(*layers)
        self.out_channels = oup

    def forward(self, x: Tensor) -> Tensor:
        if self.use_res_connect:
            return x + self.conv(x)
        return self.conv(x)


# (expansion t, output channels c, repeats n, first stride s), as in the MobileNetV2 paper.
MOBILENET_V2_SETTING = [
    [1, 16, 1, 1],
    [6, 24, 2, 2],
    [6, 32, 3, 2],
    [6, 64, 4, 2],
    [6, 96, 3, 1],
    [6, 160, 3, 2],
    [6, 320, 1, 1],
]


class MobileNetV2(nn.Module):
    """torchvision's ``MobileNetV2``: ``features`` (stem, 17 blocks, 1x1 head), ``classifier``."""

    def __init__(
        self,
        num_classes: int = 1000,
        width_mult: float = 1.0,
        dropout: float = 0.2,
        round_nearest: int = 8,
    ) -> None:
        super().__init__()
        input_channel = _make_divisible(32 * width_mult, round_nearest)
        self.last_channel = _make_divisible(1280 * max(1.0, width_mult), round_nearest)
        features: list[nn.Module] = [
            Conv2dNormActivation(3, input_channel, stride=2, activation_layer=nn.ReLU6)
        ]
        for t, c, n, s in MOBILENET_V2_SETTING:
            output_channel = _make_divisible(c * width_mult, round_nearest)
            for i in range(n):
                stride = s if i == 0 else 1
                features.append(InvertedResidual(input_channel, output_channel, stride, t))
                input_channel = output_channel
        features.append(
            Conv2dNormActivation(
                input_channel, self.last_channel, kernel_size=1, activation_layer=nn.ReLU6
            )
        )
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(
            nn.Dropout(p=dropout), nn.Linear(self.last_channel, num_classes)
        )
        _init_convnet(self)
        nn.init.normal_(self.classifier[1].weight, 0, 0.01)
        nn.init.zeros_(self.classifier[1].bias)

    def forward(self, x: Tensor) -> Tensor:
        x = self.features(x)
        x = F.adaptive_avg_pool2d(x, (1, 1))
        x = torch.flatten(x, 1)
        return self.classifier(x)


def mobilenet_v2(
    num_classes: int = 10, width_mult: float = 1.0, dropout: float = 0.2
) -> MobileNetV2:
    """MobileNetV2 as ``torchvision.models.mobilenet_v2``; ``width_mult`` < 1 shrinks it."""
    return MobileNetV2(num_classes=num_classes, width_mult=width_mult, dropout=dropout)


# --------------------------------------------------------------------------------------------
# U-Net (the widely used "Pytorch-UNet" repository's unet_parts.py / unet_model.py)
# --------------------------------------------------------------------------------------------


class DoubleConv(nn.Module):
    """(3x3 conv, no bias -> BatchNorm -> ReLU) twice."""

    def __init__(self, in_channels: int, out_channels: int, mid_channels: int | None = None):
        super().__init__()
        mid = mid_channels or out_channels
        self.double_conv = nn.Sequential(
            nn.Conv2d(in_channels, mid, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(mid),
            nn.ReLU(inplace=True),
            nn.Conv2d(mid, out_channels, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(inplace=True),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.double_conv(x)


class Down(nn.Module):
    """2x2 max pool, then a ``DoubleConv``."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.maxpool_conv = nn.Sequential(nn.MaxPool2d(2), DoubleConv(in_channels, out_channels))

    def forward(self, x: Tensor) -> Tensor:
        return self.maxpool_conv(x)


class Up(nn.Module):
    """Upsample, pad to the skip's size, concatenate ``[skip, up]`` on channels, ``DoubleConv``."""

    def __init__(self, in_channels: int, out_channels: int, bilinear: bool = True) -> None:
        super().__init__()
        self.up: nn.Module
        if bilinear:
            self.up = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True)
            self.conv = DoubleConv(in_channels, out_channels, in_channels // 2)
        else:
            self.up = nn.ConvTranspose2d(in_channels, in_channels // 2, kernel_size=2, stride=2)
            self.conv = DoubleConv(in_channels, out_channels)

    def forward(self, x1: Tensor, x2: Tensor) -> Tensor:
        x1 = self.up(x1)
        diff_y = x2.size()[2] - x1.size()[2]
        diff_x = x2.size()[3] - x1.size()[3]
        x1 = F.pad(x1, [diff_x // 2, diff_x - diff_x // 2, diff_y // 2, diff_y - diff_y // 2])
        x = torch.cat([x2, x1], dim=1)
        return self.conv(x)


class OutConv(nn.Module):
    """The 1x1 convolution to class logits."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x)


class UNet(nn.Module):
    """Pytorch-UNet's ``UNet``: four ``Down`` and four ``Up`` stages; logits ``[N, classes, H, W]``.

    ``base`` is the first stage's width (64 in the original).
    """

    def __init__(
        self, n_channels: int, n_classes: int, bilinear: bool = False, base: int = 64
    ) -> None:
        super().__init__()
        self.n_channels = n_channels
        self.n_classes = n_classes
        self.bilinear = bilinear
        factor = 2 if bilinear else 1
        self.inc = DoubleConv(n_channels, base)
        self.down1 = Down(base, base * 2)
        self.down2 = Down(base * 2, base * 4)
        self.down3 = Down(base * 4, base * 8)
        self.down4 = Down(base * 8, base * 16 // factor)
        self.up1 = Up(base * 16, base * 8 // factor, bilinear)
        self.up2 = Up(base * 8, base * 4 // factor, bilinear)
        self.up3 = Up(base * 4, base * 2 // factor, bilinear)
        self.up4 = Up(base * 2, base, bilinear)
        self.outc = OutConv(base, n_classes)

    def forward(self, x: Tensor) -> Tensor:
        x1 = self.inc(x)
        x2 = self.down1(x1)
        x3 = self.down2(x2)
        x4 = self.down3(x3)
        x5 = self.down4(x4)
        x = self.up1(x5, x4)
        x = self.up2(x, x3)
        x = self.up3(x, x2)
        x = self.up4(x, x1)
        return self.outc(x)


def unet(n_channels: int = 3, n_classes: int = 4, base: int = 8, bilinear: bool = True) -> UNet:
    """A small Pytorch-UNet (``base`` 8 instead of 64) with bilinear upsampling by default."""
    return UNet(n_channels, n_classes, bilinear=bilinear, base=base)


# --------------------------------------------------------------------------------------------
# Vision Transformer (torchvision.models.vision_transformer)
# --------------------------------------------------------------------------------------------


class MLPBlock(nn.Sequential):
    """torchvision's ``MLPBlock`` (an ``ops.MLP``): Linear, GELU, Dropout, Linear, Dropout."""

    def __init__(self, in_dim: int, mlp_dim: int, dropout: float) -> None:
        super().__init__(
            nn.Linear(in_dim, mlp_dim),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(mlp_dim, in_dim),
            nn.Dropout(dropout),
        )
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.normal_(m.bias, std=1e-6)


def _vit_norm(dim: int) -> nn.LayerNorm:
    """torchvision's ViT LayerNorm (eps 1e-6, not the default 1e-5)."""
    return nn.LayerNorm(dim, eps=1e-6)


class EncoderBlock(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(
        self,
        num_heads: int,
        hidden_dim: int,
        mlp_dim: int,
        dropout: float,
        attention_dropout: float,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.ln_1 = _vit_norm(hidden_dim)
        self.self_attention = nn.MultiheadAttention(
            hidden_dim, num_heads, dropout=attention_dropout, batch_first=True
        )
        self.dropout = nn.Dropout(dropout)
        self.ln_2 = _vit_norm(hidden_dim)
        self.mlp = MLPBlock(hidden_dim, mlp_dim, dropout)

    def forward(self, input: Tensor) -> Tensor:
        torch._assert(input.dim() == 3, f"Expected (batch, seq, hidden), got {input.shape}")
        x = self.ln_1(input)
        x, _ = self.self_attention(x, x, x, need_weights=False)
        x = self.dropout(x)
        x = x + input
        y = self.mlp(self.ln_2(x))
        return x + y


class Encoder(nn.Module):
    """Learned position embedding, dropout, ``layers.encoder_layer_{i}``, final ``ln``."""

    def __init__(
        self,
        seq_length: int,
        num_layers: int,
        num_heads: int,
        hidden_dim: int,
        mlp_dim: int,
        dropout: float,
        attention_dropout: float,
    ) -> None:
        super().__init__()
        self.pos_embedding = nn.Parameter(torch.empty(1, seq_length, hidden_dim).normal_(std=0.02))
        self.dropout = nn.Dropout(dropout)
        layers: OrderedDict[str, nn.Module] = OrderedDict()
        for i in range(num_layers):
            layers[f"encoder_layer_{i}"] = EncoderBlock(
                num_heads, hidden_dim, mlp_dim, dropout, attention_dropout
            )
        self.layers = nn.Sequential(layers)
        self.ln = _vit_norm(hidden_dim)

    def forward(self, input: Tensor) -> Tensor:
        input = input + self.pos_embedding
        return self.ln(self.layers(self.dropout(input)))


class VisionTransformer(nn.Module):
    """torchvision's ``VisionTransformer`` (no representation layer, no conv stem).

    Initialisation differs in two places so every gradient is non-trivial: torchvision zeroes
    ``heads.head`` (which would zero every upstream gradient at step one) and ``class_token``;
    here the head keeps ``nn.Linear``'s default and the class token is N(0, 0.02).
    """

    def __init__(
        self,
        image_size: int,
        patch_size: int,
        num_layers: int,
        num_heads: int,
        hidden_dim: int,
        mlp_dim: int,
        dropout: float = 0.0,
        attention_dropout: float = 0.0,
        num_classes: int = 1000,
    ) -> None:
        super().__init__()
        self.image_size = image_size
        self.patch_size = patch_size
        self.hidden_dim = hidden_dim
        self.conv_proj = nn.Conv2d(3, hidden_dim, kernel_size=patch_size, stride=patch_size)
        seq_length = (image_size // patch_size) ** 2 + 1
        self.class_token = nn.Parameter(torch.empty(1, 1, hidden_dim).normal_(std=0.02))
        self.encoder = Encoder(
            seq_length, num_layers, num_heads, hidden_dim, mlp_dim, dropout, attention_dropout
        )
        self.seq_length = seq_length
        self.heads = nn.Sequential(OrderedDict([("head", nn.Linear(hidden_dim, num_classes))]))
        fan_in = 3 * patch_size * patch_size
        nn.init.trunc_normal_(self.conv_proj.weight, std=math.sqrt(1 / fan_in))
        nn.init.zeros_(self.conv_proj.bias)

    def _process_input(self, x: Tensor) -> Tensor:
        """Patchify: ``[n, 3, h, w]`` -> ``[n, (h/p)*(w/p), hidden]``."""
        n, _, h, w = x.shape
        p = self.patch_size
        torch._assert(h == self.image_size, "Wrong image height")
        torch._assert(w == self.image_size, "Wrong image width")
        n_h, n_w = h // p, w // p
        x = self.conv_proj(x)
        x = x.reshape(n, self.hidden_dim, n_h * n_w)
        return x.permute(0, 2, 1)

    def forward(self, x: Tensor) -> Tensor:
        x = self._process_input(x)
        n = x.shape[0]
        batch_class_token = self.class_token.expand(n, -1, -1)
        x = torch.cat([batch_class_token, x], dim=1)
        x = self.encoder(x)
        x = x[:, 0]
        return self.heads(x)


def vit(
    image_size: int = 32,
    patch_size: int = 8,
    num_layers: int = 2,
    num_heads: int = 2,
    hidden_dim: int = 32,
    mlp_dim: int = 64,
    num_classes: int = 10,
) -> VisionTransformer:
    """A tiny ViT with torchvision's structure (ViT-B/16 is 224, 16, 12, 12, 768, 3072)."""
    return VisionTransformer(
        image_size, patch_size, num_layers, num_heads, hidden_dim, mlp_dim, num_classes=num_classes
    )


# --------------------------------------------------------------------------------------------
# GPT-style decoder from torch.nn.TransformerEncoder
# --------------------------------------------------------------------------------------------


class GPT(nn.Module):
    """A GPT-style causal language model built from ``nn.TransformerEncoder`` (pre-norm, GELU).

    Mirrors the common "decoder-only from torch.nn" pattern (token + learned position
    embeddings, causal self-attention blocks, final LayerNorm, untied bias-free head).
    Input token ids ``[N, L]`` with ``L <= context``; returns logits ``[N, L, vocab]``.
    """

    def __init__(
        self, vocab: int = 64, context: int = 16, width: int = 32, heads: int = 2, layers: int = 2
    ) -> None:
        super().__init__()
        self.context = context
        self.tok_emb = nn.Embedding(vocab, width)
        self.pos_emb = nn.Parameter(torch.randn(context, width) * 0.02)
        layer = nn.TransformerEncoderLayer(
            width,
            heads,
            4 * width,
            dropout=0.0,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: Tensor) -> Tensor:
        length = idx.shape[1]
        x = self.tok_emb(idx) + self.pos_emb[:length]
        mask = nn.Transformer.generate_square_subsequent_mask(
            length, device=idx.device, dtype=x.dtype
        )
        x = self.blocks(x, mask=mask, is_causal=True)
        return self.head(self.ln_f(x))


def gpt(
    vocab: int = 64, context: int = 16, width: int = 32, heads: int = 2, layers: int = 2
) -> GPT:
    """The GPT-style decoder at test size."""
    return GPT(vocab, context, width, heads, layers)


# --------------------------------------------------------------------------------------------
# A decoder with RMSNorm and a SiLU-gated MLP (the Llama family's norm and MLP, torch.nn)
# --------------------------------------------------------------------------------------------


class RmsBlock(nn.Module):
    """Pre-norm causal block with ``nn.RMSNorm`` (eps 1e-6 before attention, the default
    None, the dtype's epsilon, before the MLP) and a SiLU-gated MLP: down(silu(gate(x)) *
    up(x)), bias-free, as in Llama (whose rotary positions this block leaves out)."""

    def __init__(self, width: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.input_norm = nn.RMSNorm(width, eps=1e-6)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.post_norm = nn.RMSNorm(width)
        self.gate = nn.Linear(width, hidden, bias=False)
        self.up = nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        h = self.input_norm(x)
        x = x + self.attn(h, h, h, attn_mask=mask, is_causal=True, need_weights=False)[0]
        h = self.post_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class RmsDecoder(nn.Module):
    """Token embeddings, ``RmsBlock`` layers, a final ``nn.RMSNorm`` without a weight and a
    bias-free head; logits ``[N, L, vocab]``."""

    def __init__(
        self, vocab: int = 64, width: int = 32, heads: int = 2, hidden: int = 48, layers: int = 2
    ) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(RmsBlock(width, heads, hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(width, elementwise_affine=False)
        self.head = nn.Linear(width, vocab, bias=False)
        with torch.no_grad():  # weights away from 1, so a swapped or missing one shows
            for module in self.modules():
                if isinstance(module, nn.RMSNorm) and module.weight is not None:
                    module.weight.uniform_(0.5, 1.5)

    def forward(self, idx: Tensor) -> Tensor:
        length = idx.shape[1]
        x = self.tok_emb(idx)
        mask = nn.Transformer.generate_square_subsequent_mask(
            length, device=idx.device, dtype=x.dtype
        )
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


def rms_decoder(**kwargs: Any) -> RmsDecoder:
    """The RMSNorm decoder at test size."""
    return RmsDecoder(**kwargs)


# --------------------------------------------------------------------------------------------
# Recurrent classifiers: nn.LSTM and a bidirectional nn.GRU (batch first)
# --------------------------------------------------------------------------------------------


class LstmClassifier(nn.Module):
    """Token embeddings, a 2-layer ``nn.LSTM`` (batch first, zero initial states) and a
    linear head on the last step; logits ``[N, classes]``."""

    def __init__(
        self, vocab: int = 32, width: int = 16, hidden: int = 12, layers: int = 2, classes: int = 5
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.rnn = nn.LSTM(width, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, ids: Tensor) -> Tensor:
        out, _ = self.rnn(self.embed(ids))
        return self.head(out[:, -1])


def lstm_classifier(**kwargs: Any) -> LstmClassifier:
    """The LSTM classifier at test size."""
    return LstmClassifier(**kwargs)


class BiGruClassifier(nn.Module):
    """Features through a linear map, a bidirectional bias-free ``nn.GRU`` (batch first), the
    mean over time and a linear head; logits ``[N, classes]``."""

    def __init__(self, features: int = 6, hidden: int = 8, classes: int = 4) -> None:
        super().__init__()
        self.proj = nn.Linear(features, features)
        self.rnn = nn.GRU(features, hidden, batch_first=True, bidirectional=True, bias=False)
        self.head = nn.Linear(2 * hidden, classes)

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.rnn(torch.tanh(self.proj(x)))
        return self.head(out.mean(dim=1))


def bigru_classifier(**kwargs: Any) -> BiGruClassifier:
    """The bidirectional GRU classifier at test size."""
    return BiGruClassifier(**kwargs)


# --------------------------------------------------------------------------------------------
# EfficientNet-B0 (torchvision.models.efficientnet, torchvision.ops.misc)
# --------------------------------------------------------------------------------------------


class SqueezeExcitation(nn.Module):
    """torchvision.ops' squeeze-excitation: global average, two 1x1 convs, a sigmoid gate
    multiplied over H and W (``scale * input``, a ``[N, C, 1, 1]`` by ``[N, C, H, W]``)."""

    def __init__(
        self,
        input_channels: int,
        squeeze_channels: int,
        activation: Callable[..., nn.Module] = nn.ReLU,
        scale_activation: Callable[..., nn.Module] = nn.Sigmoid,
    ) -> None:
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(input_channels, squeeze_channels, 1)
        self.fc2 = nn.Conv2d(squeeze_channels, input_channels, 1)
        self.activation = activation()
        self.scale_activation = scale_activation()

    def _scale(self, x: Tensor) -> Tensor:
        scale = self.activation(self.fc1(self.avgpool(x)))
        return self.scale_activation(self.fc2(scale))

    def forward(self, x: Tensor) -> Tensor:
        return self._scale(x) * x


class StochasticDepth(nn.Module):
    """torchvision.ops' per-sample residual drop ("row": one Bernoulli draw per sample, the
    survivors scaled by 1/(1-p)); the identity in eval mode or at ``p == 0``."""

    def __init__(self, p: float, mode: str) -> None:
        super().__init__()
        self.p = p
        self.mode = mode

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        shape = [x.shape[0]] + [1] * (x.ndim - 1) if self.mode == "row" else [1] * x.ndim
        survival = 1.0 - self.p
        noise = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(survival)
        return x * noise.div_(survival)


class MBConvConfig:
    """One stage of the EfficientNet table; channels and depth scaled as torchvision does."""

    def __init__(
        self,
        expand_ratio: float,
        kernel: int,
        stride: int,
        input_channels: int,
        out_channels: int,
        num_layers: int,
        width_mult: float = 1.0,
        depth_mult: float = 1.0,
    ) -> None:
        self.expand_ratio = expand_ratio
        self.kernel = kernel
        self.stride = stride
        self.input_channels = self.adjust_channels(input_channels, width_mult)
        self.out_channels = self.adjust_channels(out_channels, width_mult)
        self.num_layers = int(math.ceil(num_layers * depth_mult))

    @staticmethod
    def adjust_channels(channels: float, width_mult: float) -> int:
        return _make_divisible(channels * width_mult, 8)


class MBConv(nn.Module):
    """torchvision's EfficientNet block: [1x1 expand], depthwise kxk, squeeze-excitation,
    1x1 projection without activation; ``result += input`` behind stochastic depth when the
    shape is kept."""

    def __init__(self, cnf: MBConvConfig, stochastic_depth_prob: float) -> None:
        super().__init__()
        self.use_res_connect = cnf.stride == 1 and cnf.input_channels == cnf.out_channels
        layers: list[nn.Module] = []
        expanded = cnf.adjust_channels(cnf.input_channels, cnf.expand_ratio)
        if expanded != cnf.input_channels:
            layers.append(
                Conv2dNormActivation(
                    cnf.input_channels, expanded, kernel_size=1, activation_layer=nn.SiLU
                )
            )
        layers.append(
            Conv2dNormActivation(
                expanded,
                expanded,
                kernel_size=cnf.kernel,
                stride=cnf.stride,
                groups=expanded,
                activation_layer=nn.SiLU,
            )
        )
        squeeze = max(1, cnf.input_channels // 4)
        layers.append(
            SqueezeExcitation(expanded, squeeze, activation=partial(nn.SiLU, inplace=True))
        )
        layers.append(
            Conv2dNormActivation(expanded, cnf.out_channels, kernel_size=1, activation_layer=None)
        )
        self.block = nn.Sequential(*layers)
        self.stochastic_depth = StochasticDepth(stochastic_depth_prob, "row")
        self.out_channels = cnf.out_channels

    def forward(self, x: Tensor) -> Tensor:
        result = self.block(x)
        if self.use_res_connect:
            result = self.stochastic_depth(result)
            result += x
        return result


# (expand_ratio, kernel, stride, input_channels, out_channels, num_layers) of B0.
EFFICIENTNET_B0_SETTING = [
    (1, 3, 1, 32, 16, 1),
    (6, 3, 2, 16, 24, 2),
    (6, 5, 2, 24, 40, 2),
    (6, 3, 2, 40, 80, 3),
    (6, 5, 1, 80, 112, 3),
    (6, 5, 2, 112, 192, 4),
    (6, 3, 1, 192, 320, 1),
]


class EfficientNet(nn.Module):
    """torchvision's ``EfficientNet`` (v1): SiLU stem, seven MBConv stages, 1x1 head to
    4x the last width, global pool, ``classifier`` (Dropout, Linear)."""

    def __init__(
        self,
        setting: list[MBConvConfig],
        dropout: float,
        stochastic_depth_prob: float = 0.2,
        num_classes: int = 1000,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = [
            Conv2dNormActivation(
                3, setting[0].input_channels, kernel_size=3, stride=2, activation_layer=nn.SiLU
            )
        ]
        total = sum(cnf.num_layers for cnf in setting)
        block_id = 0
        for cnf in setting:
            stage: list[nn.Module] = []
            for _ in range(cnf.num_layers):
                block_cnf = copy.copy(cnf)
                if stage:  # later blocks of a stage keep its width and resolution
                    block_cnf.input_channels = block_cnf.out_channels
                    block_cnf.stride = 1
                stage.append(MBConv(block_cnf, stochastic_depth_prob * block_id / total))
                block_id += 1
            layers.append(nn.Sequential(*stage))
        last_in = setting[-1].out_channels
        last_out = 4 * last_in
        layers.append(
            Conv2dNormActivation(last_in, last_out, kernel_size=1, activation_layer=nn.SiLU)
        )
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(
            nn.Dropout(p=dropout, inplace=True), nn.Linear(last_out, num_classes)
        )
        _init_convnet(self)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                bound = 1.0 / math.sqrt(m.out_features)
                nn.init.uniform_(m.weight, -bound, bound)
                nn.init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        x = self.avgpool(self.features(x))
        x = torch.flatten(x, 1)
        return self.classifier(x)


def efficientnet_b0(
    num_classes: int = 10,
    width_mult: float = 1.0,
    depth_mult: float = 1.0,
    dropout: float = 0.2,
    stochastic_depth_prob: float = 0.0,
) -> EfficientNet:
    """EfficientNet-B0 as ``torchvision.models.efficientnet_b0`` (B0 is width 1.0, depth 1.0,
    dropout 0.2). ``stochastic_depth_prob`` defaults to 0, not torchvision's 0.2: a random
    per-sample residual drop has no registry operator, and at 0 (or in eval mode)
    ``StochasticDepth`` is the identity, so the module still computes what torchvision's
    computes at inference."""
    setting = [
        MBConvConfig(*row, width_mult=width_mult, depth_mult=depth_mult)
        for row in EFFICIENTNET_B0_SETTING
    ]
    return EfficientNet(setting, dropout, stochastic_depth_prob, num_classes)


# --------------------------------------------------------------------------------------------
# ConvNeXt (torchvision.models.convnext)
# --------------------------------------------------------------------------------------------


class Permute(nn.Module):
    """torchvision.ops' ``Permute``: ``torch.permute`` as a module of a ``Sequential``."""

    def __init__(self, dims: list[int]) -> None:
        super().__init__()
        self.dims = dims

    def forward(self, x: Tensor) -> Tensor:
        return torch.permute(x, self.dims)


class LayerNorm2d(nn.LayerNorm):
    """A LayerNorm over the channels of ``[N, C, H, W]``: channels last, normalise, back."""

    def forward(self, x: Tensor) -> Tensor:
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class CNBlock(nn.Module):
    """torchvision's ConvNeXt block: depthwise 7x7, channels-last LayerNorm, Linear 4x,
    GELU, Linear back, channels first, times the ``layer_scale`` parameter ``[C, 1, 1]``,
    stochastic depth, ``result += input``."""

    def __init__(self, dim: int, layer_scale: float, stochastic_depth_prob: float) -> None:
        super().__init__()
        self.block = nn.Sequential(
            nn.Conv2d(dim, dim, kernel_size=7, padding=3, groups=dim, bias=True),
            Permute([0, 2, 3, 1]),
            nn.LayerNorm(dim, eps=1e-6),
            nn.Linear(dim, 4 * dim, bias=True),
            nn.GELU(),
            nn.Linear(4 * dim, dim, bias=True),
            Permute([0, 3, 1, 2]),
        )
        self.layer_scale = nn.Parameter(torch.ones(dim, 1, 1) * layer_scale)
        self.stochastic_depth = StochasticDepth(stochastic_depth_prob, "row")

    def forward(self, x: Tensor) -> Tensor:
        result = self.layer_scale * self.block(x)
        result = self.stochastic_depth(result)
        result += x
        return result


class ConvNeXt(nn.Module):
    """torchvision's ``ConvNeXt``: a 4x4/4 patchify stem with LayerNorm2d, stages of
    ``CNBlock`` with (LayerNorm2d, 2x2/2 conv) downsampling between them, global pool,
    ``classifier`` (LayerNorm2d, Flatten, Linear).

    ``block_setting`` rows are (input_channels, out_channels or None, num_layers).
    """

    def __init__(
        self,
        block_setting: list[tuple[int, int | None, int]],
        stochastic_depth_prob: float = 0.0,
        layer_scale: float = 1e-6,
        num_classes: int = 1000,
    ) -> None:
        super().__init__()
        norm_layer = partial(LayerNorm2d, eps=1e-6)
        first = block_setting[0][0]
        layers: list[nn.Module] = [
            Conv2dNormActivation(
                3,
                first,
                kernel_size=4,
                stride=4,
                padding=0,
                norm_layer=norm_layer,
                activation_layer=None,
                bias=True,
            )
        ]
        total = sum(row[2] for row in block_setting)
        block_id = 0
        for channels, out_channels, num_layers in block_setting:
            stage = []
            for _ in range(num_layers):
                sd_prob = stochastic_depth_prob * block_id / max(total - 1.0, 1.0)
                stage.append(CNBlock(channels, layer_scale, sd_prob))
                block_id += 1
            layers.append(nn.Sequential(*stage))
            if out_channels is not None:
                layers.append(
                    nn.Sequential(
                        norm_layer(channels),
                        nn.Conv2d(channels, out_channels, kernel_size=2, stride=2),
                    )
                )
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        last = block_setting[-1]
        last_channels = last[1] if last[1] is not None else last[0]
        self.classifier = nn.Sequential(
            norm_layer(last_channels), nn.Flatten(1), nn.Linear(last_channels, num_classes)
        )
        for m in self.modules():
            if isinstance(m, nn.Conv2d | nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.avgpool(self.features(x)))


def convnext_tiny(
    num_classes: int = 10,
    widths: tuple[int, ...] = (96, 192, 384, 768),
    depths: tuple[int, ...] = (3, 3, 9, 3),
    layer_scale: float = 1e-6,
    stochastic_depth_prob: float = 0.0,
) -> ConvNeXt:
    """ConvNeXt-T as ``torchvision.models.convnext_tiny`` at the default knobs, except
    ``stochastic_depth_prob`` (0.1 there; 0 here, see ``efficientnet_b0``). The tests
    shrink ``widths``/``depths`` and raise ``layer_scale`` (torchvision's 1e-6 makes the
    blocks' gradients a millionth of the stem's, a weak comparison)."""
    setting = [
        (w, widths[i + 1] if i + 1 < len(widths) else None, d)
        for i, (w, d) in enumerate(zip(widths, depths))
    ]
    return ConvNeXt(setting, stochastic_depth_prob, layer_scale, num_classes)


# --------------------------------------------------------------------------------------------
# DenseNet (torchvision.models.densenet)
# --------------------------------------------------------------------------------------------


class _DenseLayer(nn.Module):
    """torchvision's dense layer: concat of all earlier features, BN-ReLU-1x1 conv to
    ``bn_size * growth_rate``, BN-ReLU-3x3 conv to ``growth_rate`` new features."""

    def __init__(
        self, num_input_features: int, growth_rate: int, bn_size: int, drop_rate: float
    ) -> None:
        super().__init__()
        width = bn_size * growth_rate
        self.norm1 = nn.BatchNorm2d(num_input_features)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(num_input_features, width, kernel_size=1, stride=1, bias=False)
        self.norm2 = nn.BatchNorm2d(width)
        self.relu2 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(width, growth_rate, kernel_size=3, stride=1, padding=1, bias=False)
        self.drop_rate = float(drop_rate)

    def bn_function(self, inputs: list[Tensor]) -> Tensor:
        concated = torch.cat(inputs, 1)
        return self.conv1(self.relu1(self.norm1(concated)))

    def forward(self, features: Tensor | list[Tensor]) -> Tensor:
        previous = [features] if isinstance(features, Tensor) else features
        bottleneck = self.bn_function(previous)
        new_features = self.conv2(self.relu2(self.norm2(bottleneck)))
        if self.drop_rate > 0:
            new_features = F.dropout(new_features, p=self.drop_rate, training=self.training)
        return new_features


class _DenseBlock(nn.ModuleDict):
    """``denselayer1`` .. ``denselayerK``, each fed the list of all features so far; the
    block returns their concat."""

    def __init__(
        self,
        num_layers: int,
        num_input_features: int,
        bn_size: int,
        growth_rate: int,
        drop_rate: float,
    ) -> None:
        super().__init__()
        for i in range(num_layers):
            layer = _DenseLayer(
                num_input_features + i * growth_rate, growth_rate, bn_size, drop_rate
            )
            self.add_module(f"denselayer{i + 1}", layer)

    def forward(self, init_features: Tensor) -> Tensor:
        features = [init_features]
        for _, layer in self.items():
            features.append(layer(features))
        return torch.cat(features, 1)


class _Transition(nn.Sequential):
    """BN, ReLU, 1x1 conv halving the width, 2x2 average pool."""

    def __init__(self, num_input_features: int, num_output_features: int) -> None:
        super().__init__()
        self.norm = nn.BatchNorm2d(num_input_features)
        self.relu = nn.ReLU(inplace=True)
        self.conv = nn.Conv2d(
            num_input_features, num_output_features, kernel_size=1, stride=1, bias=False
        )
        self.pool = nn.AvgPool2d(kernel_size=2, stride=2)


class DenseNet(nn.Module):
    """torchvision's ``DenseNet``: ``features`` (conv0, norm0, relu0, pool0, dense blocks
    with transitions between them, norm5), ReLU, global pool, ``classifier``."""

    def __init__(
        self,
        growth_rate: int = 32,
        block_config: tuple[int, ...] = (6, 12, 24, 16),
        num_init_features: int = 64,
        bn_size: int = 4,
        drop_rate: float = 0.0,
        num_classes: int = 1000,
    ) -> None:
        super().__init__()
        stem = [
            ("conv0", nn.Conv2d(3, num_init_features, 7, stride=2, padding=3, bias=False)),
            ("norm0", nn.BatchNorm2d(num_init_features)),
            ("relu0", nn.ReLU(inplace=True)),
            ("pool0", nn.MaxPool2d(kernel_size=3, stride=2, padding=1)),
        ]
        self.features = nn.Sequential(OrderedDict(stem))
        width = num_init_features
        for i, num_layers in enumerate(block_config):
            block = _DenseBlock(num_layers, width, bn_size, growth_rate, drop_rate)
            self.features.add_module(f"denseblock{i + 1}", block)
            width += num_layers * growth_rate
            if i != len(block_config) - 1:
                self.features.add_module(f"transition{i + 1}", _Transition(width, width // 2))
                width //= 2
        self.features.add_module("norm5", nn.BatchNorm2d(width))
        self.classifier = nn.Linear(width, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.features(x), inplace=True)
        out = F.adaptive_avg_pool2d(out, (1, 1))
        return self.classifier(torch.flatten(out, 1))


def densenet(
    num_classes: int = 10,
    growth_rate: int = 32,
    block_config: tuple[int, ...] = (6, 12, 24, 16),
    num_init_features: int = 64,
    bn_size: int = 4,
    drop_rate: float = 0.0,
) -> DenseNet:
    """DenseNet-121 as ``torchvision.models.densenet121`` at the defaults; the tests use a
    small growth rate and two dense blocks."""
    return DenseNet(growth_rate, block_config, num_init_features, bn_size, drop_rate, num_classes)


# --------------------------------------------------------------------------------------------
# An MLP autoencoder (the common "AutoEncoder(nn.Module)" tutorial layout), for mse_loss
# --------------------------------------------------------------------------------------------


class AutoEncoder(nn.Module):
    """``encoder1 -> ReLU -> encoder2 -> ReLU -> decoder1 -> ReLU -> decoder2 -> Sigmoid``:
    named ``Linear`` layers on the root module, reconstructions in (0, 1) for ``mse_loss``
    against the input's shape."""

    def __init__(self, features: int = 32, hidden: int = 16, code: int = 4) -> None:
        super().__init__()
        self.encoder1 = nn.Linear(features, hidden)
        self.encoder2 = nn.Linear(hidden, code)
        self.decoder1 = nn.Linear(code, hidden)
        self.decoder2 = nn.Linear(hidden, features)
        self.relu = nn.ReLU()
        self.sigmoid = nn.Sigmoid()

    def encode(self, x: Tensor) -> Tensor:
        return self.relu(self.encoder2(self.relu(self.encoder1(x))))

    def forward(self, x: Tensor) -> Tensor:
        code = self.encode(x)
        return self.sigmoid(self.decoder2(self.relu(self.decoder1(code))))


def autoencoder(features: int = 32, hidden: int = 16, code: int = 4) -> AutoEncoder:
    """The MLP autoencoder at test size."""
    return AutoEncoder(features, hidden, code)


# --------------------------------------------------------------------------------------------
# A 1-D temporal convolutional network for sequence classification
# --------------------------------------------------------------------------------------------


class Chomp1d(nn.Module):
    """locuslab/TCN's ``Chomp1d``: drops the last ``chomp_size`` steps, which turns a conv
    padded by ``(k - 1) * dilation`` on both sides into a causal one."""

    def __init__(self, chomp_size: int) -> None:
        super().__init__()
        self.chomp_size = chomp_size

    def forward(self, x: Tensor) -> Tensor:
        return x[:, :, : -self.chomp_size].contiguous()


class TemporalBlock(nn.Module):
    """A residual block of the TCN layout (Bai et al. 2018, locuslab/TCN): two dilated
    ``Conv1d`` with ``BatchNorm1d`` and ReLU (batch norm in place of weight norm), a 1x1
    ``downsample`` when the width changes. ``causal``: locuslab's padding and ``Chomp1d``
    (each output sees only earlier steps); otherwise "same" padding, no chomp."""

    def __init__(
        self, n_inputs: int, n_outputs: int, kernel_size: int, dilation: int, causal: bool = False
    ) -> None:
        super().__init__()
        padding = (kernel_size - 1) * dilation if causal else (kernel_size - 1) // 2 * dilation
        self.conv1 = nn.Conv1d(n_inputs, n_outputs, kernel_size, padding=padding, dilation=dilation)
        self.chomp1 = Chomp1d(padding) if causal else None
        self.bn1 = nn.BatchNorm1d(n_outputs)
        self.conv2 = nn.Conv1d(
            n_outputs, n_outputs, kernel_size, padding=padding, dilation=dilation
        )
        self.chomp2 = Chomp1d(padding) if causal else None
        self.bn2 = nn.BatchNorm1d(n_outputs)
        self.relu = nn.ReLU()
        self.downsample = nn.Conv1d(n_inputs, n_outputs, 1) if n_inputs != n_outputs else None

    @staticmethod
    def _chomp(chomp: nn.Module | None, x: Tensor) -> Tensor:
        return x if chomp is None else chomp(x)

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self._chomp(self.chomp1, self.conv1(x))))
        out = self.bn2(self._chomp(self.chomp2, self.conv2(out)))
        residual = x if self.downsample is None else self.downsample(x)
        return self.relu(out + residual)


class TemporalConvNet(nn.Module):
    """``network`` of ``TemporalBlock`` with dilations 1, 2, 4, ...; ``pool``
    (``AdaptiveAvgPool1d(1)``) over time; ``fc`` to the classes. Input ``[N, C, L]``."""

    def __init__(
        self,
        num_inputs: int,
        num_channels: list[int],
        kernel_size: int,
        num_classes: int,
        causal: bool = False,
    ) -> None:
        super().__init__()
        blocks = []
        for i, width in enumerate(num_channels):
            previous = num_inputs if i == 0 else num_channels[i - 1]
            blocks.append(TemporalBlock(previous, width, kernel_size, 2**i, causal))
        self.network = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool1d(1)
        self.fc = nn.Linear(num_channels[-1], num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(torch.flatten(self.pool(self.network(x)), 1))


def tcn(
    num_inputs: int = 4,
    channels: tuple[int, ...] = (16, 16, 32),
    kernel_size: int = 3,
    num_classes: int = 5,
    causal: bool = False,
) -> TemporalConvNet:
    """A small TCN classifier for ``[N, num_inputs, L]`` sequences."""
    return TemporalConvNet(num_inputs, list(channels), kernel_size, num_classes, causal)


# --------------------------------------------------------------------------------------------
# A network the importer must refuse, for the error-listing test
# --------------------------------------------------------------------------------------------


class SpectralMix(nn.Module):
    """Mixes features through an FFT magnitude and a data-dependent ``torch.where``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width // 2 + 1, width)

    def forward(self, x: Tensor) -> Tensor:
        spectrum = torch.fft.rfft(x, dim=-1).abs()
        y = self.proj(spectrum)
        return torch.where(y > x, y, x * 0.5)


class Unsupported(nn.Module):
    """Unmappable ops at several module paths: ``rnn`` (an LSTM with dropout between its
    layers in training), ``mix`` (rfft, where), and
    ``x.unfold`` in the top-level forward. Input ``[N, 8, width]``; returns ``[N, classes]``."""

    def __init__(self, width: int = 8, hidden: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.rnn = nn.LSTM(width, hidden, num_layers=2, dropout=0.5, batch_first=True)
        self.mix = SpectralMix(hidden)
        self.fc = nn.Linear(hidden * 2, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.relu(self.embed(x))
        x, _ = self.rnn(x)
        x = self.mix(x)
        windows = x.unfold(1, 2, 2)  # [N, L/2, hidden, 2]
        pooled = windows.mean(dim=1).flatten(1)
        return self.fc(pooled)


# --------------------------------------------------------------------------------------------
# Hugging Face transformers models from tiny configs (no weights downloaded)
# --------------------------------------------------------------------------------------------


def hf_gpt2(
    vocab: int = 64,
    positions: int = 16,
    width: int = 32,
    heads: int = 2,
    layers: int = 2,
    attn_implementation: str = "eager",
    tie_word_embeddings: bool = True,
    freeze: list[str] | None = None,
    dropout: float = 0.0,
) -> nn.Module:
    """``transformers.GPT2LMHeadModel`` from a 2-layer config; ``forward(input_ids).logits``.

    ``use_cache`` is off so the output holds no key/value cache. GPT-2 ties ``lm_head.weight``
    to ``transformer.wte.weight`` (one parameter under two state-dict keys); pass
    ``tie_word_embeddings=False`` for an untied head. ``freeze``: module paths whose
    parameters do not train.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab,
        n_positions=positions,
        n_embd=width,
        n_layer=layers,
        n_head=heads,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        use_cache=False,
        bos_token_id=vocab - 1,
        eos_token_id=vocab - 1,
        tie_word_embeddings=tie_word_embeddings,
        attn_implementation=attn_implementation,
    )
    return frozen(GPT2LMHeadModel(config), freeze)


def frozen(model: nn.Module, prefixes: list[str] | None) -> nn.Module:
    """``model`` with the parameters under each module path of ``prefixes`` frozen
    (``requires_grad_(False)``: a fine-tune's frozen backbone)."""
    for prefix in prefixes or ():
        for p in model.get_submodule(prefix).parameters():
            p.requires_grad_(False)
    return model


def hf_bert(
    vocab: int = 64,
    positions: int = 16,
    width: int = 32,
    heads: int = 2,
    layers: int = 2,
    num_labels: int = 3,
    attn_implementation: str = "eager",
    classify: bool = True,
    dropout: float = 0.0,
) -> nn.Module:
    """``transformers.BertForSequenceClassification`` (or ``BertModel`` when ``classify`` is
    false) from a 2-layer config; ``forward(input_ids)`` with no attention mask."""
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    config = BertConfig(
        vocab_size=vocab,
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * width,
        max_position_embeddings=positions,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        classifier_dropout=dropout,
        num_labels=num_labels,
        use_cache=False,
        attn_implementation=attn_implementation,
    )
    if classify:
        return BertForSequenceClassification(config)
    return BertModel(config)


def hf_distilbert(
    vocab: int = 64,
    positions: int = 16,
    width: int = 32,
    heads: int = 2,
    layers: int = 2,
    attn_implementation: str = "sdpa",
) -> nn.Module:
    """``transformers.DistilBertForSequenceClassification`` from a 2-layer config with its
    defaults otherwise (dropout 0.1, attention dropout 0.1, sequence-classifier dropout
    0.2); ``forward(input_ids).logits``."""
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    config = DistilBertConfig(
        vocab_size=vocab,
        dim=width,
        n_layers=layers,
        n_heads=heads,
        hidden_dim=2 * width,
        max_position_embeddings=positions,
        attn_implementation=attn_implementation,
    )
    return DistilBertForSequenceClassification(config)


def hf_roberta(
    vocab: int = 64,
    positions: int = 20,
    width: int = 32,
    heads: int = 2,
    layers: int = 2,
    attn_implementation: str = "sdpa",
) -> nn.Module:
    """``transformers.RobertaForSequenceClassification`` from a 2-layer config with its
    defaults otherwise (dropout 0.1, attention's included; position ids computed from the
    token ids, padding at 1); ``forward(input_ids).logits``."""
    from transformers import RobertaConfig, RobertaForSequenceClassification

    config = RobertaConfig(
        vocab_size=vocab,
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=2 * width,
        max_position_embeddings=positions,
        pad_token_id=1,
        attn_implementation=attn_implementation,
    )
    return RobertaForSequenceClassification(config)


def hf_gpt_neox(attn_implementation: str = "sdpa") -> nn.Module:
    """``transformers.GPTNeoXForCausalLM`` from a 2-layer config with its defaults (partial
    rotary embeddings on a quarter of each head, q/k/v taken apart with ``chunk``)."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
        use_cache=False,
        attn_implementation=attn_implementation,
    )
    return GPTNeoXForCausalLM(config)


def hf_phi(attn_implementation: str = "sdpa") -> nn.Module:
    """``transformers.PhiForCausalLM`` from a 2-layer config with its defaults (parallel
    attention and MLP, LayerNorm, partial rotary embeddings, biases)."""
    from transformers import PhiConfig, PhiForCausalLM

    config = PhiConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
        use_cache=False,
        attn_implementation=attn_implementation,
    )
    return PhiForCausalLM(config)


def hf_opt(attn_implementation: str = "sdpa") -> nn.Module:
    """``transformers.OPTForCausalLM`` from a 2-layer config with its defaults (dropout 0.1,
    learned positions offset by 2, a tied head, the MLP run on the tokens flattened to rows
    ``[N*L, E]`` and viewed back)."""
    from transformers import OPTConfig, OPTForCausalLM

    config = OPTConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        ffn_dim=64,
        max_position_embeddings=32,
        word_embed_proj_dim=32,
        use_cache=False,
        attn_implementation=attn_implementation,
    )
    return OPTForCausalLM(config)


def hf_gemma(attn_implementation: str = "sdpa") -> nn.Module:
    """``transformers.GemmaForCausalLM`` from a 2-layer config with its defaults (RMSNorm
    times 1 + weight, the embedding scaled by sqrt(hidden), tanh GELU gates, multi-query
    attention, tied head)."""
    from transformers import GemmaConfig, GemmaForCausalLM

    config = GemmaConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        max_position_embeddings=32,
        use_cache=False,
        attn_implementation=attn_implementation,
    )
    return GemmaForCausalLM(config)


def hf_t5(
    dropout: float = 0.0,
    attn_implementation: str = "sdpa",
    feed_forward_proj: str = "relu",
) -> nn.Module:
    """``transformers.T5ForConditionalGeneration`` from a 2 + 2 layer config with its defaults
    otherwise: T5LayerNorm, relative position biases (8 buckets up to distance 16) in the
    first layer of each stack, cross-attention from the decoder to the encoder, the shared
    embedding tied to the head (scaled by d_model**-0.5). ``forward(input_ids,
    decoder_input_ids=...).logits``; ``dropout`` is every dropout (T5's default is 0.1)."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=64,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=dropout,
        feed_forward_proj=feed_forward_proj,
        use_cache=False,
        decoder_start_token_id=0,
        pad_token_id=0,
        attn_implementation=attn_implementation,
    )
    return T5ForConditionalGeneration(config)


def hf_bart(dropout: float = 0.1, attn_implementation: str = "sdpa") -> nn.Module:
    """``transformers.BartForConditionalGeneration`` from a 2 + 2 layer config with its
    defaults otherwise (dropout 0.1, learned positions offset by 2, the shared embedding
    tied to both stacks and the head, the ``final_logits_bias`` buffer). ``forward(
    input_ids, decoder_input_ids=...).logits``: with the decoder's ids given,
    shift_tokens_right does not run."""
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(
        vocab_size=64,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=32,
        dropout=dropout,
        attention_dropout=dropout,
        activation_dropout=dropout,
        use_cache=False,
        attn_implementation=attn_implementation,
    )
    return BartForConditionalGeneration(config)


def hf_llama(
    vocab: int = 64,
    positions: int = 32,
    width: int = 32,
    heads: int = 4,
    kv_heads: int = 2,
    layers: int = 2,
    attn_implementation: str = "sdpa",
    tie_word_embeddings: bool = False,
    family: str = "llama",
    use_cache: bool = False,
    rope_parameters: dict | None = None,
) -> nn.Module:
    """``transformers.LlamaForCausalLM`` (or Mistral / Qwen2 with ``family``) from a 2-layer
    config with its defaults otherwise: RMSNorm written as pow / mean / rsqrt, rotary
    position embeddings, a SiLU-gated MLP, grouped-query attention (``kv_heads`` key/value
    heads for ``heads`` query heads); ``forward(input_ids).logits``."""
    import transformers

    names = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "mistral": ("MistralConfig", "MistralForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    }
    config_name, model_name = names[family]
    config = getattr(transformers, config_name)(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=positions,
        use_cache=use_cache,
        tie_word_embeddings=tie_word_embeddings,
        attn_implementation=attn_implementation,
        bos_token_id=vocab - 1,
        eos_token_id=vocab - 1,
        pad_token_id=None,
        **({"rope_parameters": rope_parameters} if rope_parameters is not None else {}),
    )
    return getattr(transformers, model_name)(config)


# --------------------------------------------------------------------------------------------
# The zoo and a quick self-check
# --------------------------------------------------------------------------------------------


def _images(size: int = 32) -> Callable[[int], Tensor]:
    return lambda n: torch.randn(n, 3, size, size)


def _tokens(vocab: int = 64, length: int = 16) -> Callable[[int], Tensor]:
    return lambda n: torch.randint(0, vocab, (n, length))


# name -> (factory, test-size kwargs, example input for batch n)
ZOO: dict[str, tuple[Callable[..., nn.Module], dict[str, Any], Callable[[int], Tensor]]] = {
    "resnet18": (resnet18, {}, _images()),
    "vgg11_bn": (vgg11_bn, {"hidden": 64, "dropout": 0.0}, _images()),
    "mobilenet_v2": (mobilenet_v2, {"dropout": 0.0}, _images()),
    "unet": (unet, {}, _images()),
    "vit": (vit, {}, _images()),
    "gpt": (gpt, {}, _tokens()),
    "unsupported": (Unsupported, {}, lambda n: torch.randn(n, 8, 8)),
    "hf_gpt2": (hf_gpt2, {}, _tokens()),
    "hf_bert": (hf_bert, {}, _tokens()),
    "hf_llama": (hf_llama, {}, _tokens()),
    "hf_distilbert": (hf_distilbert, {}, _tokens()),
    "hf_roberta": (hf_roberta, {}, _tokens()),
    "hf_gpt_neox": (hf_gpt_neox, {}, _tokens()),
    "hf_phi": (hf_phi, {}, _tokens()),
    "hf_gemma": (hf_gemma, {}, _tokens()),
    "hf_opt": (hf_opt, {}, _tokens()),
    "efficientnet_b0": (efficientnet_b0, {"width_mult": 0.1, "depth_mult": 0.5}, _images()),
    "convnext_tiny": (
        convnext_tiny,
        {"widths": (8, 16), "depths": (2, 1), "layer_scale": 0.5},
        _images(),
    ),
    "densenet": (
        densenet,
        {"growth_rate": 4, "block_config": (2, 2), "num_init_features": 8, "bn_size": 2},
        _images(),
    ),
    "autoencoder": (autoencoder, {}, lambda n: torch.rand(n, 32)),
    "tcn": (tcn, {}, lambda n: torch.randn(n, 4, 32)),
}


def _self_check() -> None:
    """Build each network, run one float64 forward at batch 2, print its output and key count."""
    import time

    torch.manual_seed(0)
    for name, (factory, kwargs, example) in ZOO.items():
        try:
            model = factory(**kwargs).double().train()
        except ImportError as err:
            print(f"{name:14s} skipped: {err}")
            continue
        x = example(2)
        x = x.double() if x.is_floating_point() else x
        start = time.perf_counter()
        out = model(x)
        out = out if isinstance(out, Tensor) else out[0]
        out.sum().backward()
        took = time.perf_counter() - start
        keys = len(model.state_dict())
        print(f"{name:14s} out {tuple(out.shape)!s:16s} keys {keys:4d}  step {took:.3f}s")


if __name__ == "__main__":
    _self_check()


# --------------------------------------------------------------------------------------------
# Learned scalars: a 0-d parameter, and elements of a parameter vector
# --------------------------------------------------------------------------------------------


class ScaledHead(nn.Module):
    """A linear head times a learned 0-d temperature (``nn.Parameter(torch.tensor(1.5))``)
    plus a learned 0-d offset: the scalars broadcast over ``[N, C]``."""

    def __init__(self, features: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.fc = nn.Linear(features, classes)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.offset = nn.Parameter(torch.tensor(-0.25))

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x) * self.scale + self.offset


class GatedMix(nn.Module):
    """Two branches mixed by the elements of one parameter vector (``gammas[i]``), as a
    learned per-branch gain: each element a 0-d view of the vector."""

    def __init__(self, features: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.fc = nn.Linear(features, features)
        self.gammas = nn.Parameter(torch.tensor([0.5, 2.0, -1.0]))
        self.head = nn.Linear(features, classes)

    def forward(self, x: Tensor) -> Tensor:
        y = torch.tanh(self.fc(x)) * self.gammas[0] + x * self.gammas[2]
        return self.head(y)
