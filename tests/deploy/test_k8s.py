"""deploy/k8s: every manifest valid against the Kubernetes schemas, pods that meet the
restricted Pod Security profile, and commands, ports and probes that agree with the CLI."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.deploy.manifests import (
    DEPLOY,
    K8S,
    WORKLOAD_KINDS,
    container,
    container_env,
    expand_k8s_args,
    k8s_documents,
    k8s_find,
    load_yaml,
    parse_cli,
    pod_spec,
    redis_url_ca,
    redis_url_host_port,
)

try:
    import kubernetes_validate
except ImportError:  # fail each test that needs it, loudly
    kubernetes_validate = None

# The oldest Kubernetes the manifests are for (grpc probes, autoscaling/v2 and
# PodDisruptionBudget.unhealthyPodEvictionPolicy are all there by 1.29), and the newest the
# installed kubernetes-validate knows.
K8S_VERSIONS = ("1.29.0", "latest")
# Custom resources have no bundled schema; test_service_monitors checks them instead.
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}

DOCS = k8s_documents()
WORKLOADS = [d for _, d in DOCS if d["kind"] in WORKLOAD_KINDS]
SCHEMA_DOCS = [(p, d) for p, d in DOCS if (d["apiVersion"], d["kind"]) not in CRD_KINDS]


def _validator() -> Any:
    if kubernetes_validate is None:
        pytest.fail("kubernetes-validate is not installed (dev extras: `make install`)")
    return kubernetes_validate


def _version(version: str) -> str:
    return _validator().latest_version() if version == "latest" else version


def _workload_id(workload: dict[str, Any]) -> str:
    return f"{workload['kind']}/{workload['metadata']['name']}"


def _doc_id(item: tuple[Path, dict[str, Any]]) -> str:
    path, doc = item
    return f"{path.name}:{doc['kind']}/{doc['metadata']['name']}"


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("item", SCHEMA_DOCS, ids=_doc_id)
def test_manifest_validates_against_kubernetes_schema(
    item: tuple[Path, dict[str, Any]], version: str
) -> None:
    path, doc = item
    kv = _validator()
    try:
        kv.validate(doc, _version(version), strict=True)  # strict: unknown fields are errors
    except kv.ValidationError as e:
        location = ".".join(str(p) for p in e.path)
        pytest.fail(f"{path.name} {doc['kind']}/{doc['metadata']['name']}: {location}: {e.message}")
    except kv.SchemaNotFoundError as e:
        pytest.fail(f"{path.name}: {e.message}")


def test_the_validator_rejects_a_misspelt_field() -> None:
    """The check above is worth something: a typo inside a pod spec fails it."""
    kv = _validator()
    doc = k8s_find("Deployment", "scheduler")
    broken = {**doc, "spec": {**doc["spec"], "replica": 2}}
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, _version(K8S_VERSIONS[0]), strict=True)


def test_kustomization_lists_every_manifest() -> None:
    kustomization = load_yaml(K8S / "kustomization.yaml")
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files)
    assert kustomization["namespace"] == k8s_find("Namespace", "pagedserve")["metadata"]["name"]


def test_namespace_enforces_the_restricted_profile() -> None:
    labels = k8s_find("Namespace", "pagedserve")["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"


@pytest.mark.parametrize("workload", WORKLOADS, ids=_workload_id)
def test_pods_meet_the_restricted_profile(workload: dict[str, Any]) -> None:
    spec = pod_spec(workload)
    pod = spec["securityContext"]
    assert pod["runAsNonRoot"] is True
    assert pod.get("runAsUser", 1) != 0
    assert pod["seccompProfile"]["type"] == "RuntimeDefault"
    assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC"))
    assert not any("hostPath" in v for v in spec.get("volumes", []))
    for c in spec.get("initContainers", []) + spec["containers"]:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False, c["name"]
        assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
        assert set(sc["capabilities"].get("add", [])) <= {"NET_BIND_SERVICE"}, c["name"]
        assert not sc.get("privileged", False), c["name"]
        assert sc.get("runAsUser", 1) != 0, c["name"]


@pytest.mark.parametrize("workload", WORKLOADS, ids=_workload_id)
def test_containers_have_requests_limits_probes_and_pinned_images(
    workload: dict[str, Any],
) -> None:
    for c in pod_spec(workload)["containers"]:
        assert {"cpu", "memory"} <= set(c["resources"]["requests"]), c["name"]
        assert {"cpu", "memory"} <= set(c["resources"]["limits"]), c["name"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert probe in c, f"{c['name']} has no {probe}"
        tag = c["image"].rpartition(":")[2] if ":" in c["image"] else ""
        assert tag and tag != "latest", f"{c['name']}: image {c['image']!r} is not pinned"


def _executor() -> tuple[dict[str, Any], dict[str, Any], Any]:
    workload = k8s_find("Deployment", "executor")
    c = container(workload, "executor")
    env = container_env(workload, c)
    args = parse_cli(expand_k8s_args(c["args"], env), env)
    return workload, c, args


def _scheduler() -> tuple[dict[str, Any], dict[str, Any], Any]:
    workload = k8s_find("Deployment", "scheduler")
    c = container(workload, "scheduler")
    env = container_env(workload, c)
    args = parse_cli(expand_k8s_args(c["args"], env), env)
    return workload, c, args


def _ports(c: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in c["ports"]}


def test_executor_args_match_cli_ports_and_probes() -> None:
    workload, c, args = _executor()
    assert args.command == "executor"
    assert args.host == "0.0.0.0"
    assert _ports(c) == {"grpc": args.port, "metrics": args.metrics_port}
    # Addressed one by one: it registers its own pod IP, from the downward API.
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert args.advertise_address == f"10.1.2.3:{args.port}"  # the sample pod IP
    # Standard gRPC health over mutual TLS, with the pod's own certificate.
    probe = parse_cli(c["readinessProbe"]["exec"]["command"][1:], container_env(workload, c))
    assert (probe.command, probe.address, probe.serving) == (
        "probe",
        f"127.0.0.1:{args.port}",
        True,
    )
    assert (probe.tls_cert, probe.tls_key, probe.tls_ca) == (
        args.tls_cert,
        args.tls_key,
        args.tls_ca,
    )
    for probe in ("startupProbe", "livenessProbe"):
        assert c[probe]["tcpSocket"]["port"] == "grpc"
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "model loading"
    # SIGTERM: the drain, then the step in flight (executor_svc.server.SHUTDOWN_GRACE_S).
    assert pod_spec(workload)["terminationGracePeriodSeconds"] > args.drain_timeout_s + 60
    gpu = c["resources"]["limits"]["nvidia.com/gpu"]
    assert str(gpu) == "1" == str(c["resources"]["requests"]["nvidia.com/gpu"])


def test_scheduler_args_match_cli_ports_and_probes() -> None:
    _, c, args = _scheduler()
    _, _, executor = _executor()
    assert args.command == "scheduler"
    assert args.host == "0.0.0.0"
    assert _ports(c) == {"http": args.port, "grpc": args.grpc_port}
    assert not args.executors  # it finds the executors registered in the store
    assert (args.state_store, args.namespace) == (executor.state_store, executor.namespace)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "executors loading"


def test_api_keys_come_from_an_optional_secret_never_from_args() -> None:
    _, c, args = _scheduler()
    (var,) = [v for v in c["env"] if v["name"] == "PAGEDSERVE_API_KEY"]
    ref = var["valueFrom"]["secretKeyRef"]
    assert ref["optional"] is True  # no Secret: the API is open, as before
    assert args.api_keys == ["sample"]  # the Secret's sample, through the environment
    assert not any("API_KEY" in a or a.startswith("--api-key") for a in c["args"])


def _mounted_secret(workload: dict[str, Any], c: dict[str, Any], path: str) -> str:
    """The Secret mounted read-only at the folder of ``path``."""
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == str(Path(path).parent)]
    assert mount["readOnly"] is True
    (volume,) = [v for v in pod_spec(workload)["volumes"] if v["name"] == mount["name"]]
    return volume["secret"]["secretName"]


@pytest.mark.parametrize("name", ["executor", "scheduler"])
def test_services_use_mutual_tls_and_redis_credentials_from_secrets(name: str) -> None:
    workload, c, args = _executor() if name == "executor" else _scheduler()
    secrets = {_mounted_secret(workload, c, p) for p in (args.tls_cert, args.tls_key, args.tls_ca)}
    assert secrets == {f"pagedserve-{name}-tls"}
    # The Redis URL (with its password) only through the environment, from a Secret.
    (var,) = [v for v in c["env"] if v["name"] == "PAGEDSERVE_STATE_STORE"]
    assert var["valueFrom"]["secretKeyRef"] == {
        "name": "pagedserve-state-store",
        "key": "PAGEDSERVE_STATE_STORE",
    }
    assert not any(a.startswith("--state-store") or "://" in a for a in c["args"])
    assert urlsplit(args.state_store).scheme == "rediss"
    assert redis_url_ca(args.state_store) == args.tls_ca


def test_schedulers_check_executors_by_the_name_their_certificates_carry() -> None:
    _, _, args = _scheduler()
    service = k8s_find("Service", "executor")
    assert args.tls_server_name == service["metadata"]["name"]


@pytest.mark.parametrize("workload", WORKLOADS, ids=_workload_id)
def test_no_probe_is_a_plaintext_grpc_probe(workload: dict[str, Any]) -> None:
    """The kubelet's grpc probes speak no TLS: every gRPC port here wants a certificate."""
    for c in pod_spec(workload)["containers"]:
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert "grpc" not in c[probe], f"{c['name']}: {probe}"


