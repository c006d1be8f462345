# The tabloop image: every tabloop component (front door, streams worker, trainer, history sink, topic setup)
# runs from it as `tabloop <command>`. CUDA comes with the torch wheel from PyPI; the trainer uses the GPU
# the container is given (TABLOOP_DEVICE=cuda).
FROM python:3.12-slim

ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 TABLOOP_STATE_DIR=/var/lib/tabloop
WORKDIR /opt/tabloop

# Dependencies first: a code change does not reinstall torch.
COPY pyproject.toml README.md ./
RUN python -c "import tomllib; d = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(d['dependencies']))" > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt

COPY schemas ./schemas
COPY policy ./policy
COPY rewards ./rewards
COPY serving ./serving
COPY streams ./streams
COPY trainer ./trainer
COPY infra ./infra
COPY tabloop ./tabloop
RUN pip install --no-deps . && mkdir -p /var/lib/tabloop

VOLUME ["/var/lib/tabloop"]
EXPOSE 8081 8082
ENTRYPOINT ["tabloop"]
CMD ["--help"]
