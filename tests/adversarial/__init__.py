"""Adversarial tests: edge inputs and hostile configurations (a package, so that module
basenames such as test_compressors.py may repeat those of tests/)."""
