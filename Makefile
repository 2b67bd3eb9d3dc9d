# Orchestrator Console. `make demo` runs the console; `make test` runs the whole suite.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=
DRILL_ARGS ?=
SCALE_ARGS ?=

.PHONY: setup demo test migrate bench clean scale drill

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

setup: $(BIN)/.installed

migrate: setup
	$(BIN)/python manage.py migrate --noinput

demo: migrate
	$(BIN)/python manage.py collectstatic --noinput --verbosity 0
	$(BIN)/python manage.py seed_demo > /dev/null
	@echo ""
	@echo "  Orchestrator Console: http://$(HOST):$(PORT)/admin/"
	@echo "  Log in as operator / operator (DEMO_USERNAME / DEMO_PASSWORD to change)."
	@echo "  Ctrl-C stops it."
	@echo ""
	$(BIN)/python manage.py run_console --demo --host $(HOST) --port $(PORT)

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# Two qclusters and two daphnes on PostgreSQL + Redis (DATABASE_URL, REDIS_URL); Ctrl-C stops all.
scale: setup
	$(BIN)/python -m deploy.scale_out $(SCALE_ARGS)

# Reliability drills on a scratch database (DRILL_DATABASE_URL, DRILL_REDIS_URL, DRILL_PG_CLUSTER);
# DRILL_ARGS=--quick is the bounded form CI runs.
drill: setup
	$(BIN)/python -m deploy.drill $(DRILL_ARGS)

clean:
	rm -rf $(VENV) var .pytest_cache .hypothesis
