"""The draft model over its own pages: after any history of accepted and rejected drafts (rolled back by
DraftKV.verified), its next drafts are those of a fresh draft model computing the request's real tokens
from scratch, so no rejected draft's K/V survives the rollback and catch-up leaves nothing out."""

from __future__ import annotations

import random

import pytest

from kvserve.config import KV_DTYPES
from kvserve.model.draft_model import DraftModel
from kvserve.model.gguf_loader import load_gguf
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.speculative.draft_kv import DraftKV
from tests.model.tiny_models import VOCAB, make_hf_model, write_gguf


@pytest.fixture(scope="module")
def draft_path(tmp_path_factory):
    return str(write_gguf(make_hf_model("llama3", seed=3), "llama3", tmp_path_factory.mktemp("d") / "d.gguf"))


@pytest.mark.parametrize("page_size, max_catch_up", [(4, 64), (1, 5)])
def test_drafts_after_rollbacks_are_those_of_a_fresh_draft(draft_path, page_size, max_catch_up):
    loaded = load_gguf(draft_path)
    num_pages = 128 // page_size + 2
    kv, model = DraftKV(num_pages, page_size, max_catch_up), DraftModel(loaded, num_pages, page_size, KV_DTYPES["fp32"])
    fresh_model = DraftModel(loaded, num_pages, page_size, KV_DTYPES["fp32"])
    rng = random.Random(page_size)
    request = Request("r", [rng.randrange(3, VOCAB) for _ in range(12)], SamplingParams(max_tokens=64))
    proposed = 0
    for _ in range(14):
        k = 3 if kv.caught_up(request) else 0
        work = kv.plan(request, k)
        drafts = model.propose([work])[0]
        assert len(drafts) == work.num_drafts
        if work.num_drafts:
            fresh = DraftKV(num_pages, page_size, max_catch_up=10_000).plan(request, k)
            assert fresh_model.propose([fresh])[0] == drafts  # the same K/V behind them
            proposed += 1
        accepted = rng.randrange(0, k + 1)  # as if the target kept this many, then corrected
        kv.verified("r", work, accepted)
        correction = (drafts[accepted] + 1 + rng.randrange(VOCAB - 4)) % VOCAB if accepted < k else 7
        request.token_ids += drafts[:accepted] + [correction]
        kv.check_invariants()
    assert proposed >= 8
    kv.free("r")
    assert kv.num_used == 0
