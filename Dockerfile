# One image for every role of a `peer` swarm (bootstrap, stage peer, full replica); see docker-compose.yml.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PEER_CACHE_DIR=/cache

WORKDIR /app

# The CPU build of torch first, from the PyTorch CPU index: `pip install .` then finds torch
# satisfied and pulls no CUDA wheels. (For a GPU image, install the CUDA build here instead.)
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

COPY pyproject.toml README.md ./
COPY protos ./protos
COPY peer ./peer
RUN pip install . && peer --version && peer --help > /dev/null

# libp2p (DHT) and gRPC ports used by docker-compose.yml; any port works with --port/--dht-port/--grpc-port.
# 9100: Prometheus metrics of `peer join --metrics-port 9100`.
EXPOSE 31337 31338 9100
CMD ["peer", "--help"]
