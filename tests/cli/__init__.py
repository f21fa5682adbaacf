"""The `unroll` command line and the IPU lint it runs."""
