"""The core preset's report: the Markdown table, the goals, and how each figure is measured.

``METHODS`` goes into the JSON next to the figures, so a results file says how it was
made without the code at hand.
"""

from __future__ import annotations

from typing import Any

MIB = 1024.0 * 1024.0

METHODS = {
    "time": (
        "time.perf_counter around one whole train step (zero_grad + forward + backward; "
        "for autograd also loss.backward()); warm-up rounds first; then in each timed round "
        "one step per side, the first side alternating by round (even rounds: ours first); "
        "Python's garbage collector is disabled while timing; p10/p90 by linear "
        "interpolation between order statistics; ratio = median over rounds of "
        "ours/autograd within the round"
    ),
    "peak_memory": (
        "one extra step per side after timing, run under torch.profiler.profile(activities="
        "[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) with the "
        "gradients already None and no earlier step's tensors alive; every CPU "
        "allocation/free event of the trace (prof.profiler.kineto_results."
        "experimental_event_tree(), allocation events including those inside aten ops, "
        "e.g. mkldnn scratch buffers) is accumulated in time order; peak = the largest "
        "running total of bytes allocated since the step began (only the step's own "
        "allocations: parameters, buffers and the batch made before are not counted); "
        "retained = the running total at the end (the new .grad tensors and the loss)"
    ),
    "live_at_backward": (
        "the running total of the same allocation trace at the moment the backward pass "
        "begins: for autograd, the start of a record_function marker wrapping "
        "loss.backward(); for ours, the first aten::ones_like call (the generated step's "
        "seed gradient, torch.ones_like(loss)); null if that call is not found. It counts "
        "every tensor the step allocated that is alive then: saved tensors, outputs, "
        "the loss, not the parameters or the batch"
    ),
    "autograd_saved": (
        "torch.autograd.graph.saved_tensors_hooks active during the reference's forward; "
        "the pack hook records each saved tensor's untyped storage, each storage counted "
        "once (deduplicated by untyped_storage().data_ptr()) with its full nbytes; "
        "'with_params' counts everything, 'without_params' drops tensors that are "
        "nn.Parameters or share storage with one, 'without_params_and_buffers' also "
        "drops buffers (batch-norm running statistics, which native_batch_norm saves)"
    ),
    "ours_saved": (
        "predicted, not measured: unroller.analysis.report.graph_report(unroller.api.load_graph("
        "path), batch)['total_saved_bytes'] (activations the generated backward reads, "
        "each value once, parameters excluded)"
    ),
}


def _mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / MIB:.2f}"


def _met(flag: bool) -> str:
    return "met" if flag else "NOT met"


def format_markdown(results: dict[str, Any], time_goal: float) -> str:
    """The report printed after a run: table, goals, checks, methods."""
    meta = results["meta"]
    lines = [
        "## core_bench: generated unrolled step vs torch.autograd (float32, CPU)",
        "",
        f"- date: {meta['date']}",
        f"- machine: processor {meta['processor']!r}, {meta['machine']}, "
        f"{meta['cpu_count']} CPUs, {meta['platform']}",
        f"- torch {meta['torch']}, torch.get_num_threads() = {meta['num_threads']}, "
        f"python {meta['python']}",
        f"- command: `{meta['command']}`",
        f"- warm-up rounds {meta['args']['warmup']}, timed rounds {meta['args']['repeats']}",
        "",
        "| model | batch | ours ms median | ours p10/p90 | autograd ms median "
        "| autograd p10/p90 | ratio median (p10/p90) | peak MiB ours / autograd "
        "| live at bwd MiB ours / autograd | saved MiB ours (pred.) / autograd (counted) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["models"]:
        t, m, s = r["time"], r["memory"], r["saved"]
        lines.append(
            f"| {r['model']} | {r['batch_size']} "
            f"| {t['ours']['median']:.1f} | {t['ours']['p10']:.1f}/{t['ours']['p90']:.1f} "
            f"| {t['autograd']['median']:.1f} "
            f"| {t['autograd']['p10']:.1f}/{t['autograd']['p90']:.1f} "
            f"| {t['ratio']['median']:.3f} ({t['ratio']['p10']:.3f}/{t['ratio']['p90']:.3f}) "
            f"| {_mib(m['ours']['peak_bytes'])} / {_mib(m['autograd']['peak_bytes'])} "
            f"| {_mib(m['ours']['live_at_backward_bytes'])} / "
            f"{_mib(m['autograd']['live_at_backward_bytes'])} "
            f"| {_mib(s['ours_predicted_bytes'])} / "
            f"{_mib(s['autograd_counted']['without_params_bytes'])} |"
        )
    lines += ["", "Goals (reported, never asserted):", ""]
    for r in results["models"]:
        g = r["goals"]
        lines.append(
            f"- {r['model']}: time ratio <= {time_goal}: {_met(g['time_ratio']['met'])} "
            f"({g['time_ratio']['value']:.3f}); saved bytes ours <= autograd: "
            f"{_met(g['saved_bytes']['met'])}; peak memory ours <= autograd: "
            f"{_met(g['peak_memory']['met'])}"
        )
    lines += ["", "Checks and extra figures:", ""]
    for r in results["models"]:
        c, a = r["check"], r["saved"]["autograd_counted"]
        lines.append(
            f"- {r['model']}: loss ours {c['loss_ours']:.6g} / autograd {c['loss_autograd']:.6g} "
            f"(rel. diff {c['loss_rel_diff']:.2e}, max grad rel. diff "
            f"{c['max_grad_rel_diff']:.2e}); autograd saved MiB with params "
            f"{_mib(a['with_params_bytes'])}, without params and buffers "
            f"{_mib(a['without_params_and_buffers_bytes'])}; retained after the step MiB "
            f"ours {_mib(r['memory']['ours']['retained_bytes'])} / autograd "
            f"{_mib(r['memory']['autograd']['retained_bytes'])}; fastest step ms ours "
            f"{r['time']['ours']['min']:.1f} / autograd {r['time']['autograd']['min']:.1f}"
        )
    lines += ["", "Methods:", ""]
    lines += [f"- {k}: {v}" for k, v in METHODS.items()]
    return "\n".join(lines)
