"""The merge list a SentencePiece BPE vocabulary implies (HF `tokenizers` needs one; GGUF files store
none), kept on disk by the vocabulary's digest: recovering it walks every split of every token, most
of a 262k-token vocabulary's load, where reading it back is a few tens of ms."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from kvserve.model.known_models import cache_dir

# part of the digest: a change to the rule below makes the lists cached under the old rule unreachable
MERGES_RULE = 1


def spm_merges(spelled: list[str], vocab: dict[str, int], priority: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, ranked by the merged token's priority (highest first),
    then the longer left piece; read from the cache when this vocabulary and priority were seen before.
    `vocab` maps each of `spelled` to its (last) index, `priority` each token to its rank."""
    path = cache_dir() / f"spm-merges-{_digest(spelled, priority)}.npy"
    pairs = _read(path, len(spelled))
    if pairs is not None:
        pieces = np.array(spelled, dtype=object)  # indexed by the pairs' ids at numpy's speed
        return list(zip(pieces[pairs[:, 0]].tolist(), pieces[pairs[:, 1]].tolist()))
    found = recover_merges(vocab, priority)
    _write(path, np.array([(vocab[left], vocab[right]) for left, right in found], dtype=np.int32).reshape(-1, 2))
    return found


def recover_merges(vocab: dict[str, int], priority: dict[str, float]) -> list[tuple[str, str]]:
    """spm_merges' list computed: each (left, right) whose concatenation is a token, both in `vocab`."""
    candidates = []
    for token, rank in priority.items():
        for cut in range(len(token) - 1, 0, -1):  # longer left piece first
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                candidates.append((-rank, -cut, cut - len(token), left, right))
    candidates.sort(key=lambda c: c[:3])  # stable: equal keys keep vocabulary order
    return [(left, right) for *_, left, right in candidates]


def _digest(spelled: list[str], priority: dict[str, float]) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(f"rule {MERGES_RULE}".encode())
    h.update(np.fromiter(map(len, spelled), dtype=np.int64, count=len(spelled)).tobytes())  # where each token ends
    h.update("".join(spelled).encode("utf-8", "surrogatepass"))
    h.update(np.fromiter(priority.values(), dtype=np.float64, count=len(priority)).tobytes())
    return h.hexdigest()


def _read(path: Path, num_tokens: int) -> np.ndarray | None:
    """The cached (left id, right id) pairs, or None where there are none or they are not a list of
    token-id pairs of this vocabulary (a cut or foreign file: recovered again)."""
    try:
        pairs = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    if pairs.dtype != np.int32 or pairs.ndim != 2 or pairs.shape[1] != 2:
        return None
    if pairs.size and (pairs.min() < 0 or pairs.max() >= num_tokens):
        return None
    return pairs


def _write(path: Path, pairs: np.ndarray) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as out:
            np.save(out, pairs, allow_pickle=False)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache directory: recovered again at the next load
