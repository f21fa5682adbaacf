"""A generated module over several processes: data and pipeline parallel."""
