"""``python -m edge_spec.cli``: the ``edge-spec`` command."""

from edge_spec.cli import main

main()
