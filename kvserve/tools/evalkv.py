"""`kvserve eval-kv`: what a quantized KV cache (or a weight mode, `--dtype`) does to the model's
predictions, measured on a public-domain text shipped with the package (kvserve/data/corpus.txt:
Jane Austen, *Persuasion*, 1818).

For each context length C, the first C corpus tokens (from --offset) run through the float32 model
with a full-precision (fp32) KV cache, and the model then generates 128 tokens greedily (decode
steps). Then, for each weight mode and KV dtype, the same C + 128 tokens run teacher-forced through
that model and cache (in prefill chunks, as the engine computes them: K/V are quantized on write and
every later query reads them back dequantized), and the next-token distributions are compared:

    perplexity   exp(mean NLL of the C - 1 corpus next tokens), and its drift from fp32 in %
    mean KL      mean over those positions of KL(p_fp32 || p_dtype), in nats
    agreement    share of the 128 fp32 greedy tokens that are still the argmax with this cache
    tokens       how many tokens --kv-cache-memory holds with this dtype (the engine's arithmetic)

The one tool that imports torch (lazily, inside functions): it has to run the model.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kvserve.config import (CORPUS_PATH, KV_DTYPES, MODEL_DTYPES, ConfigError, kv_bytes_per_page, parse_bytes,
                            pool_tokens_for, resolve_kv_dtype, resolve_model_dtype)
from kvserve.tools.planner import parse_tokens

REFERENCE = "fp32"
REFERENCE_DTYPE = "float32"
DEFAULT_DTYPES = "fp8_e4m3,fp8_e5m2,int8,int4"
DEFAULT_CONTEXTS = "512,2048"
LOGIT_BLOCK = 256  # rows of [vocab] logits materialized at once


@dataclass(slots=True)
class EvalRow:
    context: int
    kv_dtype: str
    dtype: str  # the weight mode
    perplexity: float
    ppl_drift_pct: float
    mean_kl: float
    greedy_agreement: float  # share of the greedy tokens, 0..1
    greedy_tokens: int
    pool_tokens: int  # tokens --kv-cache-memory holds with this dtype
    pool_tokens_vs_fp16: float
    seconds: float


def add_evalkv_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="a .gguf path (default: bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--kv-cache-dtype", default=None,
                        help=f"comma list of {', '.join(KV_DTYPES)}, auto (each weight mode's own) or all "
                             f"(default {DEFAULT_DTYPES} with --dtype float32, else auto); float32 weights "
                             f"with an {REFERENCE} cache are always run as the reference")
    parser.add_argument("--dtype", default=REFERENCE_DTYPE,
                        help=f"comma list of weight modes ({', '.join(MODEL_DTYPES)}, auto) or all "
                             f"(default {REFERENCE_DTYPE})")
    parser.add_argument("--context", default=DEFAULT_CONTEXTS,
                        help=f"comma list of context lengths in tokens, e.g. 512,2048,8k (default {DEFAULT_CONTEXTS})")
    parser.add_argument("--greedy-tokens", type=int, default=128, help="greedy tokens compared (default 128)")
    parser.add_argument("--kv-cache-memory", default="1GiB",
                        help="memory budget for the tokens-that-fit column (default 1GiB)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    parser.add_argument("--offset", type=int, default=0, help="first corpus token of each window (default 0)")
    parser.add_argument("--corpus", default=None, help="a UTF-8 text file (default: the bundled corpus)")
    parser.add_argument("--fp8-scale", default="1.0",
                        help="fp8 per-tensor scale: a number (default 1.0, the engine's) or 'calibrate' "
                             "(amax of the fp32 cache of the same window / fp8 max)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def _names(value: str, modes: str = REFERENCE_DTYPE) -> list[tuple[str, str]]:
    """(weight mode, KV dtype) variants to run, the float32 + fp32 reference first."""
    mode_list = list(MODEL_DTYPES) if modes.strip() == "all" else [m.strip() for m in modes.split(",") if m.strip()]
    mode_list = [resolve_model_dtype(m, "cpu") for m in mode_list]
    names = list(KV_DTYPES) if value.strip() == "all" else [n.strip() for n in value.split(",") if n.strip()]
    for name in names:
        if name != "auto" and name not in KV_DTYPES:
            raise ConfigError(f"unknown --kv-cache-dtype {name!r}; choose from auto, {', '.join(KV_DTYPES)} or all")
    variants = [(m, resolve_kv_dtype(n, m).name) for m in mode_list for n in names]
    reference = (REFERENCE_DTYPE, REFERENCE)
    return [reference] + [v for v in dict.fromkeys(variants) if v != reference]


def _contexts(value: str) -> list[int]:
    contexts = [parse_tokens(v) for v in value.split(",") if v.strip()]
    if not contexts or min(contexts) < 2:
        raise ConfigError(f"--context needs context lengths of at least 2 tokens, got {value!r}")
    return contexts


# -- the model side (torch) ------------------------------------------------------------------------

def _greedy(runner, prompt: list[int], num_tokens: int):
    """Greedy continuation with the runner's cache: prefill, then one decode step per token.
    Returns (the tokens, hidden states [len(prompt) + num_tokens - 1, hidden] of every position
    but the last generated one)."""
    import torch

    hidden = [runner.forward_sequence(prompt)]
    out: list[int] = []
    while num_tokens:
        out.append(int(runner.model.compute_logits(hidden[-1][-1:]).argmax(-1)))
        if len(out) == num_tokens:
            break
        hidden.append(runner.forward_sequence(out[-1:], start=len(prompt) + len(out) - 1))
    return out, torch.cat(hidden)


def _log_probs(model, hidden):
    """Next-token log-probabilities [T, vocab] of final hidden states [T, hidden], in blocks."""
    import torch
    import torch.nn.functional as F

    with torch.inference_mode():
        return torch.cat([F.log_softmax(model.compute_logits(hidden[s:s + LOGIT_BLOCK]), dim=-1)
                          for s in range(0, hidden.shape[0], LOGIT_BLOCK)])


def _compare(model, ref_logp, hidden, targets: list[int], num_scored: int) -> tuple[float, float, int]:
    """Over positions t predicting targets[t]: (mean NLL and mean KL(ref || this) over the first
    num_scored positions, number of later positions whose argmax is the target)."""
    import torch
    import torch.nn.functional as F

    target = torch.tensor(targets, dtype=torch.int64)
    nll = kl = 0.0
    agree = 0
    with torch.inference_mode():
        for s in range(0, len(targets), LOGIT_BLOCK):
            e = min(s + LOGIT_BLOCK, len(targets))
            logp = F.log_softmax(model.compute_logits(hidden[s:e]), dim=-1)  # [n, vocab]
            ref = ref_logp[s:e]
            scored = max(0, min(e, num_scored) - s)
            t = target[s:e]
            nll -= float(logp[:scored].gather(1, t[:scored, None]).sum())
            kl += float((ref[:scored].exp() * (ref[:scored] - logp[:scored])).sum())
            agree += int((logp[scored:].argmax(-1) == t[scored:]).sum())
    return nll / num_scored, kl / num_scored, agree


def evaluate(loaded, token_ids: list[int], contexts: list[int], dtypes: list[tuple[str, str]], greedy_tokens: int,
             page_size: int, memory: int, fp8_scale: str = "1.0", offset: int = 0,
             progress=None) -> list[EvalRow]:
    from kvserve.model.kv_quant import codec_for, fp8_scale_for
    from kvserve.model.runner import ModelRunner

    cfg = loaded.config
    page_bytes = {n: kv_bytes_per_page(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, page_size, KV_DTYPES[n])
                  for n in KV_DTYPES}
    fp16_tokens = pool_tokens_for(memory, page_bytes["fp16"], page_size)
    rows: list[EvalRow] = []
    for context in contexts:
        if offset + context > len(token_ids):
            raise ConfigError(f"--context {context} from --offset {offset} needs {offset + context} corpus "
                              f"tokens; the corpus has {len(token_ids)}")
        window = token_ids[offset:offset + context]
        total = context + greedy_tokens
        t0 = time.monotonic()
        num_pages = -(-total // page_size) + 1
        ref_runner = ModelRunner(loaded, num_pages, page_size, KV_DTYPES[REFERENCE], dtype=REFERENCE_DTYPE)
        generated, ref_hidden = _greedy(ref_runner, window, greedy_tokens)
        amax = ref_runner.kv_amax(context)
        sequence = window + generated
        targets = sequence[1:]
        ref_logp = _log_probs(ref_runner.model, ref_hidden[:len(targets)])  # [total - 1, vocab]
        for variant in dtypes:
            mode, name = variant
            started = time.monotonic()
            scale = 1.0
            if name.startswith("fp8") and fp8_scale == "calibrate":
                scale = fp8_scale_for(amax, codec_for(name).storage_dtype)
            elif name.startswith("fp8"):
                scale = float(fp8_scale)
            if variant == (REFERENCE_DTYPE, REFERENCE):  # the greedy run above: prefill, then decode steps
                runner, hidden = ref_runner, ref_hidden
            else:  # teacher-forced through this weight mode and cache
                runner = ModelRunner(loaded, num_pages, page_size, KV_DTYPES[name], dtype=mode, fp8_scale=scale)
                hidden = runner.forward_sequence(sequence)[:-1]
            nll, kl, agree = _compare(runner.model, ref_logp, hidden, targets, context - 1)
            pool = pool_tokens_for(memory, page_bytes[name], page_size)
            rows.append(EvalRow(
                context=context, kv_dtype=name, dtype=mode, perplexity=math.exp(nll), ppl_drift_pct=0.0,
                mean_kl=max(kl, 0.0), greedy_agreement=agree / greedy_tokens if greedy_tokens else 1.0,
                greedy_tokens=greedy_tokens, pool_tokens=pool,
                pool_tokens_vs_fp16=pool / fp16_tokens if fp16_tokens else 0.0,
                seconds=round(time.monotonic() - (t0 if variant == dtypes[0] else started), 2)))
            base = rows[-1 - dtypes.index(variant)].perplexity  # this context's reference row
            rows[-1].ppl_drift_pct = 100.0 * (rows[-1].perplexity - base) / base
            if progress:
                progress(rows[-1])
    return rows


# -- the command -------------------------------------------------------------------------------------

def run_evalkv(args: argparse.Namespace, progress=None) -> dict:
    from kvserve.model.gguf_loader import load_gguf, resolve_model_path

    kv_names = args.kv_cache_dtype or (DEFAULT_DTYPES if args.dtype == REFERENCE_DTYPE else "auto")
    dtypes, contexts = _names(kv_names, args.dtype), _contexts(args.context)
    if args.fp8_scale != "calibrate":
        try:
            if not float(args.fp8_scale) > 0:
                raise ValueError
        except ValueError:
            raise ConfigError(f"--fp8-scale must be a positive number or 'calibrate', got {args.fp8_scale!r}") from None
    if args.greedy_tokens < 0:
        raise ConfigError(f"--greedy-tokens must be >= 0, got {args.greedy_tokens}")
    corpus = Path(args.corpus) if args.corpus else CORPUS_PATH
    try:
        text = corpus.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read --corpus {corpus}: {exc.strerror}") from None
    loaded = load_gguf(resolve_model_path(args.model))
    token_ids = loaded.tokenizer.encode(text, add_special_tokens=False).ids
    memory = parse_bytes(args.kv_cache_memory)
    started = time.monotonic()
    rows = evaluate(loaded, token_ids, contexts, dtypes, args.greedy_tokens, args.page_size, memory,
                    args.fp8_scale, args.offset, progress)
    return {
        "model": loaded.config.name, "corpus": str(corpus), "corpus_tokens": len(token_ids),
        "offset": args.offset, "reference": REFERENCE, "reference_dtype": REFERENCE_DTYPE, "fp8_scale": args.fp8_scale,
        "page_size": args.page_size, "kv_cache_memory_bytes": memory,
        "seconds": round(time.monotonic() - started, 1), "results": [asdict(r) for r in rows],
    }


def render_evalkv(report: dict) -> str:
    lines = [f"KV cache quantization drift: {report['model']}, {report['corpus_tokens']:,} corpus tokens "
             f"from {Path(report['corpus']).name}, fp8 scale {report['fp8_scale']}, page size "
             f"{report['page_size']}",
             f"{'context':>7}  {'weights':<8} {'kv dtype':<9} {'perplexity':>10} {'drift':>8} {'mean KL':>9} "
             f"{'greedy agree':>12} {'tokens in ' + _gib(report['kv_cache_memory_bytes']):>16} {'vs fp16':>7}"]
    for r in report["results"]:
        is_ref = r["kv_dtype"] == report["reference"] and r.get("dtype", REFERENCE_DTYPE) == REFERENCE_DTYPE
        drift = "ref" if is_ref else f"{r['ppl_drift_pct']:+.2f}%"
        agree = f"{round(r['greedy_agreement'] * r['greedy_tokens'])}/{r['greedy_tokens']}"
        lines.append(f"{r['context']:>7}  {r.get('dtype', REFERENCE_DTYPE):<8} {r['kv_dtype']:<9} {r['perplexity']:>10.3f} {drift:>8} "
                     f"{r['mean_kl']:>9.5f} {agree:>12} {r['pool_tokens']:>16,} {r['pool_tokens_vs_fp16']:>6.2f}x")
    lines.append(f"({report['seconds']} s)")
    return "\n".join(lines)


def _gib(num: int) -> str:
    return f"{num / 1024**3:g} GiB" if num >= 1024**3 else f"{num / 1024**2:g} MiB"


def main_evalkv(args: argparse.Namespace) -> int:
    import sys

    progress = None if args.json else (
        lambda r: print(f"  {r.context} tokens, {r.dtype} + {r.kv_dtype}: ppl {r.perplexity:.3f} ({r.seconds} s)",
                        file=sys.stderr, flush=True))
    report = run_evalkv(args, progress)
    print(json.dumps(report, indent=2) if args.json else render_evalkv(report))
    return 0
