"""Unfinished bodies cannot hold the server's memory (issue 44, must-show 6): one API key opens many
connections, each sending most of a 4 MB body that never finishes; a real `kvserve serve`'s RSS
grows by no more than the key's byte cap plus uvicorn's read window per connection, comes back near
where it was once they close, and another key is answered meanwhile."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from kvserve.server.inflight import InFlight, InFlightCaps

MiB = 1 << 20
NUM_CONNECTIONS = 100
DECLARED = 4_000_000  # under the default --max-request-bytes (4 MiB): only the in-flight caps stop it
SENT = 3_900_000  # ... and the body never finishes
PER_KEY_CAP = 16 * MiB
MAX_CONNECTIONS = 64
# uvicorn reads up to a 64 KiB window plus one 256 KiB socket read per connection before it pauses,
# h11 keeps its own buffer, and the interpreter's arenas round up
WINDOW_PER_CONNECTION = 640 << 10


def test_counters_refuse_past_each_cap_and_give_back():
    flight = InFlight(InFlightCaps(max_body_bytes=100, max_body_bytes_per_key=60, max_requests_per_key=2))
    assert flight.open("a") is None and flight.open("a") is None
    assert flight.open("a").code == "too_many_connections"
    assert flight.take("a", 60) is None
    assert "--max-body-bytes-per-key" in flight.take("a", 1).message
    assert flight.take("b", 40) is None
    assert "--max-body-bytes-in-flight" in flight.take("b", 1).message
    flight.give("a", 60)
    flight.close("a")
    assert flight.take("b", 20) is None and flight.open("a") is None
    assert flight.take(None, 41) is not None and flight.take(None, 40) is None  # no key: the global cap alone
    with pytest.raises(ValueError, match="--max-body-bytes-per-key"):
        InFlightCaps(max_body_bytes_per_key=1 * MiB).check(4 * MiB)


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


class Upload(threading.Thread):
    """A body that starts and never ends: SENT of DECLARED bytes, then the socket is held open."""

    def __init__(self, port: int, key: str, release: threading.Event, sent: int = SENT) -> None:
        super().__init__(daemon=True)
        self.port, self.key, self.release, self.sent = port, key, release, sent
        self.status: int | None = None
        self.answer = b""
        self.held = False  # still open, unanswered, when the client stopped reading (not reset, not closed)
        self.settled = threading.Event()  # answered, closed or held: nothing more will happen until `release`

    def run(self) -> None:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=60)
        try:
            sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {self.key}\r\n"
                          f"Content-Type: application/json\r\nContent-Length: {DECLARED}\r\n\r\n").encode())
            block = b"x" * min(64 << 10, self.sent)
            for _ in range(0, self.sent, len(block)):
                sock.sendall(block)
        except OSError:
            pass  # answered and closed mid-upload: expected for the refused ones
        try:
            sock.settimeout(1.0)
            while chunk := sock.recv(4096):  # a refusal closes the connection after its JSON
                self.answer += chunk
        except TimeoutError:
            self.held = not self.answer  # open and unanswered: the server holds it
        except OSError:
            pass  # reset by the server's close (the 429 may be lost with it on a busy host)
        if self.answer.startswith(b"HTTP/1.1 "):
            self.status = int(self.answer.split(b" ")[1])
        self.settled.set()
        self.release.wait(120)
        sock.close()


@pytest.mark.slow
def test_unfinished_bodies_of_one_key_hold_at_most_its_cap(tmp_path):
    from tests.redis_server import free_port
    from tests.server.test_router import ENGINE, start, stop, wait_healthy

    keys = tmp_path / "keys"
    keys.write_text("sk-tenant-a\nsk-tenant-b\n")
    port = free_port()
    url, log = f"http://127.0.0.1:{port}", tmp_path / "serve.log"
    proc = start(["serve", "--port", str(port), "--api-key-file", str(keys), *ENGINE,
                  "--max-body-bytes-per-key", str(PER_KEY_CAP), "--max-connections-per-key", str(MAX_CONNECTIONS)],
                 log)
    release = threading.Event()
    b = {"Authorization": "Bearer sk-tenant-b"}
    try:
        wait_healthy(url, [proc], [log])
        for _ in range(3):  # warm: the routes, the tokenizer, a step
            assert httpx.post(url + "/v1/completions", headers=b, timeout=120,
                              json={"prompt": "Hello", "max_tokens": 2}).status_code == 200
        time.sleep(1.5)
        before = rss(proc.pid)
        uploads = [Upload(port, "sk-tenant-a", release) for _ in range(NUM_CONNECTIONS)]
        for upload in uploads:
            upload.start()
        peak, deadline = before, time.monotonic() + 20
        while time.monotonic() < deadline and not all(u.settled.is_set() for u in uploads):
            peak = max(peak, rss(proc.pid))
            time.sleep(0.02)
        started = time.monotonic()
        answer = httpx.post(url + "/v1/completions", headers=b, timeout=60,
                            json={"prompt": "Hello", "max_tokens": 2})
        b_latency = time.monotonic() - started
        for _ in range(25):
            peak = max(peak, rss(proc.pid))
            time.sleep(0.02)
        statuses = [u.status for u in uploads]
        num_held = sum(u.held for u in uploads)
        release.set()
        for upload in uploads:
            upload.join(30)
        time.sleep(2.5)  # the trim runs at most once a second
        after = rss(proc.pid)
        refused = [u.answer for u in uploads if u.status == 429]
        print(f"RSS before {before / MiB:.0f} MiB, peak {peak / MiB:.0f} MiB (+{(peak - before) / MiB:.1f}), "
              f"after {after / MiB:.0f} MiB (+{(after - before) / MiB:.1f}); {len(refused)} of "
              f"{NUM_CONNECTIONS} got 429 ({sum(b'--max-body-bytes-per-key' in r for r in refused)} naming "
              f"the byte cap), {num_held} held; B's request {b_latency * 1000:.0f} ms")
        assert answer.status_code == 200, answer.text
        assert b_latency < 5.0
        assert any(b"--max-body-bytes-per-key" in r for r in refused)
        assert set(statuses) <= {None, 429}, statuses
        assert num_held <= PER_KEY_CAP // SENT
        allowance = 24 * MiB + MAX_CONNECTIONS * WINDOW_PER_CONNECTION
        assert peak - before < PER_KEY_CAP + allowance, (peak - before) / MiB
        assert after - before < 24 * MiB, (after - before) / MiB
        # connections that send a little and hang: past the key's cap, a 429 before any body is read
        release = threading.Event()
        small = [Upload(port, "sk-tenant-a", release, sent=1024) for _ in range(NUM_CONNECTIONS)]
        for upload in small:
            upload.start()
        deadline = time.monotonic() + 5
        for upload in small:  # the refused end; the held wait for `release`
            upload.settled.wait(max(0.0, deadline - time.monotonic()))
        statuses = [u.status for u in small]
        assert sum(u.held for u in small) == MAX_CONNECTIONS, statuses
        assert all(b"--max-connections-per-key" in u.answer for u in small if u.status == 429)
        assert httpx.post(url + "/v1/completions", headers=b, timeout=60,
                          json={"prompt": "Hello", "max_tokens": 2}).status_code == 200
        release.set()
    finally:
        release.set()
        stop([proc])
