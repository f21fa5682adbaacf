"""The benchmark harness behind ``make bench``, ``python -m benchmarks.run`` and ``unroll bench``.

One module per concern:

- ``config``: the command-line flags, the quick and full presets, byte sizes;
- ``models``: the benchmark registry of ``benchmarks/reference.py`` and the generated modules;
- ``peers``: every method measured in one table: ours (the generated unrolled step, per
  scheme, gpu or emulated ipu) and the peers (plain autograd, ``torch.utils.checkpoint`` at
  stage boundaries, autograd with the scheme's compressor in ``saved_tensors_hooks``);
- ``measure``: interleaved step timing, peak step memory, stashed bytes;
- ``budget``: the largest batch whose predicted peak fits a memory budget, confirmed;
- ``goals``: the issue's goals, reported met / not met;
- ``output`` and ``plots``: JSON lines, CSV, Markdown, the summary on screen, PNG plots.

``benchmarks/run.py`` strings them together.
"""
