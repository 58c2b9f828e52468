"""Benchmarks: ``edge-spec bench``'s work (``runs``: decoding modes compared prompt by prompt;
``session_runs``: session by session, turn by turn) and the measurement code the scripts of
``benchmarks/`` share with the tests.

The runtime never imports this package.  The measurement code lives in the package rather than beside the
scripts so that the tests import it like any other module, not a script by its path, and so that a rule a
published figure rests on (how a peer's tokens are counted, which pass sizes agree bit for bit, which
kernel a profile event belongs to) is tested where the script reads it.  This ``__init__`` imports
nothing, because ``peers`` must also load in the peers' own virtual environments, where edge-spec is not
installed.
"""
