"""A SentencePiece vocabulary's merges read back from the cache are the merges recovered from it,
whatever the vocabulary; a cut, foreign or unwritable cache costs a recovery, never a wrong list."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.model import spm_merges as merges_module
from kvserve.model.spm_merges import recover_merges, spm_merges
from kvserve.model.tokenizer import build_tokenizer

TOKENS = ["<unk>", "<s>", "</s>", "\u2581", "a", "b", "c", "ab", "bc", "\u2581a", "\u2581ab", "abc", "\u2581abc", "cab"]


def _inputs(tokens: list[str], ranks: list[float]) -> tuple[list[str], dict[str, int], dict[str, float]]:
    vocab = {t: i for i, t in enumerate(tokens)}
    return tokens, vocab, dict(zip(tokens, ranks))


def _cached_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("spm-merges-*.npy"))


def test_the_second_load_reads_the_first_ones_list(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path))
    spelled, vocab, priority = _inputs(TOKENS, [-i for i in range(len(TOKENS))])
    first = spm_merges(spelled, vocab, priority)
    assert first == recover_merges(vocab, priority) and ("\u2581a", "bc") in first
    assert len(_cached_files(tmp_path)) == 1

    def no_recovery(*_):
        raise AssertionError("recovered again although the list was cached")

    monkeypatch.setattr(merges_module, "recover_merges", no_recovery)
    assert spm_merges(spelled, vocab, priority) == first


def test_another_priority_is_another_list(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path))
    spelled, vocab, by_position = _inputs(TOKENS, [-i for i in range(len(TOKENS))])
    _, _, by_length = _inputs(TOKENS, [len(t) for t in TOKENS])
    a, b = spm_merges(spelled, vocab, by_position), spm_merges(spelled, vocab, by_length)
    assert a != b and sorted(a) == sorted(b)  # the same splits, ranked otherwise
    assert b == recover_merges(vocab, by_length) and len(_cached_files(tmp_path)) == 2


@pytest.mark.parametrize("damage", ["cut", "ids past the vocabulary", "floats", "not numpy"])
def test_a_damaged_cache_is_recovered_and_rewritten(tmp_path, monkeypatch, damage):
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path))
    spelled, vocab, priority = _inputs(TOKENS, [-i for i in range(len(TOKENS))])
    expected = spm_merges(spelled, vocab, priority)
    [path] = _cached_files(tmp_path)
    if damage == "cut":
        path.write_bytes(path.read_bytes()[:-5])
    elif damage == "ids past the vocabulary":
        np.save(path, np.array([[0, len(TOKENS)]], dtype=np.int32))
    elif damage == "floats":
        np.save(path, np.zeros((3, 2)))
    else:
        path.write_text("{}")
    assert spm_merges(spelled, vocab, priority) == expected
    assert np.load(path).tolist() == [[vocab[left], vocab[right]] for left, right in expected]


def test_an_unwritable_cache_still_gives_the_list(tmp_path, monkeypatch):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    monkeypatch.setenv("KVSERVE_CACHE", str(not_a_folder))
    spelled, vocab, priority = _inputs(TOKENS, [-i for i in range(len(TOKENS))])
    assert spm_merges(spelled, vocab, priority) == recover_merges(vocab, priority)


def test_a_tokenizer_from_the_cache_encodes_as_one_built_cold(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path))
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": TOKENS,
            "tokenizer.ggml.scores": [-float(i) for i in range(len(TOKENS))], "tokenizer.ggml.unknown_token_id": 0}
    text = "abc cab abcab bca"
    cold = build_tokenizer(meta).encode(text).ids
    assert _cached_files(tmp_path)
    assert build_tokenizer(meta).encode(text).ids == cold


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(alphabet="ab\u2581c", min_size=1, max_size=5), min_size=1, max_size=30, unique=True),
       st.randoms(use_true_random=False))
def test_cached_merges_equal_recovered_ones_for_any_vocabulary(tokens, rng):
    ranks = [rng.choice([0.0, -1.0, -2.5, float(rng.randint(-50, 50))]) for _ in tokens]  # ties included
    spelled, vocab, priority = _inputs(tokens, ranks)
    with tempfile.TemporaryDirectory() as folder, pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVSERVE_CACHE", folder)
        assert spm_merges(spelled, vocab, priority) == recover_merges(vocab, priority)  # recovered, written
        assert spm_merges(spelled, vocab, priority) == recover_merges(vocab, priority)  # read back
