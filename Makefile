# outbox-relay: the two quickstart commands are `make demo` and `make test`.
# Everything installs into ./.venv from PyPI; nothing else is needed but Python >= 3.11
# and a Redis (the demo starts its own redis-server if none answers and the binary exists).

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: install demo check test test-cluster lint typecheck unit integration acceptance bench bench-quick torture torture-short soak soak-quick clean

# `make install` says what it does; pip prints one line per package (no progress bars in CI,
# CI=true, where they would fill the log), so a first install of ~30 s is never silent.
PIP_PROGRESS := $(if $(CI),--progress-bar off,)

# constraints.txt pins every package of the dev install to versions known to pass `make test`
# (a new redis-py or mypy release can turn a green tree red overnight: redis-py 8.2 typed its
# Sentinel class). Refresh it deliberately: pip install -U …, make test, pip freeze.
$(STAMP): pyproject.toml constraints.txt
	@echo "==> creating the virtualenv $(VENV) with $(PYTHON)"
	$(PYTHON) -m venv $(VENV)
	@echo "==> upgrading pip in $(VENV)"
	$(BIN)/python -m pip install --quiet --upgrade pip
	@echo "==> installing outbox-relay with its extras (dev,postgres,sqlite-async,http,otel) into $(VENV); about 30 s the first time"
	$(BIN)/python -m pip install $(PIP_PROGRESS) -c constraints.txt -e '.[dev,postgres,sqlite-async,http,otel]'
	touch $(STAMP)
	@echo "==> installed: run $(BIN)/outbox --help, or 'source $(BIN)/activate' first for plain 'outbox'"

install: $(STAMP)

demo: install
	$(BIN)/outbox demo

lint: install
	$(BIN)/ruff check .

typecheck: install
	$(BIN)/mypy

# The developer's quick loop (about 3 minutes on 2 cores): lint, types, the unit tests and the
# integration tests on SQLite. Left to `make test`, which runs everything: the PostgreSQL half
# (marker postgresql), the acceptance tests, torture, soak, bench and failover runs and the
# Redis Cluster/Sentinel sets (torture), and fixed-length tests of many seconds (slow).
check: lint typecheck
	$(BIN)/pytest tests/unit tests/integration -m "not postgresql and not torture and not slow"

test: lint typecheck
	sh scripts/install-browser.sh  # Chromium for the console's browser test; never fails
	$(BIN)/pytest
	$(MAKE) test-cluster

# The integration suite again, against a local 3-master Redis Cluster (torture/with_cluster.py).
test-cluster: install
	$(BIN)/python -m torture.with_cluster $(BIN)/pytest -q tests/integration \
		-k "not sentinel and not cluster"

unit: install
	$(BIN)/pytest tests/unit

integration: install
	$(BIN)/pytest tests/integration

acceptance: install
	$(BIN)/pytest tests/acceptance

bench: install
	$(BIN)/python -m bench

bench-quick: install
	$(BIN)/python -m bench --quick

# Crash-safety proof: >= 1000 kills per database plus broker and database faults, with stream
# trimming and pruning running (aggressive retention; --no-retention turns it off), consumers
# and workers paused past their lease, the handlers' downstream down for 150 s and a chained
# hop (a handler publishes, a second group applies); the report is printed and written to
# torture/out/report.json.
# Then failovers (torture/brokers.py): a 3-master Redis Cluster with WAIT (nothing marked may be
# missing from a promoted replica) and without (repair puts back what it lacked), and a Sentinel
# set without WAIT; each report in torture/out/.
torture: install
	$(BIN)/python -m torture --database both --run-worker --kills 1000 --duration 120 \
		--outage-s 150
	$(BIN)/python -m torture --database both --redis cluster --wait-replicas 1 --kills 150 \
		--duration 120 --out torture/out/cluster-wait.json
	$(BIN)/python -m torture --database both --redis cluster --kills 150 --duration 120 \
		--out torture/out/cluster.json
	$(BIN)/python -m torture --database both --redis sentinel --kills 150 --duration 120 \
		--out torture/out/sentinel.json

torture-short: install
	$(BIN)/python -m torture --quick --database both --run-worker

# Bounded growth: a steady 1,000 events/s for 30 minutes, retention of minutes, no faults; table
# sizes and stream lengths sampled every 30 s must stay flat (torture/out/soak.json).
soak: install
	$(BIN)/python -m torture --soak --database postgresql --duration 1800 --rate 1000

soak-quick: install
	$(BIN)/python -m torture --soak --quick --database both

clean:
	rm -rf $(VENV) .outbox-demo .pytest_cache .mypy_cache .ruff_cache .hypothesis
