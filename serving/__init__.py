"""Serving adapters, in four packages with one job each (README, "Layout"):

- `serving.registry`: the adapter registry, a Django app (label `serving`): versions, canary,
  rollback, audit, uploads, usage records.
- `serving.gateway`: the OpenAI-compatible gateway, Django only at its edge.
- `serving.engine`: the serving worker, no Django.
- `serving.contracts`: what crosses processes, imported by all three and importing none of them.

The gateway imports the registry (at its Django edge) and the contracts; the registry imports the
contracts, and the engine's adapter reader to check an upload; the engine imports only the
contracts and `runtime` (settings, logs, storage: the top-level package every process runs on).
Nothing here imports `training`; the contracts import none of the others (import-linter contracts
in pyproject.toml, tests/test_import_graph.py).
"""
