"""The environment every test process starts from, and every process a test starts inherits.

A pytest plugin (`-p tests.suite_env` in pyproject's addopts), loaded before pytest-django imports
the settings, which read the environment once (runtime.settings):

- development mode, as `make up` runs: DJANGO_DEBUG=true, and a secret key of the suite's own, so
  a web process a test starts with DJANGO_DEBUG=0 (production's mode) is not refused for the
  development key;
- no `.env`: a developer's file must not change what a run tests (the tests of `.env` itself
  name their own file in LORAPLEX_ENV_FILE);
- the tiny random demo model (LORAPLEX_DEMO_MODEL=tiny): a launcher a test starts builds it
  offline in a second, where the default demo model is a 93 MB download (lora_platform.demo_model);
- one OpenMP thread a process (OMP_NUM_THREADS=1): four xdist workers and the processes they start
  share two cores, and torch's default of a thread per core has every one of them spinning on the
  others' cores (a whole run: 398 s of pytest against 420 s, both on the quiet 2-core machine);

Set only where unset, so a run can still choose otherwise.
"""

from __future__ import annotations

import os

SUITE_SECRET_KEY = "loraplex-test-suite-secret-key-not-for-deployments"

os.environ.setdefault("DJANGO_DEBUG", "true")
os.environ.setdefault("DJANGO_SECRET_KEY", SUITE_SECRET_KEY)
os.environ.setdefault("LORAPLEX_ENV_FILE", "")
os.environ.setdefault("LORAPLEX_DEMO_MODEL", "tiny")
os.environ.setdefault("OMP_NUM_THREADS", "1")
