"""Sharded training on paper: per-rank memory and step time of Llama-shaped 1B and 7B models
at 8 and 64 ranks, from the memory model and stated bandwidths (no such machine here).

The model texts are what ``unroll import`` writes for Hugging Face's LlamaForCausalLM
(``llama_text``: RMSNorm, grouped-query attention with rotary positions through
``scaled_dot_product_attention``, the SiLU-gated MLP), at the published shapes of Llama 3.2
1B and Llama 2 7B. Per rank, in float32 with AdamW, ``--shard`` and the optimizer inside
the backward (``--update-in-backward``), one sequence of ``SEQ`` tokens per rank:

- held between steps: the shards of the parameters and of AdamW's two moments, 12 bytes
  per parameter over the ranks (no gradients: each is freed at its update);
- the step: the memory model's peak of the step (``analysis.memory``: activations, what
  is kept for the backward, the gradients of the run being updated, with the scheme's
  compression), plus what is gathered at once: the model's free parameters (a tied
  table: no unit of its own, gathered for the whole step) and two units (the one
  computing, the next one prefetched: block instances, or the embedding, final norm and
  head gathered where used); an embedding or head computed where its rows live
  (``lower.shards.row_units``, while the ranks' tokens together number no more than its
  rows) is never gathered: its buffers (every rank's inputs, and one rank's logits once
  more for the exchange) beside the next unit, where they outweigh a unit;
- time: the step's FLOPs (``analysis.flops``, forward and twice that for the backward, the
  recompute of segments included where the plan has them) at ``FLOPS`` per rank, and the
  all-gathers (every gathered parameter twice: forward and backward) and reduce-scatters
  (their gradients once) at ``BANDWIDTH`` per rank for the ring, (R-1)/R of the bytes
  each, and for a row unit in place its exchanges (the logits twice, the inputs three
  times: ``unroller.parallel.rows``), counted fully exposed and fully hidden: the two
  bounds.

    python -m benchmarks.scaling_paper [--out benchmarks/results/scaling_paper.md]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from unroller.analysis.flops import forward_flops
from unroller.analysis.memory import simulate_graph
from unroller.api import graph_from_text
from unroller.compiler.lower.shards import row_units, shard_units
from unroller.compiler.options import Options
from unroller.compiler.stash import block_instances

GIB = 2**30
SEQ = 2048
RANKS = (8, 64)
SCHEMES = ("nocompress", "quant")
FLOPS = 60e12
"""Assumed float32 throughput per rank: an H100 SXM's 67 TFLOPS of FP32 (NVIDIA's data
sheet) at about 90%: a matrix-product-bound step."""
BANDWIDTH = {8: 450e9, 64: 50e9}
"""Assumed bytes per second per rank for the collectives: NVLink 4 within one node of 8
(900 GB/s each way per GPU in NVIDIA's data sheet, about half of it for a ring's bus
bandwidth), 400 Gb/s InfiniBand per GPU across nodes (64 ranks span 8 nodes)."""
MODELS = {
    "Llama-1B": {
        "hidden": 2048,
        "layers": 16,
        "heads": 32,
        "kv_heads": 8,
        "inter": 8192,
        "vocab": 128256,
        "tied": True,
    },
    "Llama-7B": {
        "hidden": 4096,
        "layers": 32,
        "heads": 32,
        "kv_heads": 32,
        "inter": 11008,
        "vocab": 32000,
        "tied": False,
    },
}


def llama_text(hidden, layers, heads, kv_heads, inter, vocab, tied, seq=SEQ) -> str:
    """The model text ``unroll import`` writes for a LlamaForCausalLM of these shapes."""
    d = hidden // heads
    kv = kv_heads * d
    head = ', tied_weight="model.embed_tokens.weight"' if tied else ""
    calls = "\n".join(
        f"    model.layers.{i} = llama_decoder_layer("
        f"{'model.embed_tokens' if i == 0 else f'model.layers.{i - 1}'})"
        for i in range(layers)
    )
    return f"""model llama {{
    input ids: i64[N, {seq}]
    target y: i64[N, {seq}]

    block llama_decoder_layer(x) {{
        input_layernorm = rmsnorm(x, normalized_shape={hidden}, eps=1e-05)
        self_attn.q_proj = linear(input_layernorm, out_features={hidden}, bias=false)
        self_attn.view = reshape(self_attn.q_proj, shape=({seq}, {heads}, {d}))
        self_attn.transpose = transpose(self_attn.view, dim0=1, dim1=2)
        self_attn.k_proj = linear(input_layernorm, out_features={kv}, bias=false)
        self_attn.view_1 = reshape(self_attn.k_proj, shape=({seq}, {kv_heads}, {d}))
        self_attn.transpose_1 = transpose(self_attn.view_1, dim0=1, dim1=2)
        self_attn.v_proj = linear(input_layernorm, out_features={kv}, bias=false)
        self_attn.view_2 = reshape(self_attn.v_proj, shape=({seq}, {kv_heads}, {d}))
        self_attn.transpose_2 = transpose(self_attn.view_2, dim0=1, dim1=2)
        self_attn.rotary = rotary(self_attn.transpose)
        self_attn.rotary_1 = rotary(self_attn.transpose_1)
        self_attn.sdpa = scaled_dot_product_attention(self_attn.rotary, self_attn.rotary_1, self_attn.transpose_2, is_causal=true, enable_gqa={'true' if kv_heads != heads else 'false'})
        self_attn.transpose_3 = transpose(self_attn.sdpa, dim0=1, dim1=2)
        self_attn.reshape = reshape(self_attn.transpose_3, shape=({seq}, {hidden}))
        self_attn.o_proj = linear(self_attn.reshape, out_features={hidden}, bias=false)
        add = add(x, self_attn.o_proj)
        post_attention_layernorm = rmsnorm(add, normalized_shape={hidden}, eps=1e-05)
        mlp.gate_proj = linear(post_attention_layernorm, out_features={inter}, bias=false)
        mlp.act_fn = silu(mlp.gate_proj)
        mlp.up_proj = linear(post_attention_layernorm, out_features={inter}, bias=false)
        mlp.mul = mul(mlp.act_fn, mlp.up_proj)
        mlp.down_proj = linear(mlp.mul, out_features={hidden}, bias=false)
        add_1 = add(add, mlp.down_proj)
        return add_1
    }}

    model.embed_tokens = embedding(ids, num_embeddings={vocab}, embedding_dim={hidden})
{calls}
    model.norm = rmsnorm(model.layers.{layers - 1}, normalized_shape={hidden}, eps=1e-05)
    lm_head = linear(model.norm, out_features={vocab}, bias=false{head})
    logits = permute(lm_head, dims=(0, 2, 1))
    loss = cross_entropy(logits, y)
    return loss, lm_head
}}
"""


def row(name: str, shapes: dict, scheme: str, ranks: int) -> dict:
    graph = graph_from_text(llama_text(**shapes), f"{name}.txt")
    owners = [n for n in graph.nodes if not n.shares]
    params = sum(
        math.prod(p.shape) for n in owners for p in n.params if p.present and p.name not in n.ties
    )
    sizes = _unit_sizes(graph)
    tokens = ranks * SEQ
    in_place = {n: shape for n, shape in _row_shapes(graph).items() if tokens <= shape[0]}
    gathered_units = [size for n, size in sizes.items() if n not in in_place]
    free = params - sum(sizes.values())
    config = Options(scheme=scheme).compression()
    peak = simulate_graph(graph, config, 1, update_in_backward=True).peak_bytes
    held = 12 * params / ranks
    # the model's free parameters (a tied table) for the whole step, and two units at once
    # (the one computing, the next prefetched), or a row unit in place (its buffers) while
    # the next unit is prefetched
    largest = 4 * max(gathered_units, default=0)
    buffers = max((4 * (tokens * cols + SEQ * rows) for rows, cols in in_place.values()), default=0)
    gathered = 4 * free + max(2 * largest, largest + buffers)
    flops = 3 * sum(forward_flops(n, 1) for n in graph.nodes)
    compute = flops / FLOPS
    share = (ranks - 1) / ranks
    moved = 4 * 3 * (params - sum(r * c for r, c in in_place.values())) * share
    moved += sum(
        4 * (2 * SEQ * r * share + 3 * (ranks - 1) * SEQ * c) for r, c in in_place.values()
    )
    comm = moved / BANDWIDTH[ranks]
    return {
        "model": name,
        "params": params,
        "scheme": scheme,
        "ranks": ranks,
        "held": held,
        "step": peak,
        "gathered": gathered,
        "total": held + peak + gathered,
        "compute": compute,
        "comm": comm,
        "in_place": sorted(in_place),
    }


def _unit_sizes(graph) -> dict[str, int]:
    """Each shard unit's parameters (``lower.shards.shard_units``): a block instance's, a
    top-level layer's own."""
    blocks = {call.name: nodes for call, nodes in block_instances(graph)}
    by_name = {n.name: n for n in graph.nodes}
    sizes = {}
    for name in shard_units(graph):
        nodes = blocks.get(name, [by_name.get(name)])
        sizes[name] = sum(math.prod(p.shape) for n in nodes if n for p in n.params if p.present)
    return sizes


