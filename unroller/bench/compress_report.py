"""The compress preset's report: tables, goals, what limits the figures, the methods.

``METHODS`` goes into the JSON next to the figures; ``limits_paragraph`` fills this
run's numbers into the explanation of why stored bytes fall further than step time or
peak memory, so the report reads correctly whatever the machine.
"""

from __future__ import annotations

from typing import Any

from unroller.bench.scheme_bench import BASELINE, DENSE, DENSE_TIME_GOAL

MIB = 1024.0 * 1024.0

METHODS = {
    "codec_time": (
        "unroller.bench.timing.time_pair(round_trip, clone, warmup, repeats) per configuration: "
        "in each "
        "round one round trip (compress, then decompress, each timed with time.perf_counter "
        "inside the call) and one torch.clone of the same input tensor, the first of the two "
        "alternating by round; garbage collector off while timing; all under torch.no_grad(). "
        "Both sides allocate their outputs, as they would in a training step"
    ),
    "codec_gbps": (
        "raw bytes of the input tensor (float32: 4 per element; mask: 1 per bool) / median "
        "seconds, in 1e9 bytes/s; for the round trip the time is compress + decompress. "
        "ratio_to_clone = median over rounds of clone_time / round_trip_time (= GB/s of the "
        "round trip / GB/s of clone within the round). Clone reads and writes each byte, so "
        "its memory traffic is twice the figure. ratio_to_pooled_clone = round-trip GB/s / "
        "the GB/s of the median of all float32 clones of every configuration pooled (the "
        "mask: its own clone's median)"
    ),
    "codec_error": (
        "relative L2 error ||x_hat - x|| / ||x|| of one round trip, computed in float64; "
        "stored/raw = packed_nbytes(compress(x)) / x's bytes (also checked equal to "
        "stored_bytes(shape, dtype))"
    ),
    "stored_bytes": (
        "measured: model.stash_report() after one training step of the generated model of "
        "each scheme (unroller.api.load_model_class(path, Options(scheme=S))); "
        "total_stored_bytes and total_raw_bytes; ratio_all = stored / nocompress's stored"
    ),
    "same_activations": (
        "the rows of the scheme's stash_report (keyed by 'tensor') whose compressor holds a "
        "lossy compressor (a part of the label that is neither 'raw' nor 'Bits(...)'); "
        "ratio = sum of their stored bytes under the scheme / sum of the stored bytes of the "
        "same keys under nocompress. Masks stored next to a compressed tensor (e.g. a ReLU "
        "output whose mask also goes to the ReLU backward) are counted in the scheme's bytes. "
        "mask_bytes comes from unroller.compiler.stash.plan_stash (the plan the code was generated "
        "from), whose totals are checked against the measured ones"
    ),
    "step_time": (
        "unroller.bench.timing.time_pair(scheme_step, nocompress_step, warmup, repeats) per "
        "scheme "
        "(nocompress is also paired with itself, as a noise control): one step = "
        "model.zero_grad(set_to_none=True); model(*batch); all models hold the same weights "
        "and buffers (nocompress's state_dict loaded strictly) and get the same batch; "
        "ratio = median over rounds of scheme/nocompress within the round"
    ),
    "peak_memory": (
        "unroller.bench.profiling.profile_step (see the core preset's methods: profiler CPU "
        "allocation events "
        "of one step, gradients None before it); live_at_backward uses as marker the first "
        "aten op whose name contains 'backward' in a profiled step of that model (the loss "
        "backward), because the compressors call aten::ones_like, the core preset's marker, "
        "during the forward pass"
    ),
    "codec_cost": (
        "per scheme, every stored form that is not raw (from unroller.compiler.stash.plan_stash) "
        "gets compress + decompress timed alone on a standard normal tensor of its shape (a "
        "random bool mask for 1-bit forms): one warm-up round, then min(--repeats, 7) rounds "
        "over all forms; per form the median (min_ms: the fastest); total_ms sums the "
        "medians. The mask kernels (e.g. relu_mask) and the stash bookkeeping are not "
        "included"
    ),
    "gradient_check": (
        "one step of each scheme from the same state as nocompress: loss (must be equal, "
        "the forward is the same) and the relative L2 difference of all parameter "
        "gradients concatenated, against nocompress's"
    ),
}


