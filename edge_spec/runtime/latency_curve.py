"""One rule for reading a pass-latency curve between and past the row counts it was measured at.

The cost profile fills its curve from the row counts it timed, and the cost model reads sizes the
profile never held (a ceiling raised after it was taken); both must price a size the same way, or a
long draft would look cheaper to one than to the other.
"""

from __future__ import annotations


def latency_at(points: dict[int, float], n: int) -> float:
    """The latency of a pass over ``n`` rows from ``points`` (latency by row count): exact at a point,
    on the straight line between the two around it, flat before the first (a pass over fewer rows still
    reads every weight), and past the last the last segment goes on: each further row costs what the last
    ones did (never less than nothing; a quarter of the pass per row with one point only), since a flat
    end would make long drafts look free."""
    if n in points:
        return points[n]
    known = sorted(points)
    if not known:
        raise ValueError("no pass latencies measured to read a curve from")
    below = [k for k in known if k < n]
    above = [k for k in known if k > n]
    if below and above:
        lo, hi = below[-1], above[0]
        return points[lo] + (n - lo) / (hi - lo) * (points[hi] - points[lo])
    if not below:
        return points[known[0]]
    last = known[-1]
    step = (points[last] - points[known[-2]]) / (last - known[-2]) if len(known) > 1 else 0.25 * points[last]
    return points[last] + (n - last) * max(step, 0.0)
