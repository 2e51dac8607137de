"""What every process runs on, Django-free: the web process, the Celery workers and the serving worker
import these alike, so each thing is written once.

- `runtime.settings` (and `runtime.env`, the typed environment readers the gateway's policies use): the
  platform's typed settings, the environment and `.env`.
- `runtime.logs`: every process's one logging setup (text or JSON lines); `runtime.access_log`: both
  servers' one access line per request, with the X-Request-ID (serving.contracts.request_ids).
- `runtime.storage` and `runtime.s3`: the blob storage (a local directory or S3) the platform and the
  worker both read, with one file layout and one S3 download path.
- `runtime.redis_guard` and `runtime.breakers`: Redis calls bounded in time, and the circuit breakers
  the gateway and the worker's slot guard share through Redis.
- `runtime.http_guard`: both servers' HTTP/1.1 connection guard (uvicorn's h11 protocol, bounded).
- `runtime.hub`: the base model fetched from the Hugging Face Hub.

It is not a contract (serving.contracts is: what one process sends and another reads); it is the
machinery under every process. It imports nothing of the project but serving.contracts, and no Django
(import-linter contracts in pyproject.toml); mypy checks it strictly. Import the submodule you need.
"""
