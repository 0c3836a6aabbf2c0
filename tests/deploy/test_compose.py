"""docker-compose.yml: valid against the Compose Specification, commands the CLI accepts,
ports and names that agree with each other, health checks and start order."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.deploy.manifests import (
    COMPOSE_FILE,
    DEPLOY,
    ROOT,
    SAMPLE_STATE_STORE,
    compose_config,
    compose_errors,
    compose_mounts,
    compose_published_ports,
    host_port,
    interpolate,
    load_yaml,
    parse_cli,
    redis_url_ca,
    redis_url_host_port,
)

SERVICES = {"redis", "executor", "scheduler", "prometheus", "grafana"}
REDIS_ENV = "deploy/secrets/redis.env"  # scripts/make_certs.sh writes it


def compose_env(service: dict[str, Any]) -> dict[str, str]:
    """A service's environment: its env_file, which can only be the one
    scripts/make_certs.sh writes (its sample here), then ``environment``."""
    env = {}
    files = service.get("env_file", [])
    for path in [files] if isinstance(files, str) else files:
        assert path == REDIS_ENV, f"an env_file make_certs.sh does not write: {path}"
        env["PAGEDSERVE_STATE_STORE"] = SAMPLE_STATE_STORE
    return env | {key: str(value) for key, value in service.get("environment", {}).items()}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return compose_config()


def test_compose_file_validates() -> None:
    assert compose_errors(interpolate(load_yaml(COMPOSE_FILE), env={})) == []


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (["servces"], {}),
        (["services", "redis", "helthcheck"], {"test": ["CMD", "true"]}),
        (["services", "redis", "command"], 42),
        (["services", "scheduler", "ports"], "127.0.0.1:8000:8000"),
        (["services", "executor", "depends_on", "redis", "condition"], "service_up"),
        (["services", "executor", "depends_on", "cache"], {"condition": "service_healthy"}),
        (["services", "redis", "volumes"], ["redis-dat:/data"]),
    ],
    ids=[
        "unknown-top-level-key",
        "unknown-service-key",
        "command-not-a-list-or-string",
        "ports-not-a-list",
        "unknown-start-condition",
        "depends-on-undefined-service",
        "undefined-volume",
    ],
)
def test_a_broken_compose_file_is_refused(path: list[str], value: Any) -> None:
    document = copy.deepcopy(compose_config())
    parent = document
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    assert compose_errors(document), f"{'.'.join(path)} = {value!r} was accepted"


def test_interpolation_reads_as_compose_does() -> None:
    env = {"SET": "x", "EMPTY": ""}
    assert interpolate({"a": ["${SET}", "$SET/$$SET"]}, env) == {"a": ["x", "x/$SET"]}
    assert interpolate("${EMPTY:-d} ${EMPTY-d} ${UNSET-d}", env) == "d  d"
    assert interpolate("${SET:+alt} ${EMPTY:+alt} ${EMPTY+alt}", env) == "alt  alt"
    for unset in ("${UNSET}", "$UNSET", "${EMPTY:?needs EMPTY}", "${UNSET?needs UNSET}"):
        with pytest.raises(ValueError):
            interpolate(unset, env)


def test_services_have_health_checks_and_start_in_order(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == SERVICES
    for name, service in services.items():
        assert "test" in service.get("healthcheck", {}), f"{name} has no health check"
    healthy = {"condition": "service_healthy"}
    assert services["executor"]["depends_on"] == {"redis": healthy}
    assert services["scheduler"]["depends_on"] == {"redis": healthy, "executor": healthy}
    assert services["grafana"]["depends_on"] == {"prometheus": healthy}


def test_redis_persists_append_only_on_a_volume(compose: dict[str, Any]) -> None:
    redis = compose["services"]["redis"]
    command = redis["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert compose_mounts(redis)["/data"] == "redis-data"
    assert "redis-data" in compose["volumes"]


def test_images_are_pinned(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        image = service["image"]
        tag = image.rpartition(":")[2] if ":" in image.split("/")[-1] else ""
        assert tag and tag != "latest", f"{name}: image {image!r} has no pinned tag"
        if "build" in service:
            assert (ROOT / service["build"]["dockerfile"]).is_file()


def test_executor_command_matches_cli(compose: dict[str, Any]) -> None:
    executor = compose["services"]["executor"]
    args = parse_cli(executor["command"], compose_env(executor))
    assert args.command == "executor"
    assert args.host == "0.0.0.0"
    assert {str(args.port), str(args.metrics_port)} <= set(map(str, executor["expose"]))
    assert redis_url_host_port(args.state_store) == ("redis", 6379)
    # The health check: `pagedserve probe` on the port the executor listens on, over TLS
    # with the container's own certificate (it reads the same PAGEDSERVE_TLS_* variables).
    test = executor["healthcheck"]["test"]
    assert test[0] == "CMD"
    probe = parse_cli(test[2:], compose_env(executor))
    assert probe.command == "probe" and probe.address == f"127.0.0.1:{args.port}"
    assert (probe.tls_cert, probe.tls_key, probe.tls_ca) == (
        args.tls_cert,
        args.tls_key,
        args.tls_ca,
    )


def test_scheduler_command_matches_cli(compose: dict[str, Any]) -> None:
    services = compose["services"]
    scheduler = parse_cli(services["scheduler"]["command"], compose_env(services["scheduler"]))
    executor = parse_cli(services["executor"]["command"], compose_env(services["executor"]))
    assert scheduler.command == "scheduler"
    assert scheduler.host == "0.0.0.0"
    assert scheduler.state_store == executor.state_store
    assert scheduler.namespace == executor.namespace
    # No --executor: the scheduler dials the executors registered in the store, each at the
    # container address it registered.
    assert not scheduler.executors
    assert not executor.advertise_address
    assert scheduler.tokenizer == "/opt/pagedserve/tokenizer"  # baked into the image
    published = compose_published_ports(services["scheduler"])
    assert {scheduler.port, scheduler.grpc_port} <= published
    health = " ".join(services["scheduler"]["healthcheck"]["test"])
    assert f"http://127.0.0.1:{scheduler.port}/health" in health


def test_prometheus_scrapes_the_ports_the_services_serve_metrics_on(
    compose: dict[str, Any],
) -> None:
    services = compose["services"]
    scheduler = parse_cli(services["scheduler"]["command"], compose_env(services["scheduler"]))
    executor = parse_cli(services["executor"]["command"], compose_env(services["executor"]))
    config = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    targets = {
        (sd["names"][0], sd["port"], job.get("metrics_path", "/metrics"))
        for job in config["scrape_configs"]
        for sd in job["dns_sd_configs"]
    }
    assert targets == {
        ("scheduler", scheduler.port, "/metrics"),
        ("executor", executor.metrics_port, "/metrics"),
    }
    mounts = compose_mounts(services["prometheus"])
    assert mounts["/etc/prometheus/prometheus.yml"] == str(DEPLOY / "prometheus" / "prometheus.yml")


def test_grafana_mounts_its_provisioning_and_dashboards(compose: dict[str, Any]) -> None:
    mounts = compose_mounts(compose["services"]["grafana"])
    assert mounts["/etc/grafana/provisioning"] == str(DEPLOY / "grafana" / "provisioning")
    provider = load_yaml(DEPLOY / "grafana" / "provisioning" / "dashboards" / "pagedserve.yml")
    (dashboards,) = provider["providers"]
    path = dashboards["options"]["path"]
    assert mounts[path] == str(DEPLOY / "grafana" / "dashboards")
    datasources = load_yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml")
    (prometheus,) = datasources["datasources"]
    assert host_port(prometheus["url"].removeprefix("http://")) == ("prometheus", 9090)


@pytest.mark.parametrize("name", ["executor", "scheduler"])
def test_services_dial_each_other_and_redis_over_tls_with_mounted_secrets(
    compose: dict[str, Any], name: str
) -> None:
    service = compose["services"][name]
    args = parse_cli(service["command"], compose_env(service))
    mounts = compose_mounts(service)
    own = str(DEPLOY / "secrets" / name)  # its own certificate, from scripts/make_certs.sh
    for path in (args.tls_cert, args.tls_key, args.tls_ca):
        assert path and mounts[str(Path(path).parent)] == own, path
    assert redis_url_ca(args.state_store) == args.tls_ca
    assert urlsplit(args.state_store).scheme == "rediss"
    # Nothing secret on the command line, where `ps` shows it; only the env_file has it.
    assert not any("://" in token or "PASSWORD" in token.upper() for token in service["command"])
    assert "PAGEDSERVE_STATE_STORE" not in service["environment"]
    assert service["env_file"] == REDIS_ENV


def test_redis_speaks_only_tls_and_wants_the_acl(compose: dict[str, Any]) -> None:
    redis = compose["services"]["redis"]
    command, mounts = redis["command"], compose_mounts(redis)

    def value(flag: str) -> str:
        return command[command.index(flag) + 1]

    assert value("--port") == "0" and value("--tls-port") == "6379"
    for flag in ("--tls-cert-file", "--tls-key-file", "--tls-ca-cert-file", "--aclfile"):
        assert mounts[str(Path(value(flag)).parent)] == str(DEPLOY / "secrets" / "redis")
    health = redis["healthcheck"]["test"]
    assert health[health.index("--cacert") + 1] == value("--tls-ca-cert-file")