def test_redis_speaks_only_tls_and_wants_the_acl() -> None:
    redis = k8s_find("StatefulSet", "redis")
    c = container(redis, "redis")

    def value(flag: str) -> str:
        return c["args"][c["args"].index(flag) + 1]

    assert value("--port") == "0" and value("--tls-port") == "6379"
    for flag in ("--tls-cert-file", "--tls-key-file", "--tls-ca-cert-file", "--aclfile"):
        assert _mounted_secret(redis, c, value(flag)) == "pagedserve-redis"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = c[probe]["exec"]["command"]
        assert "--tls" in command and command[command.index("--cacert") + 1] == value(
            "--tls-ca-cert-file"
        )


def test_state_store_is_the_redis_statefulset() -> None:
    _, _, args = _executor()
    host, port = redis_url_host_port(args.state_store)
    service = k8s_find("Service", host)
    assert [p["port"] for p in service["spec"]["ports"]] == [port]
    redis = k8s_find("StatefulSet", "redis")
    assert redis["spec"]["serviceName"] == host
    assert service["spec"]["selector"] == redis["spec"]["template"]["metadata"]["labels"]
    c = container(redis, "redis")
    assert c["args"][c["args"].index("--appendonly") + 1] == "yes"
    (claim,) = redis["spec"]["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == c["args"][c["args"].index("--dir") + 1]


def _selects(selector: dict[str, str], workload: dict[str, Any]) -> bool:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(k) == v for k, v in selector.items())


