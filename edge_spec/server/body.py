"""JSON request bodies, decoded off the event loop with their nesting, size and numbers bounded.

Decoding a body of a few MiB takes long enough to hold up every other request (``/health`` included) if
it ran on the event loop, so it runs in a worker thread.  That is not enough for every body: the decoder
holds the GIL for its whole run, which is short for text (a 4 MiB string decodes in milliseconds) but
not for a body of a million small values (``[1,1,1,...]``, ``[{},{},...]``: half a second), so the
values are counted first and more than :data:`MAX_VALUES` refused.  A body nested thousands of levels
deep (``[[[[...``) would make the decoder recurse until Python gives up with a RecursionError; the
nesting is measured first, without recursion, and refused past :data:`MAX_DEPTH` (no request of this
API needs more than a handful of levels).  Both are measured over the bytes outside JSON strings, with
numpy (which runs without the GIL), in time linear in the body.

An integer literal of more digits than Python converts (4300, ``sys.get_int_max_str_digits``) is a
400 naming the limit; a float too large for a double reads as infinity, which every numeric field
refuses by name.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

import numpy as np
from starlette.requests import Request

from edge_spec.server.errors import bad_request
from edge_spec.server.schemas import parse_json

MAX_DEPTH = 64
MAX_VALUES = 100_000  # array items and object members; /detokenize's id limit fits with room
T = TypeVar("T")


def _plain(raw: bytes) -> np.ndarray:
    """The bytes of the JSON text ``raw`` with every escape pair (``\\\\``, ``\\"``) blanked out, so that
    each quote left opens or closes a string.  Pairs are taken from the left, as a JSON reader takes
    them (outside strings a backslash is no JSON at all, and the decoder stops there)."""
    return np.frombuffer(raw.replace(b"\\\\", b"__").replace(b'\\"', b"__"), dtype=np.uint8)


def _outside(codes: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """Which of the positions ``wanted`` (indices into ``codes``, as from ``_plain``) lie outside strings."""
    quotes = np.flatnonzero(codes == ord('"'))
    return np.searchsorted(quotes, wanted) % 2 == 0  # an even number of quotes before: outside


def nesting_depth(raw: bytes) -> int:
    """How deep arrays and objects nest in the JSON text ``raw`` (brackets inside strings do not count)."""
    codes = _plain(raw)
    brackets = np.flatnonzero((codes == ord("[")) | (codes == ord("{")) | (codes == ord("]")) | (codes == ord("}")))
    brackets = brackets[_outside(codes, brackets)]
    if not brackets.size:
        return 0
    opening = (codes[brackets] == ord("[")) | (codes[brackets] == ord("{"))
    return max(int(np.cumsum(np.where(opening, 1, -1)).max()), 0)


def value_count(raw: bytes) -> int:
    """At least how many array items and object members the JSON text ``raw`` holds: its commas outside
    strings, plus one."""
    codes = _plain(raw)
    commas = np.flatnonzero(codes == ord(","))
    return int(np.count_nonzero(_outside(codes, commas))) + 1


def decode_object(raw: bytes, max_depth: int = MAX_DEPTH, max_values: int = MAX_VALUES) -> dict:
    """The body as a JSON object, else a 400 in OpenAI's shape (bad JSON, not an object, nested too deep,
    too many values, an integer of too many digits)."""
    # fast: most bodies cannot nest deeper, nor hold more values, than their brackets and commas allow
    if raw.count(b"[") + raw.count(b"{") > max_depth:
        depth = nesting_depth(raw)
        if depth > max_depth:
            raise bad_request(f"the JSON body nests {depth} levels deep; at most {max_depth} are accepted")
    if raw.count(b",") >= max_values:
        values = value_count(raw)
        if values > max_values:
            raise bad_request(
                f"the JSON body holds {values} values (array items and object members); at most "
                f"{max_values} are accepted"
            )
    try:
        return parse_json(raw)
    except RecursionError:  # cannot happen under the depth bound; never a traceback if it does
        raise bad_request(f"the JSON body nests too deeply; at most {max_depth} levels are accepted") from None


async def read_request(request: Request, parse: Callable[[dict], T]) -> T:
    """The request body decoded and turned into a typed request by ``parse``, both in a worker thread."""
    raw = await request.body()
    return await asyncio.to_thread(lambda: parse(decode_object(raw)))
