"""Training runs, datasets, metrics and the accuracy study."""
