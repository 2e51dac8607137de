# The two commands: `make up` runs the platform on its embedded defaults, `make test` runs every test
# (every tier; `make test-fast` the in-process tests that are not slow, docs/testing.md).
# Both set themselves up on a fresh machine: virtualenv, packages, database, models.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Re-installs only when pyproject.toml changed since the last install.
STAMP := $(VENV)/.installed-stamp

.PHONY: install test test-fast up migrate lint-imports typecheck vendor-static screenshots

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# The settings file (docs/operations.md, "Settings"): the first `make up` or `make migrate` writes
# .env from .env.example in development mode (DJANGO_DEBUG unset means production, which refuses the
# development secret key; text log lines for a terminal; the embedded Redis kept in var/), so
# manage.py, Celery and a serving worker started by hand read the settings `make up` runs on. The
# secret key is left out (the development default applies under debug; docker compose, which reads
# .env too, uses its own). An existing .env is left as it is; the environment's values win over it.
.env:
	sed -e 's/^DJANGO_DEBUG=false$$/DJANGO_DEBUG=true/' -e 's/^LOG_FORMAT=json$$/LOG_FORMAT=text/' \
		-e 's/^# LORAPLEX_EMBEDDED_REDIS_PERSIST=true$$/LORAPLEX_EMBEDDED_REDIS_PERSIST=true/' \
		-e 's/^DJANGO_SECRET_KEY=/# DJANGO_SECRET_KEY=/' .env.example > $@
	@echo "Wrote .env (development mode; every setting is in it): edit it to change them."

migrate: install | .env
	$(PY) manage.py migrate --noinput

lint-imports: install
	$(VENV)/bin/lint-imports

# mypy over the files listed in pyproject.toml ([tool.mypy]): strict on kernels/ and serving/engine/.
# The Django plugin imports the settings, which start an embedded Redis when REDIS_URL is unset, and
# mypy leaves by os._exit (no atexit stop): a URL it never connects to keeps it from leaking a server.
# DJANGO_DEBUG=true: outside it the settings refuse the development secret key.
typecheck: install
	DJANGO_DEBUG=true REDIS_URL=redis://mypy-never-connects.invalid:6379/0 $(VENV)/bin/mypy

# The suite on four pytest-xdist workers on the 2-core machine (faster than two: it waits on the
# processes it starts as much as it computes), each file whole on one worker; each worker has its own
# test database, Redis database and temporary directory (docs/testing.md). PYTEST_WORKERS=0: one process.
PYTEST_WORKERS ?= 4

# Bytecode is written even where the environment says not to (PYTHONDONTWRITEBYTECODE, as many
# images set): otherwise every xdist worker rewrites every test module's asserts again and every
# web process, serving worker and Celery worker the suite starts compiles the project
# again. The files go to __pycache__/, which git ignores.
# --durations=30: every run (CI's included) prints its slowest set-ups and tests, where the time goes.
test: lint-imports typecheck
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile --durations=30 $(PYTEST_ARGS)

# The fast tier: every test but those marked e2e (they start real processes: web processes, serving
# and Celery workers, Redis servers) or slow (in-process, but seconds of compute each: training an
# adapter, Triton's interpreter, thousands of property examples), on the same workers; what a developer
# runs between edits. No mypy (make typecheck): it is the slow part of a small change's check.
test-fast: lint-imports
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile -m "not e2e and not slow" --durations=30 $(PYTEST_ARGS)

# exec: the launcher replaces the recipe's shell, so the SIGTERM make passes on to its recipe reaches
# it, and it stops if make is killed outright (lora_platform.launcher). make passes no SIGINT on:
# Ctrl-C (the whole foreground group) or SIGTERM stops the platform, `kill -INT <make's pid>` does not.
up: migrate
	exec $(PY) -m lora_platform.launcher

# Refreshes the dashboard's vendored htmx and uPlot (pinned in the script) from the npm registry.
vendor-static:
	scripts/vendor_static.sh

# Regenerates docs/screenshots/ from the dashboard's browser journey (needs /usr/bin/chromium).
screenshots: install
	LORAPLEX_SCREENSHOTS=docs/screenshots $(PY) -m pytest tests/dashboard/test_browser.py -q