def _mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / MIB:.2f}"


def _met(flag: bool) -> str:
    return "met" if flag else "NOT met"


def _inv(ratio: float | None) -> str:
    """A byte ratio as '0.0833 (1/12.0)'."""
    if ratio is None:
        return "n/a"
    return f"{ratio:.4f} (1/{1 / ratio:.1f})" if ratio > 0 else f"{ratio:.4f}"


def limits_paragraph(results: dict[str, Any]) -> str:
    """What limits the figures, with this run's numbers filled in."""
    configs = results["codecs"]["configs"]
    floats = [c for c in configs if c["input"] == "activation"]
    clone = results["codecs"]["clone_pooled"]
    best = max(floats, key=lambda c: c["gbps"]["round_trip"])
    worst = min(floats, key=lambda c: c["gbps"]["round_trip"])
    threads = results["meta"]["num_threads"]
    spread = (
        ": a clone of a large tensor may or may not page-fault a fresh buffer, whatever the "
        "allocator did before"
        if clone["max_gbps"] > 1.5 * clone["median_gbps"]
        else ""
    )
    general = (
        "What limits these figures. The compressors are eager, unfused PyTorch: every "
        "reshape, matmul, cast, clamp and bit-packing step writes a full-size temporary, so "
        f"their round trips run at {worst['gbps']['round_trip']:.2f} ({worst['label']}) to "
        f"{best['gbps']['round_trip']:.2f} GB/s ({best['label']}) of raw float32 bytes, "
        f"against {clone['median_gbps']:.2f} GB/s for torch.clone (median of all float32 "
        f"clones; best {clone['max_gbps']:.2f} GB/s{spread}). Their cost is paid in the forward "
        "(compress) and in the backward (decompress) of every compressed tensor, and is "
        f"compared with convolutions that run on {threads} CPU thread(s); on an accelerator the "
        "convolutions speed up far more than these memory-bound op chains, so fused kernels "
        "matter more there. Stored bytes are exact (the packed tensors' bytes), but peak "
        "step memory falls much less than stored bytes: it also holds each raw tensor until "
        "its last forward use, the codecs' temporaries, decompressed tensors and gradients "
        "during the backward. The gradient differences are for the benchmark batches of "
        "make_batch, which are white noise (ResNet: standard normal images; U-Net: uniform "
        "noise plus noise), so the early activations are not smooth and DCT+Chop's 16 of 64 "
        "coefficients lose most of their energy; part 1's smooth activation shows the "
        "working range."
    )
    parts = [general]
    for model in results["models"]:
        by = {s["scheme"]: s for s in model["schemes"]}
        if DENSE not in by or BASELINE not in by:
            continue
        d, base = by[DENSE], by[BASELINE]
        same, cost = d["same_activations"], d["codec_cost"]
        bn = sum(
            r["stored_bytes"]
            for r in d["stash"]["rows"]
            if r["tensor"].endswith((":save_mean", ":save_invstd"))
        )
        raw_names = [
            r["tensor"]
            for r in d["stash"]["rows"]
            if r["compressor"] == "raw" and not r["tensor"].endswith((":save_mean", ":save_invstd"))
        ]
        quant = (
            f"; quant (8 bits): {by['quant']['check']['grad_rel_diff_vs_nocompress']:.3g}"
            if "quant" in by
            else ""
        )
        share = (
            f", {100 * cost['total_ms'] / d['extra_step_ms']:.0f}% of the extra time"
            if d["extra_step_ms"] > 0
            else ""
        )
        parts.append(
            f"{model['model']}: dct-dense's {same['count']} compressed tensors hold "
            f"{_mib(same['scheme_stored_bytes'])} MiB, of which "
            f"{_mib(same['mask_bytes_in_scheme'])} MiB are 1-bit masks kept next to the DCT "
            "coefficients (ReLU and max-pool outputs whose own backward needs a mask while the "
            "next op's backward needs the values); without them the same-activation ratio "
            f"would be {_inv(same['ratio_without_masks'])} instead of {_inv(same['ratio'])}. "
            f"{d['raw_kept_count']} tensors ({_mib(d['raw_kept_bytes'])} MiB) stay raw: "
            f"{', '.join(raw_names)} and the batch-norm statistics save_mean/save_invstd "
            f"({bn} bytes in all). The step took {d['time']['ratio']['median']:.2f}x "
            f"nocompress's (median per-round difference {d['extra_step_ms']:+.1f} ms, "
            f"nocompress {base['time']['scheme']['median']:.1f} ms); compress + decompress "
            "of its stored forms, timed alone on tensors of the same shapes, take "
            f"{cost['total_ms']:.1f} ms ({cost['codec_ms']:.1f} ms DCT, "
            f"{cost['mask_ms']:.1f} ms 1-bit masks){share}. "
            "Gradient relative L2 difference from nocompress: "
            f"{d['check']['grad_rel_diff_vs_nocompress']:.3g}{quant}. Peak step memory "
            f"{_mib(d['memory']['peak_bytes'])} MiB against {_mib(base['memory']['peak_bytes'])}"
            f" MiB; live when the backward begins {_mib(d['memory']['live_at_backward_bytes'])}"
            f" MiB against {_mib(base['memory']['live_at_backward_bytes'])} MiB."
        )
    return "\n\n".join(parts)


