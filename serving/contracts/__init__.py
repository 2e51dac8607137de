"""What crosses processes: the one Django-free place the web side and the serving worker both spell it.

The gateway, the management API and the Celery worker (Django) and the serving worker (no Django, no
database) import these modules alike, so each thing is written once and the two sides cannot drift:

- `serving.wire.registry`: the registry ↔ worker wire (deploy events channel, snapshot entries),
  the workers' registration keys in Redis, and the connection constants both ends must agree on.
- `serving.wire.names`: the qualified adapter name `<tenant>/<adapter>@<version>`, its one builder
  and its one parser.
- `serving.wire.errors`: the OpenAI error body and its one status → type table.
- `serving.wire.storage`: the blob storage (a local directory or S3) both the platform and the
  worker read, with one file layout and one S3 download path.
- `serving.wire.settings`: the platform's typed settings (the environment and `.env`), read by
  every process; `serving.wire.logs`: every process's one logging setup (text or JSON lines);
  `serving.wire.request_ids` and `serving.wire.access_log`: the X-Request-ID both servers take or
  mint, pass on and log, and their one access line per request.

Nothing here imports Django, DRF, Celery or a Django app (an import-linter contract in
pyproject.toml holds it); mypy checks the package strictly. Import the submodule you need: this
file re-exports nothing.
"""
