"""What crosses processes: the one Django-free place where each side spells what the other reads.

The gateway, the management API and the Celery worker (Django) and the serving worker (no Django, no
database) import these modules alike, so each thing is written once and the two sides cannot drift:

- `serving.contracts.registry`: the registry ↔ worker wire (deploy events channel, snapshot entries),
  the workers' registration keys in Redis, and the connection constants both ends must agree on.
- `serving.contracts.names`: the qualified adapter name `<tenant>/<adapter>@<version>`, its one
  builder and its one parser.
- `serving.contracts.checkpoint_names`: the names of a fine-tuning job's models (its version, its
  kept checkpoints, whose label the workers load them under), built and parsed.
- `serving.contracts.artifact`: the adapter artifact's format (manifest, digests) that training and
  the registry write and the worker verifies.
- `serving.contracts.protocol` and `serving.contracts.request_caps`: the worker's request and
  response bodies (OpenAI's shape) and the request limits the gateway checks before it forwards one
  and the worker checks again.
- `serving.contracts.errors`: the domain errors every side raises (the one place they live) and the
  OpenAI error body with its one status → type table.
- `serving.contracts.request_ids`: the X-Request-ID both servers take or mint and pass on.
- `serving.contracts.usage_log`: the usage records' queue in Redis, which the gateway writes and the
  registry's flusher moves to the database.

The machinery every process runs on (settings, logs, blob storage, Redis guard, breakers) is not a
contract: it is the top-level package `runtime`. Nothing here imports Django, an app, runtime or the
other serving packages (an import-linter contract in pyproject.toml holds it); mypy checks the
package strictly. Import the submodule you need: this file re-exports nothing.
"""
