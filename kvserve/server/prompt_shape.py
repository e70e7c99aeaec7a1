"""The shape of `/v1/completions`' `prompt` (one text, one list of token ids, or up to MAX_PROMPTS of
either), checked before pydantic tries each member of the union, so the error names the actual problem."""

from __future__ import annotations

from typing import Any

MAX_PROMPTS = 64  # prompts in one batched /v1/completions request
MAX_TOKEN_ID = 2**31


def check_prompt(value: Any) -> Any:
    """`value` unchanged if it has one of the prompt's shapes; a ValueError naming what is wrong (a negative
    token id, too many prompts, mixed types) otherwise."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError(f"prompt must be a string, a list of token ids, a list of strings or "
                         f"a list of token-id lists, got {json_type(value)}")
    if not value:
        raise ValueError("prompt must not be an empty list")
    if all(_is_int(v) for v in value):
        _check_token_ids(value, "")
    elif all(isinstance(v, str) for v in value) or all(isinstance(v, list) for v in value):
        if len(value) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(value)}")
        for i, item in enumerate(value):
            if isinstance(item, list):
                if not item:
                    raise ValueError(f"prompt {i} is an empty list of token ids")
                if not all(_is_int(v) for v in item):
                    raise ValueError(f"prompt {i} must be a list of integer token ids")
                _check_token_ids(item, f"prompt {i}: ")
    else:
        raise ValueError("prompt lists must hold only token ids (integers), only strings, or "
                         "only token-id lists, not a mix")
    return value


def json_type(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
             list: "a list", dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_token_ids(token_ids: list[int], where: str) -> None:
    for i, token_id in enumerate(token_ids):
        if token_id < 0 or token_id > MAX_TOKEN_ID:
            raise ValueError(f"{where}token ids must be non-negative integers in the model's "
                             f"vocabulary; item {i} is {token_id}")
