"""A generated module over several processes: data parallel (gradient buckets all-reduced in the backward) and pipeline parallel (one process per stage)."""
