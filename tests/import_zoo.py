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

import math
from collections import OrderedDict
from collections.abc import Callable
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
    """torchvision.ops' conv + norm + activation, a ``Sequential`` so keys read ``0.weight``."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int = 3,
        stride: int = 1,
        groups: int = 1,
        activation_layer: Callable[..., nn.Module] = nn.ReLU,
    ) -> None:
        padding = (kernel_size - 1) // 2
        layers = [
            nn.Conv2d(
                in_channels,
                out_channels,
                kernel_size,
                stride,
                padding,
                groups=groups,
                bias=False,
            ),
            nn.BatchNorm2d(out_channels),
            activation_layer(inplace=True),
        ]
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
    """Unmappable ops at several module paths: ``rnn`` (an LSTM), ``mix`` (rfft, where), and
    ``x.unfold`` in the top-level forward. Input ``[N, 8, width]``; returns ``[N, classes]``."""

    def __init__(self, width: int = 8, hidden: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.rnn = nn.LSTM(width, hidden, batch_first=True)
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
) -> nn.Module:
    """``transformers.GPT2LMHeadModel`` from a 2-layer config; ``forward(input_ids).logits``.

    ``use_cache`` is off so the output holds no key/value cache. GPT-2 ties ``lm_head.weight``
    to ``transformer.wte.weight`` (one parameter under two state-dict keys); pass
    ``tie_word_embeddings=False`` for an untied head.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab,
        n_positions=positions,
        n_embd=width,
        n_layer=layers,
        n_head=heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        bos_token_id=vocab - 1,
        eos_token_id=vocab - 1,
        tie_word_embeddings=tie_word_embeddings,
        attn_implementation=attn_implementation,
    )
    return GPT2LMHeadModel(config)


def hf_bert(
    vocab: int = 64,
    positions: int = 16,
    width: int = 32,
    heads: int = 2,
    layers: int = 2,
    num_labels: int = 3,
    attn_implementation: str = "eager",
    classify: bool = True,
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
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout=0.0,
        num_labels=num_labels,
        use_cache=False,
        attn_implementation=attn_implementation,
    )
    if classify:
        return BertForSequenceClassification(config)
    return BertModel(config)


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
