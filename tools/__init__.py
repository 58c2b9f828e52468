"""Developer tools run from a checkout: an import-layer check, the schedule-constant override, the round replay.

Importable as ``tools.X`` from the repository root (the tests import the replay and the override this way);
not installed with the package.
"""
