# digen: one image for every service of docker-compose.yml: the Dask scheduler, the controller
# (digen serve) and the rollout/trainer workers (digen worker).
#
#   docker build -t digen .                                       # CUDA torch (GPU hosts)
#   docker build -t digen --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .   # laptop
#
# Models are mounted at /models (never downloaded), run directories at /app/runs; the
# quickstart's digits model and classifier ship in /app/assets.
FROM python:3.11-slim

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu124
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    DIGEN_HOME=/app/.digen

RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
# torch first, from the index that matches the hardware (its own layer: it rarely changes)
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch>=2.4"

COPY pyproject.toml setup.py README* ./
COPY digen digen
COPY workers workers
COPY cli cli
# editable: cli/ and workers/ install as digen.cli and digen.workers (setup.py, docs/install.md);
# digen finds its assets (the quickstart's model and reward classifier) next to its source.
# bokeh: the Dask dashboard (scheduler service, port 8787)
RUN pip install -e . "bokeh>=3.1" && python -c "import digen.cli.main, digen.workers"
COPY configs configs
COPY assets assets

# /certs: where the compose file's one-shot `certs` service writes the cluster's CA and node
# files (a named volume takes this folder's owner, so every service, as digen, reads its own)
RUN useradd --create-home --uid 1000 digen \
    && mkdir -p /app/runs /app/.digen /models /certs \
    && chown -R digen /app/runs /app/.digen /certs \
    && chmod 0700 /certs
USER digen

# 8786: Dask scheduler, 8787: its dashboard
EXPOSE 8786 8787
CMD ["digen", "--help"]
