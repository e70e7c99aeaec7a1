"""OutputProcessor: turns the engine's Requests into RequestOutputs. It groups the n samples of one
user request, cuts text at stop strings (which need detokenized text, so the scheduler cannot apply
them) and detokenizes: a running sample's text token by token (tokenizers' DecodeStream, so a step
decodes its new tokens, not the whole output again), a finished one's whole."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenizers.decoders import DecodeStream

from kvserve.request import CompletionOutput, Request, RequestMetrics, RequestOutput, RequestStatus, SpecDecodeCounts


@dataclass(slots=True)
class RunningText:
    """A running sample's output text so far, all but a trailing incomplete character."""

    stream: DecodeStream
    text: str = ""
    num_tokens: int = 0  # output tokens decoded into `text`


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._prompts: dict[str, str | None] = {}  # request id -> prompt text (None: token ids)
        self._stop_text: dict[str, str] = {}  # sample id -> output text cut at its stop string
        self._groups: dict[str, list[Request]] = {}  # request id -> its n samples (n > 1), in order
        self._group_of: dict[str, str] = {}  # sample id -> request id
        self._running: dict[str, RunningText] = {}  # sample id -> its text so far (until it finishes)

    def add(self, request_id: str, prompt: str | None, samples: list[Request]) -> None:
        self._prompts[request_id] = prompt
        if len(samples) > 1:
            self._groups[request_id] = samples
            self._group_of.update((s.request_id, request_id) for s in samples)

    def is_known(self, request_id: str) -> bool:
        return request_id in self._groups

    def samples(self, request_id: str) -> list[Request] | None:
        """The n samples of a request with n > 1; None otherwise."""
        return self._groups.get(request_id)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def hits_stop_string(self, request: Request) -> bool:
        """True (and the text is cut there, or after it with include_stop_str_in_output) when the output
        contains one of the request's stop strings (none ending within its first min_tokens tokens); the one
        that starts first (first listed among those starting there) is the request's stop_reason."""
        params = request.sampling_params
        if request.num_output_tokens < params.min_tokens:
            return False
        text, start = self.running_text(request), 0
        if params.min_tokens:  # a stop string counts once it ends past the first min_tokens tokens' text
            start = len(self.decode(request.output_token_ids[:params.min_tokens], params.skip_special_tokens))
        found = ((text.find(s, max(start - len(s) + 1, 0)), i, s) for i, s in enumerate(params.stop or []) if s)
        hits = [hit for hit in found if hit[0] >= 0]  # (one search per stop string)
        if hits:
            at, _, request.stop_reason = min(hits)
            self._stop_text[request.request_id] = text[:at + len(request.stop_reason)
                                                       if params.include_stop_str_in_output else at]
        return bool(hits)

    def running_text(self, request: Request) -> str:
        """The text of a running sample's output, its new tokens decoded onto what the last call had."""
        state = self._running.get(request.request_id)
        if state is None:
            stream = DecodeStream(skip_special_tokens=request.sampling_params.skip_special_tokens)
            state = self._running[request.request_id] = RunningText(stream)
        for token_id in request.token_ids[request.num_prompt_tokens + state.num_tokens:]:
            state.text += state.stream.step(self.tokenizer, token_id) or ""
            state.num_tokens += 1
        return state.text

    def output(self, request: Request) -> RequestOutput:
        """The RequestOutput of the user's request this sample belongs to (all n samples). The
        group's bookkeeping is dropped once every sample finished."""
        group_id = self._group_of.get(request.request_id)
        samples = self._groups[group_id] if group_id else [request]
        first = samples[0]
        finished = all(s.status.is_finished for s in samples)
        completions = [self._completion(i, s, finished) for i, s in enumerate(samples)]
        rid = first.request_id
        prompt = self._prompts.pop(rid, None) if finished else self._prompts.get(rid)
        if finished and group_id:
            del self._groups[group_id]
            for s in samples:
                self._group_of.pop(s.request_id, None)
        first_token = min((s.first_token_time for s in samples if s.first_token_time), default=None)
        last = max((s.finish_time or 0.0 for s in samples), default=None) if finished else None
        scheduled = min((s.first_scheduled_time for s in samples if s.first_scheduled_time), default=None)
        return RequestOutput(
            request_id=rid, prompt=prompt, prompt_token_ids=first.prompt_token_ids,
            outputs=completions, finished=finished, num_cached_tokens=first.num_cached_tokens,
            metrics=RequestMetrics(first.arrival_time, first_token, last, scheduled), lease_usage=first.lease_usage,
            kv_cache=first.kv_cache, spec_decode=_spec_counts(samples),
            held_lease_id=first.cache.held_lease_id, hold_refused=first.cache.hold_refused,
            prompt_logprobs=list(first.prompt_logprobs) if first.sampling_params.prompt_logprobs is not None else None)

    def _completion(self, index: int, request: Request, group_finished: bool) -> CompletionOutput:
        done = request.status.is_finished
        text = (self._stop_text.pop(request.request_id, None) if group_finished
                else self._stop_text.get(request.request_id))
        if done:
            self._running.pop(request.request_id, None)
        if text is None and not done:
            text = self.running_text(request)
        elif text is None:  # finished: the whole output decoded once (a trailing partial character shows)
            params, ids = request.sampling_params, request.output_token_ids
            if not params.skip_special_tokens and not params.include_stop_str_in_output and request.ended_by_eos:
                ids = ids[:-1]  # (vLLM's: the EOS that ended it is not shown, kept special tokens or not)
            text = self.decode(ids, params.skip_special_tokens)
        return CompletionOutput(
            index=index, token_ids=list(request.output_token_ids), text=text,
            finish_reason=request.status.value if done else None,
            logprobs=list(request.logprobs) if request.sampling_params.logprobs is not None else None,
            error=request.error if done else None,
            stop_reason=request.stop_reason if request.status is RequestStatus.FINISHED_STOPPED else None)


def _spec_counts(samples: list[Request]) -> SpecDecodeCounts | None:
    """The samples' speculative decoding counts summed; None where none of them verified a draft."""
    if not any(s.spec_decode.num_drafts for s in samples):
        return None
    return SpecDecodeCounts(sum(s.spec_decode.num_drafts for s in samples),
                            sum(s.spec_decode.num_draft_tokens for s in samples),
                            sum(s.spec_decode.num_accepted_tokens for s in samples))
