"""Real networks no one here wrote, imported and verified as users hand them over.

    python -m benchmarks.network_zoo [--only NAME ...] [--list] [--timeout 300] [--write]

Two lists. ``NEW``: 45 ``transformers`` networks people fine-tune today, each the task head
users train (``*ForCausalLM``, ``*ForSequenceClassification``, ``*ForImageClassification``,
``*ForConditionalGeneration`` ...), built from its config class with random initialisation
(no download) where only sizes are changed (width, layers, heads, vocabulary, image size,
and the special token ids a small vocabulary no longer holds): dropout, attention
implementation, ``use_cache``, activations, norms, position schemes, stochastic depth are
the library's defaults. Each override is in ``NEW`` and in the results table. ``EARLIER``:
the networks of ``tests/import_zoo.py`` (its ``ZOO`` and its other factories and classes,
less ``Unsupported``, which is there to be refused), at the sizes its tests use.

Each network is verified by ``unroller.analysis.verify.verify_module`` (float64, loss and
every gradient, buffers and predictions within 1e-10 relative; dropout seeded alike on both
sides, verify's default) twice, each in its own process with a timeout: with the importer's
exact fallback (an ATen op no registry operator computes becomes one opaque ``aten``
statement; the default) and without it (``fallback=False``: the registry alone). Text
models take a Hugging Face keyword batch (``input_ids`` and ``labels``: the model's own
loss), images ``pixel_values`` and a class target (the per-pixel one for segmentation).

``--write`` writes ``benchmarks/results/network_zoo.md`` and ``network_zoo.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
RESULTS = ROOT / "benchmarks" / "results"
PROG = "python -m benchmarks.network_zoo"
TIMEOUT = 300
BATCH = 2
LENGTH = 16  # tokens per sample (the decoder's 8 for encoder-decoders)
VOCAB = 128
IMAGE = 32

# ------------------------------------------------------------------------------ the lists


@dataclass(frozen=True)
class Network:
    """One network: how to build it and the batch it is verified on.

    ``model`` is a ``transformers`` class (``NEW``) or a ``tests/import_zoo.py`` factory
    (``EARLIER``); ``sizes`` are every argument given to its config (or factory); ``batch``
    names the batch: ``causal``, ``classes``, ``tokens`` (per-position labels),
    ``seq2seq``, ``image`` or ``audio`` (``NEW``), else ``EARLIER``'s input spec."""

    name: str
    family: str
    model: str
    config: str
    sizes: dict[str, Any] = field(default_factory=dict)
    batch: str = "causal"
    loss: str | None = None
    note: str = ""


def _causal(name, model, config, **sizes) -> Network:
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    base.update(num_attention_heads=4)
    base.update(sizes)
    return Network(name, "causal LM", model, config, base, "causal")