def test_executors_are_reached_only_through_a_headless_service() -> None:
    executor = k8s_find("Deployment", "executor")
    services = [
        d for _, d in DOCS if d["kind"] == "Service" and _selects(d["spec"]["selector"], executor)
    ]
    assert [s["metadata"]["name"] for s in services] == ["executor"]
    assert services[0]["spec"]["clusterIP"] == "None"


def test_each_deployment_has_an_autoscaler_and_a_disruption_budget() -> None:
    for name in ("executor", "scheduler"):
        hpa = k8s_find("HorizontalPodAutoscaler", name)
        assert hpa["spec"]["scaleTargetRef"] == {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": name,
        }
        pdb = k8s_find("PodDisruptionBudget", name)
        assert _selects(pdb["spec"]["selector"]["matchLabels"], k8s_find("Deployment", name))


def _adapter_metrics() -> tuple[set[str], set[str]]:
    """(Pods metrics, External metrics) that prometheus-adapter serves with our rules."""
    rules = load_yaml(DEPLOY / "prometheus" / "prometheus-adapter-values.yaml")["rules"]
    pods = {r["name"]["as"] for r in rules["custom"]}
    external = {r["seriesQuery"].split("{")[0] for r in rules["external"]}
    return pods, external


def test_autoscalers_scale_on_metrics_the_adapter_serves() -> None:
    pods, external = _adapter_metrics()
    executor = k8s_find("HorizontalPodAutoscaler", "executor")["spec"]["metrics"]
    assert {
        (
            m["external"]["metric"]["name"],
            tuple(m["external"]["metric"]["selector"]["matchLabels"].items()),
        )
        for m in executor
    } == {
        ("pagedserve_kv_cache_usage_ratio", (("device", "gpu"),)),
        ("pagedserve_num_requests", (("state", "waiting"),)),
    }
    assert {m["external"]["metric"]["name"] for m in executor} <= external
    scheduler = k8s_find("HorizontalPodAutoscaler", "scheduler")["spec"]["metrics"]
    by_type = {m["type"]: m for m in scheduler}
    assert by_type["Resource"]["resource"]["name"] == "cpu"
    assert by_type["Pods"]["pods"]["metric"]["name"] in pods


