"""Bench workloads: the W1 file, a generated mix or a trace file, resolved once to token ids and
max_tokens per request, so every engine gets the same input; a trace with closed loops (the agent
trace) also keeps who follows whom (Loops), since a follow-up's prompt is known only at run time."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvserve.cache.hashing import common_prefix_len
from kvserve.config import ConfigError
from kvserve.tools.traces import GENERATORS, TraceRequest, encode_prompts, generate_trace, has_loops, load_trace

DEFAULT_MAX_TOKENS = 64
DEFAULT_NUM_REQUESTS = 32  # generated mixes


@dataclass(slots=True)
class Loops:
    """Per request of a closed-loop workload: its arrival (None: it follows another), the index of
    the request it follows, the delay after that one finishes, whether its prompt continues that
    conversation (its token_ids are then only what it appends), whether its answer is a tool call."""

    arrivals: list[float | None]
    after: list[int | None]
    delay_s: list[float]
    continues: list[bool]
    tool_call: list[bool]

    @classmethod
    def of(cls, trace: list[TraceRequest]) -> Loops:
        index = {r.id: i for i, r in enumerate(trace)}
        followed = {r.after for r in trace if r.continues}
        return cls([(r.arrival or 0.0) if r.after is None else None for r in trace],
                   [None if r.after is None else index[r.after] for r in trace],
                   [r.delay_s or 0.0 for r in trace], [r.continues for r in trace],
                   # a call nobody answers (the trace was cut after it) is a final answer
                   [r.tool_call and r.id in followed for r in trace])


@dataclass(slots=True)
class Workload:
    name: str
    source: str
    request_ids: list[str]
    token_ids: list[list[int]]
    max_tokens: list[int]
    loops: Loops | None = None

    def describe(self) -> dict:
        out = {"name": self.name, "source": self.source, "num_requests": len(self.token_ids),
               "prompt_tokens": sum(map(len, self.token_ids)), "max_tokens": sum(self.max_tokens),
               "shared_prefix_tokens": shared_prefix_len(self.token_ids)}
        if self.loops is not None:  # prompt_tokens: what the trace gives; follow-ups resend more
            out.update(closed_loop=True, num_follow_ups=sum(self.loops.continues),
                       num_tool_calls=sum(self.loops.tool_call))
        return out




def shared_prefix_len(token_ids: list[list[int]]) -> int:
    """Tokens every request starts with."""
    return min((common_prefix_len(token_ids[0], ids) for ids in token_ids), default=0)


def workloads_dir() -> Path:
    default = Path(__file__).resolve().parents[4] / "shared" / "workloads"  # ../shared from the repo
    return Path(os.environ.get("KVSERVE_WORKLOADS", default))


def load_workload(name: str, limit: int | None = None, max_tokens: int | None = None, seed: int = 0,
                  model: str | None = None) -> Workload:
    """w1 -> ../shared/workloads/w1.jsonl (else the generated w1 mix); a mix name; or a trace file."""
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {limit}")
    if max_tokens is not None and max_tokens < 1:
        raise ConfigError(f"--max-tokens must be >= 1, got {max_tokens}")
    w1_file = workloads_dir() / "w1.jsonl"
    if name == "w1" and w1_file.is_file():
        trace, source = load_trace(w1_file), str(w1_file)
    elif name in GENERATORS and not Path(name).exists():
        trace, source = generate_trace(name, limit or DEFAULT_NUM_REQUESTS, seed), f"generated:{name}:{seed}"
    elif Path(name).is_file():
        trace, source = load_trace(name), str(Path(name))
    else:
        raise ConfigError(f"unknown workload {name!r}; give a trace file or one of {', '.join(GENERATORS)}")
    trace = trace[:limit] if limit else trace
    from kvserve.model.gguf_loader import resolve_model_path  # a text trace needs the model's tokenizer

    token_ids = encode_prompts(trace, resolve_model_path(model) if any(r.prompt_token_ids is None for r in trace)
                               else "none")
    caps = [max_tokens or r.max_tokens or DEFAULT_MAX_TOKENS for r in trace]
    return Workload(Path(name).stem if Path(name).is_file() else name, source, [r.id for r in trace], token_ids, caps,
                    Loops.of(trace) if has_loops(trace) else None)