def _encoder(name, model, config, batch, embedding_size=None) -> Network:
    """A BERT-sized encoder (``embedding_size``: ALBERT's and ELECTRA's factorised table)."""
    sizes = dict(vocab_size=VOCAB)
    if embedding_size is not None:
        sizes.update(embedding_size=embedding_size)
    sizes.update(hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
    sizes.update(intermediate_size=64)
    return Network(name, "encoder", model, config, sizes, batch)


#: the sizes of a BART-style encoder-decoder (BART, Pegasus, Marian, Whisper)
_BART_SIZES = dict(
    vocab_size=VOCAB,
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
)

#: 45 networks at their library defaults but size; the task head users fine-tune.
NEW: list[Network] = [
    # causal language models (22)
    _causal("llama", "LlamaForCausalLM", "LlamaConfig"),
    _causal("mistral", "MistralForCausalLM", "MistralConfig", num_key_value_heads=1),
    _causal("qwen2", "Qwen2ForCausalLM", "Qwen2Config", num_key_value_heads=4),
    _causal("qwen3", "Qwen3ForCausalLM", "Qwen3Config", num_key_value_heads=4, head_dim=8),
    _causal("gemma", "GemmaForCausalLM", "GemmaConfig", num_key_value_heads=4, head_dim=8),
    _causal("gemma2", "Gemma2ForCausalLM", "Gemma2Config", num_key_value_heads=2, head_dim=8),
    _causal("gemma3", "Gemma3ForCausalLM", "Gemma3TextConfig", num_key_value_heads=2, head_dim=8),
    _causal("phi", "PhiForCausalLM", "PhiConfig", num_key_value_heads=4),
    _causal("phi3", "Phi3ForCausalLM", "Phi3Config", num_key_value_heads=4),
    Network(
        "gpt2",
        "causal LM",
        "GPT2LMHeadModel",
        "GPT2Config",
        dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4),
    ),
    _causal("gpt_neox", "GPTNeoXForCausalLM", "GPTNeoXConfig"),
    Network(
        "gptj",
        "causal LM",
        "GPTJForCausalLM",
        "GPTJConfig",
        dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, rotary_dim=4),
    ),
    Network(
        "opt",
        "causal LM",
        "OPTForCausalLM",
        "OPTConfig",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            ffn_dim=64,
            word_embed_proj_dim=32,
            num_hidden_layers=2,
            num_attention_heads=4,
        ),
    ),
    Network("bloom", "causal LM", "BloomForCausalLM", "BloomConfig", dict(vocab_size=VOCAB)),
    Network(
        "falcon",
        "causal LM",
        "FalconForCausalLM",
        "FalconConfig",
        dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4),
    ),
    _causal("stablelm", "StableLmForCausalLM", "StableLmConfig", num_key_value_heads=4),
    _causal("olmo", "OlmoForCausalLM", "OlmoConfig", num_key_value_heads=4),
    _causal("olmo2", "Olmo2ForCausalLM", "Olmo2Config", num_key_value_heads=4),
    _causal("mixtral", "MixtralForCausalLM", "MixtralConfig", num_key_value_heads=1),
    _causal(
        "qwen2_moe",
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        num_key_value_heads=4,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=64,
    ),
    _causal("granite", "GraniteForCausalLM", "GraniteConfig", num_key_value_heads=4),
    _causal("starcoder2", "Starcoder2ForCausalLM", "Starcoder2Config", num_key_value_heads=1),
    # encoders (9)
    _encoder("bert", "BertForSequenceClassification", "BertConfig", "classes"),
    _encoder("roberta", "RobertaForSequenceClassification", "RobertaConfig", "classes"),
    Network(
        "distilbert",
        "encoder",
        "DistilBertForTokenClassification",
        "DistilBertConfig",
        dict(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=64),
        "tokens",
    ),
    _encoder(
        "albert", "AlbertForSequenceClassification", "AlbertConfig", "classes", embedding_size=16
    ),
    _encoder(
        "electra", "ElectraForSequenceClassification", "ElectraConfig", "classes", embedding_size=16
    ),
    _encoder("deberta_v2", "DebertaV2ForSequenceClassification", "DebertaV2Config", "classes"),
    _encoder("xlm_roberta", "XLMRobertaForTokenClassification", "XLMRobertaConfig", "tokens"),
    _encoder("mpnet", "MPNetForMaskedLM", "MPNetConfig", "tokens"),
    _encoder("modernbert", "ModernBertForSequenceClassification", "ModernBertConfig", "classes"),
    # encoder-decoders (5)
    Network(
        "t5",
        "seq2seq",
        "T5ForConditionalGeneration",
        "T5Config",
        dict(
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            decoder_start_token_id=0,
        ),
        "seq2seq",
        note="T5Config() has no decoder_start_token_id, so labels cannot be shifted; "
        "0 (the pad id) as every pretrained T5 config has it",
    ),
    Network(
        "mt5",
        "seq2seq",
        "MT5ForConditionalGeneration",
        "MT5Config",
        dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4),
        "seq2seq",
    ),
    *(
        Network(
            name,
            "seq2seq",
            model,
            config,
            dict(_BART_SIZES, **extra),
            "seq2seq",
        )
        for name, model, config, extra in (
            ("bart", "BartForConditionalGeneration", "BartConfig", {}),
            ("pegasus", "PegasusForConditionalGeneration", "PegasusConfig", {}),
            ("marian", "MarianMTModel", "MarianConfig", {"decoder_vocab_size": VOCAB}),
        )
    ),
    # vision (8)
    *(
        Network(
            name,
            "vision",
            model,
            config,
            dict(
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                **({} if name == "dinov2" else {"intermediate_size": 64}),
                image_size=IMAGE,
            ),
            "image",
        )
        for name, model, config in (
            ("vit", "ViTForImageClassification", "ViTConfig"),
            ("deit", "DeiTForImageClassification", "DeiTConfig"),
            ("dinov2", "Dinov2ForImageClassification", "Dinov2Config"),
        )
    ),
    Network(
        "convnext",
        "vision",
        "ConvNextForImageClassification",
        "ConvNextConfig",
        dict(hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 2, 1], image_size=IMAGE),
        "image",
    ),
    Network(
        "resnet",
        "vision",
        "ResNetForImageClassification",
        "ResNetConfig",
        dict(embedding_size=16, hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1]),
        "image",
    ),
    Network(
        "swin",
        "vision",
        "SwinForImageClassification",
        "SwinConfig",
        dict(image_size=224, embed_dim=16, depths=[1, 1, 2, 1], num_heads=[2, 2, 4, 4]),
        "image",
        note="224x224 images: each of its 4 stages must hold a 7x7 window",
    ),
    Network(
        "segformer",
        "vision",
        "SegformerForSemanticSegmentation",
        "SegformerConfig",
        dict(
            depths=[1, 1, 1, 1],
            hidden_sizes=[16, 32, 48, 64],
            num_attention_heads=[1, 2, 2, 4],
            decoder_hidden_size=32,
        ),
        "image",
    ),
    Network(
        "clip_vision",
        "vision",
        "CLIPForImageClassification",
        "CLIPConfig",
        dict(
            text_config=dict(
                vocab_size=VOCAB,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                bos_token_id=VOCAB - 1,
                eos_token_id=VOCAB - 1,
            ),
            vision_config=dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                image_size=2 * IMAGE,
            ),
            projection_dim=32,
        ),
        "image",
        note="64x64 images: 2x2 patches of its default 32",
    ),
    # audio (1)
    Network(
        "whisper",
        "audio",
        "WhisperForConditionalGeneration",
        "WhisperConfig",
        dict(_BART_SIZES, max_source_positions=16),
        "audio",
        note="input_features [2, 80, 32] and decoder_input_ids [2, 8] with a per-position "
        "target: a labels batch is refused by unroller.importer.hf_batch, Whisper having no "
        "prepare_decoder_input_ids_from_labels",
    ),
]


