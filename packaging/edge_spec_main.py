"""The frozen ``edge-spec`` executable's entry point (packaging/edge-spec.spec): the console script's
``main``, as ``pip install`` would have it."""

from edge_spec.cli import main

if __name__ == "__main__":
    main()
