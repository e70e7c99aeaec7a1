"""The prompt of llama-server's `POST /infill` (the code completion of llama.vim and llama.vscode), laid out
as llama-server lays it out:

    [BOS] [REPO]myproject\\n ([FILE_SEP]name\\n text)... [FILE_SEP]filename\\n [PRE]prefix prompt [SUF]suffix [MID]

The repository and file-separator tokens go in only where the tokenizer has them; without a file separator
each extra chunk follows a "--- snippet ---" line. The parts are trimmed as llama-server trims them for its
default batch: the prefix keeps its last 3/4 of the batch, the suffix its first 1/4 less the prompt, and the
extra chunks their last tokens that leave the context the batch and room for 2 x n_predict (n_predict -1:
"to the context's end", counted as llama-server counts it), and always room for the answer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.server.fim import FimTokens
from kvserve.server.protocol import APIError

INFILL_BATCH = 2048  # llama-server's default batch (-b), which it sizes the FIM context to
# the repository and file-separator tokens by the spellings llama.cpp's vocabulary looks for
REPO_SPELLINGS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
FILE_SEP_SPELLINGS = ("<|file_sep|>",)
SNIPPET = "\n\n--- snippet ---\n\n"  # a chunk's head where the model has no file separator


@dataclass(frozen=True, slots=True)
class InfillParts:
    prefix: str  # the code before the gap
    suffix: str  # the code after it
    prompt: str  # text typed at the gap, after the prefix
    extra: list[tuple[str, str]]  # (filename, text) of other files' chunks, oldest first


def infill_ids(tokenizer: Any, fim: FimTokens | None, bos: int | None, parts: InfillParts, max_model_len: int,
               n_predict: int, batch: int = INFILL_BATCH, code_tokenizer: Any = None) -> list[int]:
    """The prompt ids for `parts` (`tokenizer`: a tokenizers.Tokenizer, for the prompt; `code_tokenizer`: the
    one for the code parts, which llama-server reads with special-token spellings as text (fim.text_only;
    None: `tokenizer`); `bos`: the id to lead with, None for none); a 400 naming input_prefix when the model
    has no FIM tokens."""
    if fim is None:
        raise APIError("/infill needs a fill-in-the-middle model; this model's tokenizer has no FIM tokens "
                       "(<fim_prefix>, <fim_suffix>, <fim_middle>)", param="input_prefix")

    def ids(text: str, reader: Any = code_tokenizer or tokenizer) -> list[int]:
        return reader.encode(text, add_special_tokens=False).ids if text else []

    def first_known(spellings: tuple[str, ...]) -> int | None:
        return next((i for s in spellings if (i := tokenizer.token_to_id(s)) is not None), None)

    repo, sep = first_known(REPO_SPELLINGS), first_known(FILE_SEP_SPELLINGS)
    extra = [repo, *ids("myproject\n")] if repo is not None else []
    for filename, text in parts.extra:
        extra += [sep, *ids(filename + "\n")] if sep is not None else ids(SNIPPET)
        extra += ids(text)
    if sep is not None:
        extra += [sep, *ids("filename\n")]
    prefix, suffix, prompt = ids(parts.prefix), ids(parts.suffix), ids(parts.prompt, tokenizer)
    prefix = prefix[len(prefix) - min(len(prefix), 3 * (batch // 4)):]
    suffix = suffix[:max(0, batch // 4 - (2 + len(prompt)))]
    pre, suf, mid = (tokenizer.token_to_id(t) for t in (fim.prefix, fim.suffix, fim.middle))
    head, fill = [bos] if bos is not None else [], [pre, *prefix, *prompt, suf, *suffix, mid]
    # llama-server's share for the extra chunks, and never past the context (its own share can overrun it by
    # a few tokens when every part is at its limit, and it then refuses its own prompt)
    room = max_model_len - len(head) - len(fill) - max(n_predict, 1)
    take = max(0, min(max_model_len - batch - 2 * n_predict, room, len(extra)))
    return [*head, *extra[len(extra) - take:], *fill]
