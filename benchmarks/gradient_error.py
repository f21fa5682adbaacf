"""Per-parameter gradient error of every lossy scheme on the test models.

For each test model and scheme, one float64 training step of the generated module at
batch 4 (seeded inputs, PyTorch's default initialisation of the model's reference, the
same step ``tests/compressors/test_scheme_gradient_error.py`` runs) against the ``nocompress`` step:
the relative L2 error ``|g - g_exact| / |g_exact|`` of every parameter's gradient. A
parameter at 1 or more gets a gradient no better than none at all; for each of those the
script also finds the cause: the saved tensor whose compression alone (the scheme's codec
on that one tensor, everything else raw) gives the largest error on that parameter.

    python -m benchmarks.gradient_error

writes ``benchmarks/results/gradient_error/per_parameter.md`` (the table
docs/compression.md includes) and ``per_parameter.json`` (every parameter's error).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch

from unroller.api import compression_config, load_graph
from unroller.bench.reference import SUITE_REFERENCES, make_inputs, suite_model_path
from unroller.compiler.options import Options
from unroller.compiler.schemes import CompressionConfig, Rule
from unroller.compiler.stash import plan_stash
from unroller.materialize import materialize

OUT = Path(__file__).resolve().parent / "results" / "gradient_error"
STEMS = ("resnet_like", "unet_like", "autoencoder", "fanout")
SCHEMES = ("dct-first", "dct-dense", "quant", "auto")
BATCH = 4
COMMAND = "python -m benchmarks.gradient_error"


def module_class(stem: str, config: CompressionConfig, folder: Path, tag: str) -> type:
    """The generated ``Model`` of test model ``stem`` under ``config``."""
    return materialize(
        load_graph(suite_model_path(stem)),
        f"tests/models/{stem}.txt",
        Options(scheme="nocompress"),
        config,
        folder=folder,
        file_name=f"{stem}_{tag}.py",
        module_name=f"gradient_error_{stem}_{tag}",
        keep_module=False,
    ).Model


def scheme_config(stem: str, scheme: str) -> CompressionConfig:
    """The resolved config of a built-in scheme (``auto`` planned for the model)."""
    return compression_config(Options(scheme=scheme), load_graph(suite_model_path(stem)))


def gradients(stem: str, model_class: type, batch: int = BATCH) -> dict[str, torch.Tensor]:
    """Parameter gradients of one float64 step from the reference's initial weights."""
    torch.manual_seed(0)
    ref = SUITE_REFERENCES[stem]().double()
    model = model_class().double()
    model.load_state_dict(ref.state_dict())
    torch.manual_seed(1)
    model(*make_inputs(stem, batch, seed=0))
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / max(float(b.norm()), 1e-300))


def errors_against(exact: dict, approx: dict) -> dict[str, float]:
    return {name: rel_err(approx[name], g) for name, g in exact.items()}


def compressed_tensors(stem: str, config: CompressionConfig) -> dict[str, Rule]:
    """Saved tensor -> a rule compressing it alone with the codec ``config`` gives it."""
    found = {}
    for s in plan_stash(load_graph(suite_model_path(stem)), config).entries:
        for form in s.forms:
            if form.kind == "codec" and s.key not in found:
                found[s.key] = Rule(form.codec, tensor=s.key)
    return found


def causes(
    stem: str,
    config: CompressionConfig,
    over: list[str],
    exact: dict,
    build: Callable[[CompressionConfig, str], type],
) -> dict[str, tuple[str, str, float]]:
    """Per parameter in ``over``: (tensor, codec, error) of the saved tensor whose
    compression alone gives it the largest error."""
    best: dict[str, tuple[str, str, float]] = {}
    for i, (key, rule) in enumerate(compressed_tensors(stem, config).items()):
        alone = CompressionConfig(rules=[rule], masks=config.masks, derivatives=False)
        errs = errors_against(exact, gradients(stem, build(alone, f"alone{i}")))
        for name in over:
            if name not in best or errs[name] > best[name][2]:
                best[name] = (key, rule.codec.label(), errs[name])
    return best


def measure(stems=STEMS, schemes=SCHEMES, folder: Path | None = None) -> list[dict]:
    """One row per (model, scheme): every parameter's error, and the causes of those >= 1."""
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory(prefix="gradient-error-") as tmp:
        folder = Path(folder or tmp)
        for stem in stems:
            exact = gradients(stem, module_class(stem, CompressionConfig(), folder, "exact"))
            for scheme in schemes:
                tag = scheme.replace("-", "_")
                config = scheme_config(stem, scheme)
                errs = errors_against(
                    exact, gradients(stem, module_class(stem, config, folder, tag))
                )
                over = sorted(n for n, e in errs.items() if e >= 1.0)

                def build(cfg, name, stem=stem, tag=tag):
                    return module_class(stem, cfg, folder, f"{tag}_{name}")

                found = causes(stem, config, over, exact, build) if over else {}
                rows.append({"model": stem, "scheme": scheme, "errors": errs, "causes": found})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "# Per-parameter gradient error of the lossy schemes on the test models",
        "",
        f"Made by `{COMMAND}`: one float64 step at batch {BATCH} (seeded inputs, default "
        "initialisation), relative L2 error of each parameter's gradient against "
        "`nocompress`. 1.0 is what a zero gradient scores.",
        "",
        "| model | scheme | parameters | worst parameter | its error | median | at or over 1 |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        errs = r["errors"]
        worst = max(errs, key=errs.get)
        median = sorted(errs.values())[len(errs) // 2]
        over = sum(e >= 1.0 for e in errs.values())
        lines.append(
            f"| {r['model']} | {r['scheme']} | {len(errs)} | `{worst}` | {errs[worst]:.3g} "
            f"| {median:.3g} | {over} |"
        )
    lines += ["", "## Parameters at or over 1, and the saved tensor that does it", ""]
    lines += [
        "The cause: of the tensors the scheme compresses, the one whose compression alone "
        "(every other tensor raw) gives that parameter the largest error.",
        "",
        "| model | scheme | parameter | error | cause: tensor | codec | its error alone |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        for name, (tensor, codec, alone) in sorted(r["causes"].items()):
            lines.append(
                f"| {r['model']} | {r['scheme']} | `{name}` | {r['errors'][name]:.3g} "
                f"| `{tensor}` | {codec} | {alone:.3g} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = measure()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "per_parameter.md").write_text(markdown(rows), encoding="utf-8")
    payload = {"command": COMMAND, "batch": BATCH, "rows": rows}
    (args.out / "per_parameter.json").write_text(json.dumps(payload, indent=1) + "\n")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
