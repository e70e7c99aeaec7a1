"""The draft model of speculative decoding (method draft_model): a smaller model with the target's
tokenizer, run by a ModelRunner of its own over its own KV pages (which pages: speculative/draft_kv.py). Each
step it computes the rows it has not computed yet (catch-up), then proposes drafts greedily, one row per
draft; the target verifies them in its own step (spec_verify.py). A greedy draft is a point mass, the
proposal the rejection rule for sampled requests assumes, so sampled outputs keep the target's law."""

from __future__ import annotations

from kvserve.batch import DraftSeq, ScheduledSeq, SchedulerOutput
from kvserve.config import ConfigError, KVDtype
from kvserve.model.gguf_loader import LoadedModel, load_gguf, resolve_model_path
from kvserve.model.runner import ModelRunner
from kvserve.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=1)


def load_draft_model(name: str, target: LoadedModel, max_model_len: int | None = None) -> LoadedModel:
    """The draft's weights and tokenizer; ConfigError (one line) when it cannot be read or does not
    share the target's vocabulary, or has fewer positions than the target's context needs."""
    try:
        loaded = load_gguf(resolve_model_path(name))
    except ConfigError as err:
        raise ConfigError(f"--speculative-config model: {err}") from None
    draft, want = loaded.config, target.config
    if draft.vocab_size != want.vocab_size or loaded.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise ConfigError(f"--speculative-config model {name!r} has another tokenizer ({draft.vocab_size:,} "
                          f"tokens) than the target ({want.vocab_size:,}): a draft model must share the "
                          "target's tokenizer")
    if max_model_len is not None and max_model_len > draft.max_position_embeddings:
        raise ConfigError(f"--speculative-config model {name!r} has {draft.max_position_embeddings:,} "
                          f"positions, fewer than max_model_len {max_model_len:,}; lower --max-model-len")
    return loaded


class DraftModel:
    """Proposes drafts for the sequences of a step that carry draft work (ScheduledSeq.draft)."""

    def __init__(self, loaded: LoadedModel, num_pages: int, page_size: int, kv_dtype: KVDtype,
                 device: str = "cpu", dtype: str = "float32", threads: int | None = None) -> None:
        self.runner = ModelRunner(loaded, num_pages, page_size, kv_dtype, device=device, dtype=dtype,
                                  threads=threads)

    def propose(self, work: list[DraftSeq]) -> list[list[int]]:
        """-> each DraftSeq's drafts (num_drafts tokens; none for a catch-up only). The first pass
        computes every catch-up row of the step at once; each further pass one row per sequence."""
        proposals: list[list[int]] = [[] for _ in work]
        seqs = {i: ScheduledSeq(str(i), w.token_ids, w.start_pos, w.block_table, w.num_drafts > 0, GREEDY)
                for i, w in enumerate(work) if w.token_ids}
        while seqs:
            result = self.runner.execute(SchedulerOutput(seqs=list(seqs.values())))
            following = {}
            for i, token in zip(seqs, result.sampled):
                if token is None:
                    continue
                proposals[i].append(token.token_id)
                w = work[i]
                if len(proposals[i]) < w.num_drafts:  # the draft just proposed is the next row
                    position = w.start_pos + len(w.token_ids) + len(proposals[i]) - 1
                    following[i] = ScheduledSeq(str(i), [token.token_id], position, w.block_table, True, GREEDY)
            seqs = following
        return proposals

    def kv_cache_bytes(self) -> int:
        return self.runner.kv_cache_bytes()
