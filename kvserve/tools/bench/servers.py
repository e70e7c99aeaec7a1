"""Servers the HTTP bench drives: `kvserve serve` (this tree, as a subprocess) and llama.cpp's
`llama-server` (a benchmark peer from ../shared/peers/llama.cpp, never a dependency), each on a free
loopback port, ready once `/health` answers 200. Peak RSS comes from the process's VmHWM."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

SERVED_MODEL_NAME = "bench"


def llama_server_path(explicit: str | None = None) -> Path:
    """--llama-server, else $KVSERVE_LLAMA_SERVER, else ../shared/peers/llama.cpp/llama-server."""
    default = Path(__file__).resolve().parents[4] / "shared" / "peers" / "llama.cpp" / "llama-server"
    return Path(explicit or os.environ.get("KVSERVE_LLAMA_SERVER", default))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    """A server subprocess on 127.0.0.1:port; its output goes to a log file shown when it fails."""

    name: str
    argv: list[str]
    port: int
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen | None = None
    log_path: Path | None = None
    load_s: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def base_env(self) -> dict[str, str]:
        """kvserve's environment for kvserve; a peer's without the OpenMP settings kvserve made."""
        from kvserve import peer_environment

        return dict(os.environ) if self.name == "kvserve" else peer_environment()

    def start(self, timeout_s: float = 300.0) -> ServerProcess:
        import httpx

        fd, log = tempfile.mkstemp(prefix=f"kvserve-bench-{self.name}-", suffix=".log")
        self.log_path = Path(log)
        start = time.monotonic()
        with os.fdopen(fd, "wb") as out:
            self.process = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env={**self.base_env(), **self.env})
        while time.monotonic() - start < timeout_s:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with status {self.process.returncode} while starting:\n"
                                   f"{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    self.load_s = time.monotonic() - start
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"{self.name} did not answer /health within {timeout_s:.0f} s:\n{self.log_tail()}")

    def peak_rss_bytes(self) -> int | None:
        """VmHWM of the server process (its peak resident set so far)."""
        try:
            for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except (OSError, AttributeError, ValueError):
            pass
        return None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except (OSError, AttributeError):
            return ""

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        if self.log_path is not None:
            self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def kvserve_server(model_path: str, engine_kwargs: dict) -> ServerProcess:
    """`python -m kvserve.cli serve` with the bench's engine flags (`--threads` among them)."""
    from kvserve.engine_args import engine_argv

    port = free_port()
    argv = [sys.executable, "-m", "kvserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--model", model_path, "--served-model-name", SERVED_MODEL_NAME, "--log-level", "warning",
            *engine_argv(engine_kwargs)]
    return ServerProcess("kvserve", argv, port, {})


def llama_server(binary: Path, model_path: str, parallel: int, context_tokens: int,
                 threads: int) -> ServerProcess:
    """llama-server with `parallel` slots sharing `context_tokens` of context (each slot gets
    context_tokens / parallel), prompt caching per slot as it does by default."""
    port = free_port()
    argv = [str(binary), "-m", model_path, "--host", "127.0.0.1", "--port", str(port), "-c", str(context_tokens),
            "--parallel", str(parallel), "-t", str(threads), "-tb", str(threads), "--alias", SERVED_MODEL_NAME]
    return ServerProcess("llama-server", argv, port)
