"""The compiler from model text to generated module: parsing, graphs, the registry, schemes, stash plans, recompute, segments, outlining, options, the golden files."""
