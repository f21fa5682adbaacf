"""``python -m unroller.cli``: the same as the ``unroll`` script."""

from unroller.cli import main

main()
