"""docker-compose.yml's web service runs several web processes (docs/benchmarks.md, "Web processes
on a GPU host"), with what several need: WEB_CONCURRENCY, which uvicorn starts that many processes
from and the gateway reads as the count sharing a tier's rate during a Redis outage, and a
prometheus_client multiprocess directory that is empty at every start (a tmpfs). No Docker here:
the file is read as Compose reads it."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from serving.gateway.config import GatewayConfig

SERVICES = yaml.safe_load((Path(__file__).resolve().parents[2] / "docker-compose.yml").read_text())["services"]


def test_the_web_service_runs_several_processes_sharing_their_metrics_in_a_directory_fresh_at_each_start():
    web = SERVICES["web"]
    default = re.fullmatch(r"\$\{WEB_CONCURRENCY:-(\d+)\}", web["environment"]["WEB_CONCURRENCY"])
    assert default is not None and int(default.group(1)) > 1
    assert "--workers" not in web["command"], "the count is WEB_CONCURRENCY's alone, which the gateway reads too"
    assert GatewayConfig.from_environ({"WEB_CONCURRENCY": default.group(1)}).processes == int(default.group(1))
    assert web["environment"]["PROMETHEUS_MULTIPROC_DIR"] in web["tmpfs"]
    # The shared settings still reach it (the service's environment extends the app's).
    assert {"DATABASE_URL", "REDIS_URL", "MAX_LORA_RANK"} <= set(web["environment"])


def test_no_other_service_is_told_to_run_several_processes_or_to_write_multiprocess_metrics():
    # uvicorn.Config reads WEB_CONCURRENCY wherever uvicorn runs (the serving worker too).
    for name, service in SERVICES.items():
        if name != "web":
            assert not {"WEB_CONCURRENCY", "PROMETHEUS_MULTIPROC_DIR"} & set(service.get("environment") or {}), name