def _row_shapes(graph) -> dict[str, tuple[int, int]]:
    """The units computed where their rows live (``lower.shards.row_units``): rows, cols."""
    by_name = {n.name: n for n in graph.nodes}
    found = {}
    for name in row_units(graph):
        weight = next(p for p in by_name[name].params if p.name == "weight")
        found[name] = tuple(weight.shape)
    return found


def report(rows: list[dict], command: str) -> str:
    lines = [
        "# Sharded training on paper: Llama-shaped 1B and 7B",
        "",
        f"From `{command}`: predictions of the memory model and the assumptions in the "
        "script's docstring (float32, AdamW, `--shard --update-in-backward`, one sequence "
        f"of {SEQ} tokens per rank; {FLOPS / 1e12:.0f} TFLOPS per rank; collectives at "
        + ", ".join(f"{b / 1e9:.0f} GB/s for {r} ranks" for r, b in BANDWIDTH.items())
        + "). GiB per rank; time per step, seconds: compute alone and with every "
        "collective exposed (the two bounds of overlap).",
        "",
        "| model | scheme | ranks | held (shards) | step peak | gathered | total | step time "
        "| computed where their rows live |",
        "|---|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} ({r['params'] / 1e9:.2f}B) | {r['scheme']} | {r['ranks']} | "
            f"{r['held'] / GIB:.2f} | {r['step'] / GIB:.2f} | {r['gathered'] / GIB:.2f} | "
            f"{r['total'] / GIB:.2f} | {r['compute']:.2f} to {r['compute'] + r['comm']:.2f} "
            f"| {', '.join(r['in_place']) or 'none'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/scaling_paper.md"))
    args = parser.parse_args(argv)
    rows = [
        row(name, shapes, scheme, ranks)
        for name, shapes in MODELS.items()
        for scheme in SCHEMES
        for ranks in RANKS
    ]
    text = report(rows, "python -m benchmarks.scaling_paper")
    print(text)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
