"""What the optimizer step inside the backward (``--update-in-backward``) saves, measured.

Per model and plan, one float32 step on this CPU, four ways, each after two warm-up steps
(so AdamW's state exists), the profiler's peak of the step's own allocations (the step and
the optimizer's update: not the weights, the optimizer's state or the batch):

- ``autograd``: the torch.nn reference; ``loss.backward(); opt.step(); opt.zero_grad()``;
- ``ours, then opt.step()``: the generated step, then the same AdamW step;
- ``ours, in the backward``: the module generated with ``--update-in-backward``, AdamW
  attached (``unroller.runtime.in_backward.attach``);
- ``ours, no gradient kept``: that module with a plain SGD at learning rate 0 attached:
  each gradient freed the moment it is final, no optimizer buffers: the floor.

Goal (issue's): in the backward <= no gradient kept + the largest single update's
gradients (a block instance's, for a transformer). Also: the parameters after two steps
of ``ours, in the backward`` against ``ours, then opt.step()`` (largest relative
difference, float32), and the time per step of the four (interleaved, median).

    python -m benchmarks.update_in_backward [--models gpt_small] [--batch 2]
        [--out benchmarks/results/update_in_backward.md]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import re
import sys
import tempfile
from pathlib import Path

import torch

from unroller.bench.machine import cpu_model, loadavg
from unroller.bench.profiling import profile_step
from unroller.bench.reference import BENCHMARKS
from unroller.bench.timing import time_interleaved
from unroller.compiler.options import Options
from unroller.runtime.in_backward import attach

MIB = 2**20
#: (label, generation options): what each model is measured under
PLANS = (
    ("nocompress", {}),
    (
        "quant + blocks in pieces of 1",
        {"scheme": "quant", "recompute_segments": ("blocks",), "segment_piece_size": 1},
    ),
)
ROUNDS = 5


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)


def _largest_update(model: torch.nn.Module) -> int:
    """The bytes of the largest set of gradients one ``K.update_params`` call hands over."""
    source = Path(sys.modules[type(model).__module__].__file__).read_text()
    params = dict(model.named_parameters(remove_duplicate=False))
    calls = re.findall(r"K\.update_params\(\s*L,\s*\(([^)]*)\)", source)
    return max(
        sum(params[n].numel() * params[n].element_size() for n in re.findall(r'"([^"]+)"', c))
        for c in calls
    )


def measure(name: str, batch: int, label: str, fields: dict, folder: Path) -> dict:
    bench = BENCHMARKS[name]
    inputs = bench.make_batch(batch)
    torch.manual_seed(0)
    ref = bench.build()
    plain = bench.model_class(Options(**fields), folder / "plain")()
    updating = bench.model_class(Options(update_in_backward=True, **fields), folder / "upd")()
    plain.load_state_dict(ref.state_dict())
    updating.load_state_dict(ref.state_dict())
    floor = copy.deepcopy(updating)
    ref_opt, plain_opt = _adamw(ref.parameters()), _adamw(plain.parameters())
    attach(updating, _adamw(updating.parameters()))
    attach(floor, torch.optim.SGD(floor.parameters(), lr=0.0))

    def autograd_step():
        loss = ref(*inputs)[0]
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        return loss

    def then_step():
        loss = plain(*inputs)
        plain_opt.step()
        plain_opt.zero_grad()
        return loss

    sides = {
        "autograd": autograd_step,
        "ours, then opt.step()": then_step,
        "ours, in the backward": lambda: updating(*inputs),
        "ours, no gradient kept": lambda: floor(*inputs),
    }
    for run in sides.values():
        run()
        run()
    diff = max(
        float((p - q).detach().abs().max() / q.detach().abs().max().clamp_min(1e-30))
        for p, q in zip(updating.parameters(), plain.parameters())
    )
    peaks = {side: profile_step(run, "")["peak_bytes"] for side, run in sides.items()}
    times = time_interleaved(sides, 1, ROUNDS, "ours, then opt.step()")
    grads = sum(p.numel() * p.element_size() for p in plain.parameters() if p.requires_grad)
    largest = _largest_update(updating)
    return {
        "model": name,
        "batch": batch,
        "plan": label,
        "peaks": peaks,
        "ms": {side: times[side]["time_ms"]["median"] for side in sides},
        "grads": grads,
        "largest": largest,
        "diff": diff,
        "met": peaks["ours, in the backward"] <= peaks["ours, no gradient kept"] + largest,
    }


def report(rows: list[dict], command: str) -> str:
    sides = list(rows[0]["peaks"])
    lines = [
        "# The optimizer step inside the backward: measured step peaks",
        "",
        f"From `{command}` ({datetime.datetime.now(datetime.timezone.utc).isoformat()}, "
        f"{cpu_model() or 'unknown CPU'}, torch {torch.__version__}, load {loadavg()}, one "
        "thread). Peak: the profiler's peak of one step's own "
        "allocations, after two warm-up steps (AdamW's state exists); MiB. Time: median of "
        f"{ROUNDS} interleaved rounds, ms.",
        "",
        "| model, batch | plan | "
        + " | ".join(sides)
        + " | all gradients | largest update | goal |",
        "|---|---|" + "---:|" * (len(sides) + 2) + "---|",
    ]
    for r in rows:
        cells = [f"{r['peaks'][s] / MIB:.1f} ({r['ms'][s]:.0f} ms)" for s in sides]
        lines.append(
            f"| {r['model']}, {r['batch']} | {r['plan']} | "
            + " | ".join(cells)
            + f" | {r['grads'] / MIB:.1f} | {r['largest'] / MIB:.1f} | "
            + ("met" if r["met"] else "not met")
            + " |"
        )
    lines += [
        "",
        "Goal: in the backward <= no gradient kept + the largest update's gradients. "
        "Parameters after two steps, in the backward against then opt.step() (float32), "
        "largest relative difference: "
        + ", ".join(f"{r['model']} {r['plan']}: {r['diff']:.1e}" for r in rows)
        + ".",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="gpt_small")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results/update_in_backward.md")
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models.split(","):
            for label, fields in PLANS:
                rows.append(measure(name, args.batch, label, fields, Path(folder) / label[:5]))
    command = "python -m benchmarks.update_in_backward " + " ".join(argv or sys.argv[1:])
    text = report(rows, command.strip())
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
