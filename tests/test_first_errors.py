"""Mistakes a new user makes in the first hour end as one line on stderr and a non-zero exit, before
the heavy work (the model load, the KV pool): a port in use, more KV memory than the machine has, a
device torch lacks, a truncated or foreign file, a mistyped flag."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from kvserve.cli import main
from kvserve.model.gguf_loader import bundled_model_path
from kvserve.startup_checks import machine_memory_bytes


def one_line(text: str) -> str:
    text = text.strip()
    assert text and "\n" not in text, text
    return text


def test_port_in_use_fails_in_under_two_seconds_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        result = subprocess.run([sys.executable, "-m", "kvserve.cli", "serve", "--port", str(port)],
                                capture_output=True, text=True, timeout=60)
        elapsed = time.monotonic() - start
    assert result.returncode == 2
    assert f"port {port} on 127.0.0.1 is in use" in one_line(result.stderr)
    assert elapsed < 2.0, f"{elapsed:.2f} s"


def test_kv_cache_memory_over_the_machines_memory_names_both_numbers(capsys):
    machine = machine_memory_bytes()
    asked_gib = machine // 2**30 * 2 + 2
    assert main(["generate", "hi", "--kv-cache-memory", f"{asked_gib}GiB"]) == 2
    err = one_line(capsys.readouterr().err)
    assert f"--kv-cache-memory {asked_gib} GiB is more than this machine's" in err
    assert "GiB of memory" in err


def test_device_cuda_without_cuda_is_one_line(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this torch has a GPU: --device cuda is valid here")
    assert main(["generate", "hi", "--device", "cuda"]) == 2
    assert "--device cuda" in one_line(capsys.readouterr().err)
    assert main(["generate", "hi", "--device", "abacus"]) == 2
    assert "not a device torch knows" in one_line(capsys.readouterr().err)


@pytest.mark.parametrize("keep_bytes, expected", [
    (3_000_000, "truncated at byte 3,000,000 of {size:,}"),  # the tensor data cut short
    (5_000, "truncated at byte 5,000, inside the header"),
])
def test_truncated_gguf_says_where(tmp_path, capsys, keep_bytes, expected):
    source = bundled_model_path()
    cut = tmp_path / "cut.gguf"
    with open(source, "rb") as f:
        cut.write_bytes(f.read(keep_bytes))
    assert main(["generate", "hi", "--model", str(cut)]) == 2
    assert expected.format(size=os.path.getsize(source)) in one_line(capsys.readouterr().err)


def test_a_file_that_is_not_gguf_says_so(tmp_path, capsys):
    fake = tmp_path / "model.gguf"
    fake.write_text("<html>404 Not Found</html>")
    assert main(["generate", "hi", "--model", str(fake)]) == 2
    assert "not a GGUF file" in one_line(capsys.readouterr().err)


@pytest.mark.parametrize("argv", [["serve", "--port", "abc"], ["generate"], ["generate", "hi", "--nope"],
                                  ["no-such-command"]])
def test_argparse_errors_are_one_line_with_a_pointer_to_help(capsys, argv):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = one_line(capsys.readouterr().err)
    assert err.startswith("kvserve") and "error:" in err and "--help)" in err


def test_version_is_the_installed_packages():
    from importlib.metadata import version

    result = subprocess.run([sys.executable, "-m", "kvserve.cli", "--version"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0
    assert result.stdout.strip() == f"kvserve {version('kvserve')}"