def _zoo(name, factory, spec, sizes=None, loss=None, note="") -> Network:
    return Network(name, "tests/import_zoo.py", factory, "", sizes or {}, spec, loss, note)


_IMAGES = "x: f32[N, 3, 32, 32]"
_TOKENS = "ids: i64[N, 16]"
_T5_INPUTS = "input_ids: i64[N, 12]; decoder_input_ids: i64[N, 8]"

#: The networks of tests/import_zoo.py (its ZOO less ``Unsupported``, the factories the
#: import tests call, the Llama family's other members and the learned-scalar classes),
#: at the sizes the tests use.
EARLIER: list[Network] = [
    _zoo("resnet18", "resnet18", _IMAGES),
    _zoo("vgg11_bn", "vgg11_bn", _IMAGES, {"hidden": 64, "dropout": 0.0}),
    _zoo("mobilenet_v2", "mobilenet_v2", _IMAGES, {"dropout": 0.0}),
    _zoo("unet", "unet", _IMAGES),
    _zoo("vit", "vit", _IMAGES),
    _zoo("gpt", "gpt", _TOKENS),
    _zoo("hf_gpt2", "hf_gpt2", _TOKENS),
    _zoo("hf_bert", "hf_bert", _TOKENS),
    _zoo("hf_llama", "hf_llama", _TOKENS),
    _zoo("hf_distilbert", "hf_distilbert", _TOKENS),
    _zoo("hf_roberta", "hf_roberta", _TOKENS),
    _zoo("hf_gpt_neox", "hf_gpt_neox", _TOKENS),
    _zoo("hf_phi", "hf_phi", _TOKENS),
    _zoo("hf_gemma", "hf_gemma", _TOKENS),
    _zoo("hf_opt", "hf_opt", _TOKENS),
    _zoo("efficientnet_b0", "efficientnet_b0", _IMAGES, {"width_mult": 0.1, "depth_mult": 0.5}),
    _zoo(
        "convnext_tiny",
        "convnext_tiny",
        _IMAGES,
        {"widths": [8, 16], "depths": [2, 1], "layer_scale": 0.5},
    ),
    _zoo(
        "densenet",
        "densenet",
        _IMAGES,
        {"growth_rate": 4, "block_config": [2, 2], "num_init_features": 8, "bn_size": 2},
    ),
    _zoo("autoencoder", "autoencoder", "x: f32[N, 32]", loss="mse_loss"),
    _zoo("tcn", "tcn", "x: f32[N, 4, 32]"),
    _zoo("rms_decoder", "rms_decoder", _TOKENS),
    _zoo("lstm_classifier", "lstm_classifier", "ids: i64[N, 12]"),
    _zoo("bigru_classifier", "bigru_classifier", "x: f32[N, 10, 6]"),
    _zoo("hf_t5", "hf_t5", _T5_INPUTS),
    _zoo("hf_bart", "hf_bart", _T5_INPUTS),
    _zoo("hf_mistral", "hf_llama", _TOKENS, {"family": "mistral"}),
    _zoo("hf_qwen2", "hf_llama", _TOKENS, {"family": "qwen2"}),
    _zoo("scaled_head", "ScaledHead", "x: f32[N, 8]"),
    _zoo("gated_mix", "GatedMix", "x: f32[N, 8]"),
]

