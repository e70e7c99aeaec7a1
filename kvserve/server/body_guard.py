"""The one structural check every request body passes before any route parses it: UTF-8, nesting
depth, element count, and no NaN/Infinity literals, measured over the raw bytes without recursion.

Routes parse JSON with different parsers (pydantic, `json.loads`, Ollama's and Anthropic's own
readers); each recurses, so a body nested 50,000 deep would reach a RecursionError in whichever
route forgot to guard it. Checking here, in the front door (limits.BodyLimit), means no route can.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

# a JSON string literal (escapes included); what is left once they are blanked out is structure
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NON_FINITE = re.compile(rb"-?\b(?:NaN|Infinity)\b")
_NON_FINITE_MEMBER = re.compile(rb'"((?:[^"\\]|\\.){0,200})"\s*:\s*-?(?:NaN|Infinity)\b')


@dataclass(frozen=True, slots=True)
class BodyShape:
    """The largest structure a request body may have (real requests are far inside both: a chat
    request nests under 10 deep; a JSON schema in response_format or a tool rarely passes 30)."""

    max_depth: int = 128
    max_elements: int = 1 << 19  # array items + object members, all levels together


DEFAULT_BODY_SHAPE = BodyShape()


@dataclass(frozen=True, slots=True)
class BodyProblem:
    message: str
    param: str | None = None  # the member holding the bad value, where one is named


def body_problem(body: bytes, shape: BodyShape = DEFAULT_BODY_SHAPE) -> BodyProblem | None:
    """What is wrong with `body`'s structure, in a sentence for the client; None if nothing is.
    A body that is not JSON at all passes through: the route's parser names that problem."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as err:
        return BodyProblem(f"the request body is not valid UTF-8 (byte {err.start}); send UTF-8 JSON")
    structure = _STRING.sub(b'""', body)
    if (b"NaN" in structure or b"Infinity" in structure) and _NON_FINITE.search(structure):
        member = _NON_FINITE_MEMBER.search(body)
        param = member.group(1).decode() if member else None
        return BodyProblem(f"{param + ': ' if param else ''}NaN and Infinity are not JSON numbers; "
                           f"send a finite number", param)
    chars = np.frombuffer(structure, dtype=np.uint8)
    opens = (chars == ord("[")) | (chars == ord("{"))
    closes = (chars == ord("]")) | (chars == ord("}"))
    depth = int(np.cumsum(opens.astype(np.int32) - closes).max(initial=0))
    if depth > shape.max_depth:
        return BodyProblem(f"the request body nests {depth} levels deep; this server accepts at "
                           f"most {shape.max_depth}")
    # each comma separates two elements, each non-empty container holds one more than its commas
    elements = structure.count(b",") + int(np.count_nonzero(opens))
    if elements > shape.max_elements:
        return BodyProblem(f"the request body holds about {elements:,} array items and object "
                           f"members; this server accepts at most {shape.max_elements:,}")
    return None
