"""Training with a generated module: the training loop and its run folders, metrics, the accuracy study over seeds."""
