"""Issue 17's must-show, end to end with real processes (docs/scale-out.md).

    python docs/scale_out_check.py route     # 3 instances, kv vs round-robin routers, 60 requests
                                             # of 6 personas; then one instance killed mid-load
    python docs/scale_out_check.py restart   # warm restart from the disk tier; a corrupted page

`route`: three `kvserve serve --kv-events-endpoint` instances; one `kvserve router --policy kv` and
one `--policy round-robin` over the same three. The trace (6 personas, each a different ~1,500-token
system prompt, 60 requests interleaved) runs through each router and against a single instance, each
pass with its own `cache_salt`, so every pass starts cold (each instance runs cores / 3 torch
threads, its share of the machine, as it would own a GPU): once closed loop (3 clients) and once open
loop (Poisson arrivals at `--rate` requests/s, default 1, which do not wait for answers). Prints
prefix hit rate and TTFT p50/p95 side by side and checks, on the open-loop passes: cluster hit rate
>= 0.9 x single's, kv TTFT p95 <= 0.5 x round-robin's. Then 12 requests go through the kv router
while one instance is killed: all must complete, and the router must report the dead instance with
no indexed pages.

`restart`: one instance with `--kv-disk-path`; a ~1,500-token prompt cold, the same after a restart
(TTFT <= 0.3 x cold, same text), and after a restart with one page file corrupted (same text; the log
names the corrupt page). Exit status 0 when every check holds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

WORDS = ("river stone ledger harbor copper signal meadow lantern archive orbit canyon quartz "
         "violet timber beacon summit glacier falcon prairie compass anchor cipher ember mosaic "
         "tundra willow zenith garnet meridian delta").split()
PERSONAS = ["a tax accountant", "a ship's navigator", "a pastry chef", "a museum archivist",
            "a network engineer", "a mountain guide"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def system_prompt(i: int, words: int = 1320) -> str:
    rng = random.Random(i)
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"You are {PERSONAS[i]}. Stay in character. Reference notes: {body}"


def trace(num_requests: int = 60) -> list[tuple[int, str]]:
    order = [i % len(PERSONAS) for i in range(num_requests)]
    random.Random(17).shuffle(order)
    return [(p, f"Question {n}: what would you check first today?") for n, p in enumerate(order)]


class Procs:
    def __init__(self, logdir: Path) -> None:
        self.logdir, self.procs = logdir, {}

    def start(self, name: str, args: list[str], threads: int | None = None) -> None:
        """`threads`: torch threads of a serving instance (OMP_NUM_THREADS)."""
        log = open(self.logdir / f"{name}.log", "a")
        env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
        self.procs[name] = subprocess.Popen([sys.executable, "-m", "kvserve.cli", *args],
                                            stdout=log, stderr=subprocess.STDOUT, env=env)

    def stop(self, name: str, sig: int = signal.SIGTERM) -> None:
        proc = self.procs.pop(name)
        proc.send_signal(sig)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()

    def stop_all(self) -> None:
        for name in list(self.procs):
            self.stop(name)

    def log(self, name: str) -> str:
        return (self.logdir / f"{name}.log").read_text()


def wait_healthy(url: str, procs: Procs, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dead = [n for n, p in procs.procs.items() if p.poll() is not None]
        if dead:
            raise SystemExit(f"{dead} exited:\n" + procs.log(dead[0])[-3000:])
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} did not come up")


async def chat(client: httpx.AsyncClient, url: str, system: str, question: str, salt: str,
               max_tokens: int = 8) -> dict:
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "cache_salt": salt,
            "stream_options": {"include_usage": True}}
    start, ttft, text, usage = time.perf_counter(), None, "", None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: {response.status_code} {await response.aread()}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                if choice["delta"].get("content") and ttft is None:
                    ttft = time.perf_counter() - start
                text += choice["delta"].get("content") or ""
            usage = chunk.get("usage") or usage
    return {"ttft": ttft if ttft is not None else time.perf_counter() - start, "text": text,
            "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


async def run_trace(url: str, salt: str, rate: float | None = None, concurrency: int = 3) -> dict:
    """The trace through `url`: closed loop (`concurrency` clients, each sending its next request
    when the last is answered) when `rate` is None, else open loop (Poisson arrivals at `rate`
    requests/s, as `vllm bench serve --request-rate` sends them: arrivals do not wait for answers)."""
    items = trace()
    results: list[dict] = []
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as client:
        if rate is None:
            queue: asyncio.Queue = asyncio.Queue()
            for item in items:
                queue.put_nowait(item)

            async def worker() -> None:
                while not queue.empty():
                    persona, question = queue.get_nowait()
                    results.append(await chat(client, url, system_prompt(persona), question, salt))

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        else:
            gaps = random.Random(60).expovariate
            start, at, tasks = time.perf_counter(), 0.0, []
            for persona, question in items:
                await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
                tasks.append(asyncio.create_task(chat(client, url, system_prompt(persona), question, salt)))
                at += gaps(rate)
            results = list(await asyncio.gather(*tasks))
    ttfts = sorted(r["ttft"] for r in results)
    return {"requests": len(results),
            "hit_rate": sum(r["cached_tokens"] for r in results) / sum(r["prompt_tokens"] for r in results),
            "ttft_p50": statistics.median(ttfts),
            "ttft_p95": ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))]}


async def warm_up(urls: list[str]) -> None:
    async with httpx.AsyncClient(timeout=600) as client:
        for url in urls:
            await chat(client, url, system_prompt(0), "Warm up.", "warm-up", max_tokens=2)


def check_route(args: argparse.Namespace, procs: Procs) -> bool:
    ports = [free_port() for _ in range(3)]
    instances = [f"http://127.0.0.1:{p}" for p in ports]
    # each instance gets its share of the cores, as each would get its own GPU: three instances
    # of all-core thread pools on a small machine would spend the time fighting over cores
    threads = max(1, len(os.sched_getaffinity(0)) // len(ports))
    for i, port in enumerate(ports):
        procs.start(f"serve{i}", ["serve", "--port", str(port), "--kv-events-endpoint",
                                  f"tcp://127.0.0.1:{free_port()}", *args.engine.split()], threads)
    for url in instances:
        wait_healthy(url, procs)
    routers = {}
    for policy in ("kv", "round-robin"):
        port = free_port()
        procs.start(f"router-{policy}", ["router", "--policy", policy, "--port", str(port),
                                         *sum((["--backend", u] for u in instances), [])])
        routers[policy] = f"http://127.0.0.1:{port}"
        wait_healthy(routers[policy], procs)
    time.sleep(2)  # the kv router has read the instances' event descriptions
    # every instance answers once before any pass is timed: a first request's one-time costs must
    # not land in whichever pass reaches an instance first (the single pass only reaches instance 0)
    asyncio.run(warm_up(instances))
    arrivals = {"closed": None, "open": args.rate}
    rows = {}
    for mode, rate in arrivals.items():
        rows[mode, "single"] = asyncio.run(run_trace(instances[0], f"{mode}-single", rate))
        for policy, url in routers.items():
            rows[mode, policy] = asyncio.run(run_trace(url, f"{mode}-{policy}", rate))
    print(f"{'arrivals':28} {'pass':12} {'hit rate':>9} {'TTFT p50':>9} {'TTFT p95':>9}")
    for (mode, name), r in rows.items():
        label = "closed loop, 3 clients" if mode == "closed" else f"open loop, Poisson {args.rate}/s"
        print(f"{label:28} {name:12} {r['hit_rate']:9.3f} {r['ttft_p50']:9.3f} {r['ttft_p95']:9.3f}")
    ok = {}
    for mode in arrivals:
        kv, rr, single = rows[mode, "kv"], rows[mode, "round-robin"], rows[mode, "single"]
        ok[mode] = (kv["hit_rate"] >= 0.9 * single["hit_rate"], kv["ttft_p95"] <= 0.5 * rr["ttft_p95"])
        print(f"{mode} loop: kv hit rate / single: {kv['hit_rate'] / single['hit_rate']:.3f} "
              f"(>= 0.9: {ok[mode][0]}); kv p95 / round-robin p95: "
              f"{kv['ttft_p95'] / rr['ttft_p95']:.3f} (<= 0.5: {ok[mode][1]})")
    hit_ok, ttft_ok = ok["open"]
    print(httpx.get(routers["kv"] + "/metrics").text)

    async def under_fire() -> list:
        async with httpx.AsyncClient(timeout=600) as client:
            tasks = [asyncio.create_task(chat(client, routers["kv"], system_prompt(i % 6),
                                              f"Kill test {i}", "pass-kill")) for i in range(12)]
            await asyncio.sleep(3)
            procs.stop("serve2", signal.SIGKILL)
            return await asyncio.gather(*tasks, return_exceptions=True)

    outcomes = asyncio.run(under_fire())
    failed = [o for o in outcomes if isinstance(o, BaseException)]
    state = {b["url"]: b for b in httpx.get(routers["kv"] + "/router/backends").json()}
    forgotten = not state[instances[2]]["healthy"] and state[instances[2]]["index_pages"] == 0
    print(f"killed one instance mid-load: {12 - len(failed)}/12 completed; dead instance "
          f"forgotten: {forgotten}; failures: {failed[:2]}")
    return hit_ok and ttft_ok and not failed and forgotten


def check_restart(args: argparse.Namespace, procs: Procs, workdir: Path) -> bool:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    disk = workdir / "kv-disk"
    serve = ["serve", "--port", str(port), "--kv-disk-path", str(disk), "--kv-disk-bytes", "4GiB",
             *args.engine.split()]
    system, question = system_prompt(0), "What would you check first today?"

    def one_run(name: str) -> dict:
        procs.start(name, serve)
        wait_healthy(url, procs)
        result = asyncio.run(_one(url, system, question))
        procs.stop(name)  # graceful: the disk writer flushes
        return result

    cold, warm = one_run("cold"), one_run("warm")
    files = sorted(disk.rglob("*.kvp"))
    if not files:
        print("no page files on disk after a run: is --kv-disk-path wired?")
        return False
    victim = files[len(files) // 2]
    raw = bytearray(victim.read_bytes())
    raw[-1] ^= 0xFF
    victim.write_bytes(bytes(raw))
    damaged = one_run("corrupt")
    detected = "corrupt disk page" in procs.log("corrupt")
    ratio = warm["ttft"] / cold["ttft"]
    print(f"prompt {cold['prompt_tokens']} tokens: TTFT cold {cold['ttft']:.3f} s, after restart "
          f"{warm['ttft']:.3f} s (x{ratio:.2f}, cached {warm['cached_tokens']}); corrupted page "
          f"detected: {detected}; texts equal: {cold['text'] == warm['text'] == damaged['text']}")
    return ratio <= 0.3 and detected and cold["text"] == warm["text"] == damaged["text"]


async def _one(url: str, system: str, question: str) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        return await chat(client, url, system, question, "restart", max_tokens=12)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("check", choices=["route", "restart"])
    parser.add_argument("--engine", default="--kv-cache-memory 1GiB --max-model-len 4096",
                        help="engine flags for every `kvserve serve`")
    parser.add_argument("--rate", type=float, default=1.0,
                        help="open-loop arrivals for the route check, requests/s (Poisson)")
    parser.add_argument("--keep-logs", action="store_true")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="kvserve-scale-"))
    procs = Procs(workdir)
    try:
        ok = check_route(args, procs) if args.check == "route" else check_restart(args, procs, workdir)
    finally:
        procs.stop_all()
        if not args.keep_logs:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"logs in {workdir}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