LISTS = {"new": NEW, "earlier": EARLIER}


def find(name: str) -> tuple[str, Network]:
    """The list and entry of ``name`` (``earlier:vit`` picks from one list)."""
    where, _, short = name.rpartition(":")
    for list_name, networks in LISTS.items():
        if where and where != list_name:
            continue
        for net in networks:
            if net.name == short:
                return list_name, net
    raise KeyError(f"no network {name!r} (see --list)")


# ------------------------------------------------------------------------------ building


def token_fixes(config_class: Any, sizes: dict[str, Any]) -> dict[str, Any]:
    """The special token ids of ``config_class``'s defaults that a vocabulary of
    ``sizes['vocab_size']`` no longer holds, moved to its last id (an embedding's
    ``padding_idx`` must lie inside it)."""
    vocab = sizes.get("vocab_size")
    if vocab is None:
        return {}
    defaults = config_class().to_dict()
    fixes = {}
    for key, value in defaults.items():
        if key.endswith("token_id") and isinstance(value, int) and value >= vocab:
            fixes[key] = vocab - 1
    return fixes


def overrides(net: Network) -> dict[str, Any]:
    """Everything given to ``net``'s config (or factory): its sizes and token id fixes."""
    if not net.config:
        return dict(net.sizes)
    import transformers

    config_class = getattr(transformers, net.config)
    return {**net.sizes, **token_fixes(config_class, net.sizes)}


def build(net: Network) -> Any:
    """``net`` built, randomly initialised (seeded)."""
    import torch

    torch.manual_seed(0)
    if not net.config:
        if str(TESTS) not in sys.path:
            sys.path.insert(0, str(TESTS))
        import import_zoo

        return getattr(import_zoo, net.model)(**net.sizes)
    import transformers

    config = getattr(transformers, net.config)(**overrides(net))
    return getattr(transformers, net.model)(config)


