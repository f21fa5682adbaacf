"""Does a change to the generator change what the generated code computes?

    python -m benchmarks.equivalence --before REV [--models a,b] [--schemes s,t]

For every model file (benchmarks/models/ and tests/models/) and scheme, the gpu module
is generated twice, by the generator at git revision REV (checked out in a temporary
worktree) and by the working tree; both run one float32 training step and a prediction
on CPU from the same weights and batch, each in its own process with its own runtime.
The report says, per model and scheme, whether loss, every gradient, the state after the
step (running statistics), the predictions and the stash bytes are bit for bit equal,
and the line counts of the two modules. A refactor of the code generator should leave
every row "bit-identical".
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.emitted_corpus import models as model_files

ROOT = Path(__file__).resolve().parent.parent
SCHEMES = ("nocompress", "dct-first", "dct-dense", "quant")
GENERATE = (
    "import sys\n"
    "from unroller.api import generate_source\n"
    "try:\n"
    "    from unroller.compiler.options import Options\n"
    "except ImportError:  # a revision before the compiler's subpackage\n"
    "    from unroller.options import Options\n"
    "text = generate_source(sys.argv[1], Options(scheme=sys.argv[3]), label='m.txt')\n"
    "open(sys.argv[2], 'w').write(text)\n"
)
STEP = """
import importlib.util, sys, torch
path, out, model_file = sys.argv[1:4]
spec = importlib.util.spec_from_file_location("generated", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
torch.manual_seed(0)
model = module.Model()
if len(sys.argv) > 4:
    given = torch.load(sys.argv[4])
    model.load_state_dict(given["state"])
    batch, kinds = given["batch"], given["kinds"]
else:
    from unroller.api import load_graph
    batch, kinds = [], []
    gen = torch.Generator().manual_seed(1)
    for v in load_graph(model_file).inputs:
        shape = (4, *v.type.shape[1:])
        kinds.append(v.kind)
        if v.type.dtype.startswith("i"):
            classes = [n.inputs[0].type.shape[1] for n, _ in v.consumers
                       if n.op.name == "cross_entropy"]
            batch.append(torch.randint(0, (classes or [2])[0], shape, generator=gen))
        else:
            batch.append(torch.rand(shape, generator=gen))
state = {k: v.clone() for k, v in model.state_dict().items()}
loss = model(*batch)
grads = {n: p.grad for n, p in model.named_parameters()}
after = {k: v.clone() for k, v in model.state_dict().items()}
preds = model.predict(*[b for b, k in zip(batch, kinds) if k == "input"])
report = model.stash_report()
stash = sorted((r["tensor"], r["stored_bytes"]) for r in report["rows"])
torch.save(dict(state=state, batch=batch, kinds=kinds, loss=loss, grads=grads, after=after,
                preds=preds, stash=stash), out)
"""
COMPARED = ("loss", "grads", "after", "preds", "stash")


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def run(code_root: Path, args: list[str], work: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(code_root), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, cwd=work
    )
    if done.returncode:
        raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr else "failed")


def compare(before: Path, model: Path, scheme: str, work: Path) -> str:
    step = work / "step.py"
    files = {}
    for side, root in (("old", before), ("new", ROOT)):
        module = work / f"{model.stem}-{scheme}-{side}.py"
        run(root, ["-c", GENERATE, str(model), str(module), scheme], work)
        files[side] = module
    old_out, new_out = work / "old.pt", work / "new.pt"
    run(before, [str(step), str(files["old"]), str(old_out), str(model)], work)
    run(ROOT, [str(step), str(files["new"]), str(new_out), str(model), str(old_out)], work)
    a, b = torch.load(old_out), torch.load(new_out)
    differ = [key for key in COMPARED if not same(a[key], b[key])]
    lines = [len(files[s].read_text().splitlines()) for s in ("old", "new")]
    verdict = "bit-identical" if not differ else "DIFFERS: " + ", ".join(differ)
    return f"{model.stem:14s} {scheme:11s} lines {lines[0]:6d} -> {lines[1]:5d}  {verdict}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="git revision to compare against")
    parser.add_argument("--models", help="comma-separated model stems (default: all)")
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    args = parser.parse_args(argv)
    models = model_files()
    if args.models:
        models = [m for m in models if m.stem in args.models.split(",")]
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        work, before = Path(tmp), Path(tmp) / "before"
        git = ["git", "-C", str(ROOT), "worktree"]
        subprocess.run([*git, "add", "--detach", str(before), args.before], check=True)
        try:
            (work / "step.py").write_text(STEP)
            for model in models:
                for scheme in args.schemes.split(","):
                    try:
                        line = compare(before, model, scheme, work)
                    except RuntimeError as exc:
                        line = f"{model.stem:14s} {scheme:11s} ERROR {exc}"
                    failures += "bit-identical" not in line
                    print(line, flush=True)
        finally:
            subprocess.run([*git, "remove", "--force", str(before)], check=False)
    print(f"{failures} of the comparisons are not bit-identical")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
