# kvpark producer image.
#
#   docker build -t kvpark:dev .                       # FROM python:3.11-slim
#   docker build --build-arg BASE_IMAGE=... -t kvpark:dev .
#
# Where Docker Hub is unreachable, .ci/ensure-base-image.sh builds a local stand-in tagged
# python:3.11-slim (Debian bookworm + python3.11 + venv, with `python` on PATH); this file works
# unchanged on both. Two stages: the build stage makes the venv at /opt/kvpark, the runtime
# stage copies only that venv, so no sources, build tools or pip caches stay in the image.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# Runtime dependencies first, read from pyproject.toml: this layer is reused until
# pyproject.toml changes, so a code-only change rebuilds in seconds without PyPI.
COPY pyproject.toml /src/pyproject.toml
RUN python -m venv /opt/kvpark \
 && python -m venv /opt/build \
 && python -c "import tomllib; p = tomllib.load(open('/src/pyproject.toml', 'rb')); print('\n'.join(p['project']['dependencies'])); open('/tmp/build-requirements.txt', 'w').write('\n'.join(p['build-system']['requires']) + '\n')" > /tmp/requirements.txt \
 && /opt/build/bin/pip install --no-cache-dir -r /tmp/build-requirements.txt \
 && /opt/kvpark/bin/pip install --no-cache-dir -r /tmp/requirements.txt \
 && /opt/kvpark/bin/pip uninstall --yes --quiet setuptools
# The project itself: a wheel built with the (cached) build venv, installed without deps.
COPY . /src
RUN /opt/build/bin/pip wheel --no-cache-dir --no-deps --no-build-isolation -w /tmp/wheels /src \
 && /opt/kvpark/bin/pip install --no-cache-dir --no-deps /tmp/wheels/*.whl \
 && /opt/kvpark/bin/python -c "import kvpark, kvpark.producer, kvpark.client, kvpark.pb" \
 && mkdir -p /src/examples /src/protos

FROM ${BASE_IMAGE}
# /run/kvpark: where the producer's shared-memory socket goes (shm_socket). Made here, owned
# by the kvpark user, because an empty named volume mounted over it (compose's `kvpark-shm`)
# takes the owner and mode of the image's folder: otherwise the volume is root's and the
# non-root producer cannot create its socket there. 0750: only the kvpark user and group pass.
RUN groupadd --gid 10001 kvpark \
 && useradd --uid 10001 --gid kvpark --no-log-init --home-dir /home/kvpark --create-home \
        --shell /usr/sbin/nologin kvpark \
 && install -d -o kvpark -g kvpark -m 0750 /run/kvpark
COPY --from=build /opt/kvpark /opt/kvpark
# Not installed as packages, shipped for reference: example clients and the proto contract
# (decode workers in other languages generate their stubs from it).
COPY --from=build /src/examples /opt/kvpark/share/examples
COPY --from=build /src/protos /opt/kvpark/share/protos
# MALLOC_*: glibc allocator thresholds, the biggest throughput lever for multi-MiB messages
# (see performance notes): no fresh mmap + page faults per message, no trimming churn; two
# arenas bound the heap each gRPC thread would otherwise keep at its peak.
ENV PATH=/opt/kvpark/bin:$PATH \
    VIRTUAL_ENV=/opt/kvpark \
    MALLOC_MMAP_THRESHOLD_=33554432 \
    MALLOC_TRIM_THRESHOLD_=2147483648 \
    MALLOC_ARENA_MAX=2 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
LABEL org.opencontainers.image.title="kvpark" \
      org.opencontainers.image.description="KV-cache handoff service: gRPC producer (kvpark-producer) and consumer client" \
      org.opencontainers.image.licenses="Apache-2.0"
USER kvpark
WORKDIR /home/kvpark
# 50051: gRPC (KVProducer, grpc.health.v1, reflection); 50052: the zero-copy TCP data port
# when data_listen is set (compose and Kubernetes use this one); 9400: Prometheus /metrics.
# 127.0.0.1:50053 (not exposed): the health port the image's health check dials.
EXPOSE 50051 50052 9400
# The producer's addresses are set in the environment, not on its command line: `docker run -e
# KVPARK_LISTEN=...` moves the producer, `-e KVPARK_METRICS_LISTEN=` turns metrics off, and the
# health check reads the same variables (it dials KVPARK_HEALTH_LISTEN, a port outside the
# gRPC port's connection cap, so a producer with every connection taken stays healthy). Flags
# would win over the environment and leave the probe behind.
ENV KVPARK_LISTEN=0.0.0.0:50051 \
    KVPARK_METRICS_LISTEN=0.0.0.0:9400 \
    KVPARK_HEALTH_LISTEN=127.0.0.1:50053
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-m", "kvpark.producer.healthcheck", "--timeout", "3"]
CMD ["kvpark-producer"]