def format_markdown(results: dict[str, Any]) -> str:
    """The report printed and written next to the JSON: both parts, goals, checks, limits."""
    meta = results["meta"]
    act = results["codecs"]["activation"]
    lines = [
        "## compress_bench: activation compressors and compression schemes (float32, CPU)",
        "",
        f"- date: {meta['date']}",
        f"- machine: {meta.get('cpu_model') or meta['processor']!r}, {meta['machine']}, "
        f"{meta['cpu_count']} CPUs, {meta['platform']}",
        f"- torch {meta['torch']}, torch.get_num_threads() = {meta['num_threads']}, "
        f"python {meta['python']}",
        f"- command: `{meta['command']}`",
        f"- warm-up rounds {meta['args']['warmup']}, timed rounds {meta['args']['repeats']}; "
        f"wall time {meta['wall_seconds']:.0f} s; load average (1/5/15 min) at start "
        f"{meta['loadavg_start']}, at end {meta['loadavg_end']} (other jobs share the machine "
        "when these exceed the threads used)",
        "",
        f"### Compressors: round trip vs torch.clone on {act['shape']} float32 "
        f"({_mib(act['raw_bytes'])} MiB)",
        "",
        f"Tensor: {act['description']}. Mean {act['mean']:.3f}, std {act['std']:.3f}, "
        f"{100 * act['fraction_positive']:.1f}% positive.",
        "",
        "| configuration | input | compress ms | decompress ms | round trip ms (p10/p90) "
        "| round trip GB/s | clone ms | clone GB/s | GB/s ratio to clone (p10/p90) "
        "| ratio to pooled clone | rel. L2 error | stored/raw |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in results["codecs"]["configs"]:
        t, g, r = c["time_ms"], c["gbps"], c["ratio_to_clone"]
        rt = t["round_trip"]
        lines.append(
            f"| {c['label']} | {c['dtype']} {_mib(c['raw_bytes'])} MiB "
            f"| {t['compress']['median']:.2f} | {t['decompress']['median']:.2f} "
            f"| {rt['median']:.2f} ({rt['p10']:.2f}/{rt['p90']:.2f}) | {g['round_trip']:.2f} "
            f"| {t['clone']['median']:.2f} | {g['clone']:.2f} "
            f"| {r['median']:.3f} ({r['p10']:.3f}/{r['p90']:.3f}) "
            f"| {c['ratio_to_pooled_clone']:.3f} | {c['rel_l2_error']:.3g} | {c['stored_over_raw']:.4f} |"
        )
    cp = results["codecs"]["clone_pooled"]
    lines += [
        "",
        f"All float32 clones pooled: median {cp['time_ms']['median']:.2f} ms "
        f"({cp['median_gbps']:.2f} GB/s), fastest {cp['time_ms']['min']:.2f} ms "
        f"({cp['max_gbps']:.2f} GB/s), slowest {cp['time_ms']['max']:.2f} ms.",
    ]
    lines += [
        "",
        "### Schemes: bytes kept for backward (measured by stash_report), step time, memory",
        "",
        "| model | scheme | stored MiB / raw MiB | stored / nocompress (all) "
        "| same activations: n, nocompress MiB -> scheme MiB | ratio same act. (masks incl.) "
        "| step ms median (p10/p90) | ratio vs nocompress (p10/p90) "
        "| codecs alone ms (masks) | peak MiB | live at bwd MiB | grad rel. diff |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in results["models"]:
        for s in m["schemes"]:
            sa, t, mem = s["same_activations"], s["time"], s["memory"]
            st = t["scheme"]
            lines.append(
                f"| {m['model']} b{m['batch_size']} | {s['scheme']} "
                f"| {_mib(s['total_stored_bytes'])} / {_mib(s['total_raw_bytes'])} "
                f"| {_inv(s['ratio_all'])} "
                f"| {sa['count']}, {_mib(sa['nocompress_stored_bytes'])} -> "
                f"{_mib(sa['scheme_stored_bytes'])} | {_inv(sa['ratio'])} "
                f"| {st['median']:.1f} ({st['p10']:.1f}/{st['p90']:.1f}) "
                f"| {t['ratio']['median']:.3f} ({t['ratio']['p10']:.3f}/{t['ratio']['p90']:.3f}) "
                f"| {s['codec_cost']['total_ms']:.1f} ({s['codec_cost']['mask_ms']:.1f}) "
                f"| {_mib(mem['peak_bytes'])} | {_mib(mem['live_at_backward_bytes'])} "
                f"| {s['check']['grad_rel_diff_vs_nocompress']:.3g} |"
            )
    lines += [
        "",
        "(nocompress's row pairs it with itself: its ratio shows the timing noise. "
        "Step-time p10/p90 are of the scheme's own steps. 'codecs alone': compress + "
        "decompress of every stored form of the step, timed outside it on tensors of the "
        "same shapes; in parentheses the 1-bit masks' share.)",
        "",
        "Goals (reported, never asserted):",
        "",
    ]
    for m in results["models"]:
        g = m["goals"]
        if not g:
            lines.append(f"- {m['model']}: dct-dense not measured")
            continue
        lines.append(
            f"- {m['model']}: dct-dense stores <= 1/12 of nocompress for the same activations: "
            f"{_met(g['dense_bytes']['met'])} ({_inv(g['dense_bytes']['value'])}); "
            f"dct-dense step time <= {DENSE_TIME_GOAL}x nocompress: "
            f"{_met(g['dense_time']['met'])} ({g['dense_time']['value']:.3f})"
        )
    lines += ["", "Checks:", ""]
    for m in results["models"]:
        bits = []
        for s in m["schemes"]:
            bits.append(
                f"{s['scheme']} loss {s['check']['loss']:.6g}"
                f"{'' if s['check']['loss_equal_to_nocompress'] else ' (DIFFERS)'}, "
                f"plan {'matches' if s['plan']['matches_measured'] else 'DIFFERS from'} "
                f"measured, masks {_mib(s['mask_bytes_total'])} MiB"
            )
        lines.append(f"- {m['model']}: " + "; ".join(bits))
    lines += ["", "### What limits the figures", "", results["limits"], "", "### Methods", ""]
    lines += [f"- {k}: {v}" for k, v in METHODS.items()]
    return "\n".join(lines) + "\n"
