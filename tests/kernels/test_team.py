"""The kernels' thread team (src/team.h): the decode rows' shares and stolen chunks, more threads than
cores (so threads are descheduled mid-call and others take their chunks), two callers at once, and a
forked child all give the bits one thread gives."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from kvserve import kernels
from kvserve.kernels import matmul as km

from tests.kernels.test_matmul import random_weight


@pytest.fixture(scope="module")
def lib():
    kl = kernels.library()
    if kl is None:
        pytest.skip("native kernels not built")
    return kl


def _problem(qtype: Q = Q.Q4_K, n: int = 4100, k: int = 1024):
    """n rows past a multiple of 8 (a tail group), several chunks a share at any thread count"""
    w = torch.from_numpy(random_weight(qtype, n, k, seed=5))
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(2))
    return qtype, w, k, x


def _run(lib, problem, rows: int, threads: int) -> bytes:
    qtype, w, k, x = problem
    return km.matmul(lib, qtype, w, k, x[:rows], num_threads=threads).numpy().tobytes()


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q4_K, Q.Q6_K, Q.Q8_0], ids=lambda q: q.name)
def test_decode_rows_give_one_threads_bits_at_any_thread_count(lib, qtype):
    problem = _problem(qtype)
    for rows in (1, 3):
        alone = _run(lib, problem, rows, 1)
        for threads in (2, 3, 5, 8):  # past the cores: threads lose their core mid-call, others steal
            assert _run(lib, problem, rows, threads) == alone, (rows, threads)


def test_two_callers_at_once_get_their_own_bits(lib):
    problem = _problem()
    expected = {rows: _run(lib, problem, rows, 1) for rows in (1, 2, 3)}
    failures: list[str] = []

    def caller(rows: int) -> None:
        for _ in range(40):
            if _run(lib, problem, rows, 2) != expected[rows]:
                failures.append(f"rows {rows}")

    threads = [threading.Thread(target=caller, args=(rows,)) for rows in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a caller never returned"
    assert failures == []


def _child(conn, problem) -> None:
    conn.send(_run(kernels.library(), problem, 1, 2))


def test_a_forked_child_runs_the_team_without_its_parents_workers(lib):
    problem = _problem()
    expected = _run(lib, problem, 1, 2)  # the parent's team exists before the fork
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(child, problem))
    proc.start()
    try:
        assert parent.poll(60), "the forked child hung in its first parallel call"
        assert parent.recv() == expected
    finally:
        proc.kill()
        proc.join(10)


def test_no_spin_gives_the_same_bits(lib):
    """KVSERVE_TEAM_SPIN_US=0: the workers sleep after every call (read once, at the team's start)"""
    code = ("import sys, torch; from tests.kernels.test_team import _problem, _run; from kvserve import kernels; "
            "sys.stdout.buffer.write(_run(kernels.library(), _problem(), 1, 2))")
    env = {**os.environ, "KVSERVE_TEAM_SPIN_US": "0"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert done.returncode == 0, done.stderr.decode()[-500:]
    assert done.stdout == _run(lib, _problem(), 1, 1)
    assert np.frombuffer(done.stdout, dtype=np.float32).size == 4100
