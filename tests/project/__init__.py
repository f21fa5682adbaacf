"""The repository itself: documentation, packaging, results files, the test suite."""
