"""User-facing errors.

Anything raised as :class:`EdgeSpecError` is a user mistake or an environment
problem (missing file, wrong model pair, unknown provider, ...).  The CLI prints
it as one line and exits non-zero instead of showing a traceback.
"""


class EdgeSpecError(Exception):
    """An error whose message alone tells the user what to fix."""
