"""The answer when the engine could not hold an output to its constraint (finish_reason "error" from
the engine: a grammar that needs a token which ends generation, a matcher that failed mid-way): a 400
naming the reason, never the partial output with finish_reason "stop". Streams end with it as an
error event (serving.py, anthropic.py)."""

from __future__ import annotations

from kvserve.request import RequestOutput
from kvserve.server.protocol import APIError

CODE = "constraint_not_enforceable"


def unenforced(output: RequestOutput) -> APIError | None:
    """The 400 for an output one of whose samples ended outside its constraint; None otherwise."""
    for completion in output.outputs:
        if completion.finish_reason == "error":
            return APIError(f"the output constraint could not be enforced: {completion.error or 'no reason given'}; "
                            f"no output is returned. Change the schema or grammar", 400,
                            "invalid_request_error", None, CODE)
    return None