def _spec_shapes(spec: str) -> list[tuple[str, str, tuple[int, ...]]]:
    found = []
    for part in spec.split(";"):
        name, _, rest = part.partition(":")
        dtype, _, dims = rest.strip().partition("[")
        shape = tuple(int(d) for d in dims.rstrip("]").split(",")[1:])
        found.append((name.strip(), dtype, shape))
    return found


def batch(net: Network, module: Any) -> tuple[Any, Any]:
    """``(inputs, target)`` for ``verify_module``: a keyword batch with ``labels`` (target
    None), or example inputs and a target (None: verify's default for the scores' shape)."""
    import torch

    gen = torch.Generator().manual_seed(1)

    def ids(length: int = LENGTH, high: int = VOCAB) -> torch.Tensor:
        return torch.randint(0, high, (BATCH, length), generator=gen)

    kind = net.batch
    if kind == "causal":
        return {"input_ids": ids(), "labels": ids()}, None
    if kind == "classes":
        labels = torch.randint(0, module.config.num_labels, (BATCH,), generator=gen)
        return {"input_ids": ids(), "labels": labels}, None
    if kind == "tokens":
        high = getattr(module.config, "num_labels", 2)
        high = VOCAB if type(module).__name__.endswith("ForMaskedLM") else high
        return {"input_ids": ids(), "labels": ids(high=high)}, None
    if kind == "seq2seq":
        return {"input_ids": ids(), "labels": ids(LENGTH // 2)}, None
    if kind == "image":
        config = getattr(module.config, "vision_config", module.config)
        size = getattr(config, "image_size", IMAGE)
        return (torch.randn(BATCH, 3, size, size, generator=gen),), None
    if kind == "audio":
        config = module.config
        frames = 2 * config.max_source_positions
        features = torch.randn(BATCH, config.num_mel_bins, frames, generator=gen)
        inputs = {"input_features": features, "decoder_input_ids": ids(LENGTH // 2)}
        return inputs, ids(LENGTH // 2)
    # an EARLIER spec: "name: dtype[N, ...]; ..."
    made = {}
    for name, dtype, shape in _spec_shapes(kind):
        if dtype.startswith("i"):
            high = 32 if net.name == "lstm_classifier" else 64
            made[name] = torch.randint(0, high, (BATCH, *shape), generator=gen)
        else:
            made[name] = torch.randn(BATCH, *shape, generator=gen)
    if len(made) == 1:
        return (next(iter(made.values())),), None
    return made, None


# ------------------------------------------------------------------------------ measuring

OPAQUE = re.compile(r"=\s*aten\(")


def _one_line(text: str, limit: int = 400) -> str:
    line = " ".join(str(text).strip().splitlines()[0].split()) if str(text).strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def scrub(text: str) -> str:
    """``text`` with this machine's paths made relative (the repository, site-packages)."""
    text = text.replace(str(ROOT) + os.sep, "")
    text = re.sub(r"(?<![\w.])/(?:[\w.+-]+/)*(site-packages/)", r"\1", text)
    return re.sub(r"(?<![\w.~/\\-])/(?:[\w.+-]+/)+([\w.+-]*)", r"\1", text)


def measure(net: Network, fallback: bool) -> dict[str, Any]:
    """One import + verify of ``net`` in this process: status ``verified`` / ``differs`` /
    ``refused`` / ``crash``, the reason's first line, the largest relative error, the
    opaque statements of the text, seconds."""
    from unittest import mock

    import torch

    from unroller.analysis.verify import NOISE_NOTE, verify_module
    from unroller.importer import api
    from unroller.importer.model import ImportFailure

    found: dict[str, Any] = {"fallback": fallback}
    try:
        module = build(net)
        inputs, target = batch(net, module)
    except Exception as exc:  # noqa: BLE001 - the network does not build: say so
        found.update(status="crash", reason=f"build: {type(exc).__name__}: {_one_line(exc)}")
        return found
    texts: list[str] = []
    real = api.import_network

    failures: list[ImportFailure] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        kwargs["fallback"] = fallback
        try:
            imported = real(*args, **kwargs)
        except ImportFailure as exc:  # kept: verify_module re-raises it as one line
            failures.append(exc)
            raise
        texts.append(imported.text)
        return imported

    start = time.perf_counter()
    try:
        with mock.patch.object(api, "import_network", recording):
            report = verify_module(module, inputs, target, loss=net.loss)
    except ImportFailure as exc:
        first = failures[-1] if failures else exc
        found.update(status="refused", reason=_one_line(first.message))
        if first.unmapped:
            found["unmapped"] = [scrub(item.line()) for item in first.unmapped[:40]]
            found["unmapped_count"] = len(first.unmapped)
    except Exception as exc:  # noqa: BLE001 - a crash is a result here
        found.update(status="crash", reason=f"{type(exc).__name__}: {_one_line(exc)}")
        frames = traceback.extract_tb(exc.__traceback__)[-4:]
        found["where"] = [scrub(f"{f.filename}:{f.lineno} {f.name}") for f in frames]
    else:
        measured = [row for row in report.rows if not row.note.startswith(NOISE_NOTE)]
        errors = [row.rel for row in measured or report.rows]
        found["max_rel"] = max(errors) if errors else None
        found["values"] = len(report.rows)
        if report.ok:
            found["status"] = "verified"
        else:
            found["status"] = "differs"
            found["reason"] = _one_line("; ".join(report.problems) or report.summary())
            found["failed"] = [row.name for row in report.failed][:20]
    found["seconds"] = round(time.perf_counter() - start, 2)
    if texts:
        text = texts[-1]
        found["opaque"] = len(OPAQUE.findall(text))
        found["opaque_ops"] = sorted(set(re.findall(r'op="(aten\.[\w.]+)"', text)))
        found["statements"] = sum(1 for line in text.splitlines() if " = " in line)
    found["torch_threads"] = torch.get_num_threads()
    for key in ("reason",):
        if key in found:
            found[key] = scrub(found[key])
    return found


def run_isolated(name: str, fallback: bool, timeout: int) -> dict[str, Any]:
    """``measure`` in a new process (its own process group, killed whole at ``timeout``)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, "-m", "benchmarks.network_zoo", "--worker", name]
        command += ["--result", str(out)] + ([] if fallback else ["--no-fallback"])
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        start = time.perf_counter()
        proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            _, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return {
                "fallback": fallback,
                "status": "timeout",
                "reason": f"no result within {timeout} s",
                "seconds": round(time.perf_counter() - start, 1),
            }
        if out.is_file():
            return json.loads(out.read_text(encoding="utf-8"))
        last = [line for line in stderr.splitlines() if line.strip()][-1:] or ["no output"]
        return {
            "fallback": fallback,
            "status": "crash",
            "reason": scrub(f"process exit {proc.returncode}: {_one_line(last[0])}"),
            "seconds": round(time.perf_counter() - start, 1),
        }


def worker(name: str, fallback: bool, result: Path) -> int:
    """The ``--worker`` process: one ``measure``, its JSON written to ``result``."""
    import warnings

    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    _, net = find(name)
    found = measure(net, fallback)
    result.write_text(json.dumps(found), encoding="utf-8")
    return 0


# ------------------------------------------------------------------------------ reporting

STATUS = {
    "verified": "verified exact",
    "differs": "differs",
    "refused": "refused",
    "crash": "crash",
    "timeout": "timeout",
}


def _cell(run: dict[str, Any] | None) -> str:
    if run is None:
        return "not run"
    text = STATUS.get(run["status"], run["status"])
    if run["status"] != "verified" and run.get("reason"):
        reason = run["reason"]
        if run.get("unmapped"):
            first = re.sub(r"\s*\[[^\]]*\]$", "", run["unmapped"][0])
            reason = f"{reason}: {first}" + (
                f" (+{run['unmapped_count'] - 1} more)" if run["unmapped_count"] > 1 else ""
            )
        text += ": " + reason.replace("|", "\\|")
    return text


def _number(value: Any, spec: str) -> str:
    return "" if value is None else format(value, spec)


def _overrides_text(net: Network) -> str:
    given = overrides(net)
    parts = [f"{key}={json.dumps(value, separators=(',', ':'))}" for key, value in given.items()]
    return ", ".join(parts).replace("|", "\\|") or "none"


def counts(rows: list[dict[str, Any]]) -> dict[str, int]:
    return {
        "networks": len(rows),
        "fallback_verified": sum(r["fallback"]["status"] == "verified" for r in rows),
        "registry_verified": sum(r["registry"]["status"] == "verified" for r in rows),
    }


def table(list_name: str, rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| network | class | overrides (all else default) | with the fallback | opaque "
        "`aten` | max rel. error | s | registry only (`fallback=False`) | s |",
        "|---|---|---|---|---:|---:|---:|---|---:|",
    ]
    for row in rows:
        _, net = find(f"{list_name}:{row['name']}")
        with_fb, alone = row["fallback"], row["registry"]
        model = net.model if net.config else f"`{net.model}`"
        note = f" ({net.note})" if net.note else ""
        lines.append(
            f"| {net.name} | {model}{note} | {_overrides_text(net)} | {_cell(with_fb)} | "
            f"{_number(with_fb.get('opaque'), 'd')} | {_number(with_fb.get('max_rel'), '.1e')} "
            f"| {_number(with_fb.get('seconds'), '.1f')} | {_cell(alone)} | "
            f"{_number(alone.get('seconds'), '.1f')} |"
        )
    return lines


def _source_text(git: dict[str, Any]) -> str:
    start, end = git["start"], git["end"]
    text = f"Measured at commit {start['commit'] or 'unknown'}"
    if end["commit"] != start["commit"]:
        text += f" (HEAD was {end['commit']} when the run ended)"
    changed = sorted(set(start["uncommitted"]) | set(end["uncommitted"]))
    if changed:
        text += ", with uncommitted changes to " + ", ".join(f"`{path}`" for path in changed)
    return text + "."


def report_text(data: dict[str, Any]) -> str:
    new, earlier = data["lists"]["new"], data["lists"]["earlier"]
    cn, ce = counts(new), counts(earlier)
    machine = data["machine"]
    lines = [
        "# Real networks imported and verified: the network zoo",
        "",
        f"Command: `{data['command']}`",
        "",
        f"Date: {machine['date']}. Machine: {machine.get('cpu_model') or machine['processor']}, "
        f"{machine['cpu_count']} CPUs, Python {machine['python']}, torch {machine['torch']}, "
        f"transformers {data['transformers']}; one network at a time, each run in its own "
        f"process with 1 torch thread and a {data['timeout']} s limit.",
        "",
        _source_text(data["git"]),
        "",
        "Verified exact: `unroller.analysis.verify.verify_module` in float64, loss, every "
        "gradient, buffers and eval predictions within 1e-10 relative of the original under "
        "autograd (dropout at the library's defaults, seeded alike on both sides). "
        "With the fallback: the importer's default, an ATen op no registry operator computes "
        "is one opaque `aten` statement; registry only: `fallback=False`.",
        "",
        "| list | networks | verified with the fallback | verified, registry only |",
        "|---|---:|---:|---:|",
        f"| new (`transformers`, library defaults but size) | {cn['networks']} | "
        f"{cn['fallback_verified']}/{cn['networks']} | "
        f"{cn['registry_verified']}/{cn['networks']} |",
        f"| earlier (`tests/import_zoo.py`) | {ce['networks']} | "
        f"{ce['fallback_verified']}/{ce['networks']} | "
        f"{ce['registry_verified']}/{ce['networks']} |",
        "",
        "## New: 45 `transformers` networks",
        "",
        "Built from their config class with random initialisation; the overrides are every "
        "argument given (sizes, and special token ids moved inside the small vocabulary). "
        f"Text: a keyword batch `input_ids` [{BATCH}, {LENGTH}] with `labels` (the model's "
        f"own loss; encoder-decoders' labels [{BATCH}, {LENGTH // 2}]); images "
        f"`pixel_values` [{BATCH}, 3, {IMAGE}, {IMAGE}] with the default target.",
        "",
        *table("new", new),
        "",
        "## Earlier: the networks of `tests/import_zoo.py`",
        "",
        f"Its `ZOO` less `Unsupported` (20), the factories the import tests call "
        f"(`rms_decoder`, `lstm_classifier`, `bigru_classifier`, `hf_t5`, `hf_bart`), "
        f"`hf_llama`'s Mistral and Qwen2 families and the learned-scalar classes "
        f"`ScaledHead` and `GatedMix`: {ce['networks']} networks, at the sizes the tests "
        "use.",
        "",
        *table("earlier", earlier),
        "",
    ]
    return "\n".join(lines)


def git_state() -> dict[str, Any]:
    """The commit measured and the package files changed since it (uncommitted)."""

    def git(*args: str) -> str:
        try:
            done = subprocess.run(
                ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30
            )
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return done.stdout.strip() if done.returncode == 0 else ""

    changed = [line[3:] for line in git("status", "--porcelain", "--", "unroller").splitlines()]
    return {"commit": git("rev-parse", "--short", "HEAD"), "uncommitted": changed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these networks only")
    parser.add_argument("--list", action="store_true", help="print the networks and exit")
    parser.add_argument("--timeout", type=int, default=TIMEOUT, help="seconds per run")
    parser.add_argument("--write", action="store_true", help="write the results files")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--no-fallback", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker, not args.no_fallback, args.result)
    if args.list:
        for list_name, networks in LISTS.items():
            for net in networks:
                print(f"{list_name}:{net.name}  {net.model}  {_overrides_text(net)}")
        return 0
    if args.write and args.only:
        parser.error("--write measures every network: leave --only out")
    chosen = (
        [find(name) for name in args.only]
        if args.only
        else [(list_name, net) for list_name, networks in LISTS.items() for net in networks]
    )
    from unroller.bench.machine import describe

    machine = describe(PROG, sys.argv[1:] if argv is None else argv)
    source = git_state()
    done: dict[str, list[dict[str, Any]]] = {name: [] for name in LISTS}
    for list_name, net in chosen:
        row: dict[str, Any] = {"name": net.name, "model": net.model}
        row["overrides"] = overrides(net)
        row["fallback"] = run_isolated(f"{list_name}:{net.name}", True, args.timeout)
        row["registry"] = run_isolated(f"{list_name}:{net.name}", False, args.timeout)
        done[list_name].append(row)
        print(
            f"{list_name:8s} {net.name:18s} fallback: {_cell(row['fallback'])[:150]}"
            f" [{row['fallback'].get('seconds')} s, opaque {row['fallback'].get('opaque')}]"
            f" | registry: {_cell(row['registry'])[:150]}",
            flush=True,
        )
    import transformers

    data = {
        "command": machine["command"],
        "machine": machine,
        "transformers": transformers.__version__,
        "git": {"start": source, "end": git_state()},
        "timeout": args.timeout,
        "lists": done,
        "counts": {name: counts(rows) for name, rows in done.items()},
    }
    for name, rows in done.items():
        if rows:
            c = counts(rows)
            print(
                f"{name}: verified with the fallback {c['fallback_verified']}/{c['networks']}, "
                f"registry only {c['registry_verified']}/{c['networks']}"
            )
    if args.write:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "network_zoo.json").write_text(
            json.dumps(data, indent=2) + "\n", encoding="utf-8"
        )
        (RESULTS / "network_zoo.md").write_text(report_text(data), encoding="utf-8")
        print("wrote benchmarks/results/network_zoo.md, benchmarks/results/network_zoo.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