def _ingress_peers(policy: dict[str, Any], port: int) -> list[dict[str, Any]]:
    rules = policy["spec"].get("ingress", [])
    return [
        peer
        for rule in rules
        if not rule.get("ports") or port in [p["port"] for p in rule["ports"]]
        for peer in rule.get("from", [{"everyone": True}])
    ]


def _component(peer: dict[str, Any]) -> str:
    assert set(peer) == {"podSelector"}, f"not a pod of this namespace: {peer}"
    return peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"]


def test_network_policies_let_only_the_scheduler_reach_executors() -> None:
    policies = [d for _, d in DOCS if d["kind"] == "NetworkPolicy"]
    deny = [p for p in policies if p["spec"]["podSelector"] == {}]
    assert deny and set(deny[0]["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    assert "ingress" not in deny[0]["spec"]
    _, _, executor = _executor()
    executor_policy = k8s_find("NetworkPolicy", "executor")
    peers = _ingress_peers(executor_policy, executor.port)
    assert [_component(p) for p in peers] == ["scheduler"]
    redis_policy = k8s_find("NetworkPolicy", "redis")
    peers = _ingress_peers(redis_policy, 6379)
    assert sorted(_component(p) for p in peers) == ["executor", "scheduler"]
    # Executors may call Redis (registration) and DNS, nothing else.
    egress = executor_policy["spec"]["egress"]
    assert [_component(p) for rule in egress for p in rule.get("to", [])] == ["redis"]
    assert all(p["port"] in (53, 6379) for rule in egress for p in rule["ports"])


def test_service_monitors() -> None:
    """The custom resources: field names of the Prometheus Operator's CRD, checked by hand."""
    monitors = [d for _, d in DOCS if d["kind"] == "ServiceMonitor"]
    assert {m["metadata"]["name"] for m in monitors} == {"scheduler", "executor"}
    for monitor in monitors:
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert set(monitor["spec"]) == {"selector", "endpoints"}
        service = k8s_find("Service", monitor["metadata"]["name"])
        labels = service["metadata"]["labels"]
        selector = monitor["spec"]["selector"]["matchLabels"]
        assert all(labels.get(k) == v for k, v in selector.items())
        port_names = {p["name"] for p in service["spec"]["ports"]}
        for endpoint in monitor["spec"]["endpoints"]:
            assert set(endpoint) <= {"port", "path", "interval"}
            assert endpoint["port"] in port_names
            assert endpoint["path"] == "/metrics"
