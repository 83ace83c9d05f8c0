"""The Helm chart, checked with real tools and offline: Helm's own linter and renderer (through
helm-python-sdk, which links Helm's Go SDK), kubernetes-validate's OpenAPI schemas and yamllint.
"""

from __future__ import annotations

from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version
from sglang_d3d.server.args import parse_args
from sglang_d3d.server.http_layer import ConnectionLimits
from yamllint import linter
from yamllint.config import YamlLintConfig

from sglang_d3d.config import EngineConfig, SpecConfig

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "sglang-d3d"
EXAMPLES = {p.stem: p for p in sorted((ROOT / "deploy" / "helm" / "examples").glob("*.yaml"))}
DASHBOARD = ROOT / "deploy" / "grafana" / "sglang-d3d.json"
YAMLLINT = (ROOT / "deploy" / ".yamllint.yaml").read_text()
# The oldest Kubernetes the chart declares (Chart.yaml kubeVersion) and the newest schemas
# kubernetes-validate ships.
KUBE_VERSIONS = ("1.29.0", latest_version())
# Custom resources have no schema in kubernetes-validate: each is listed here and checked by
# hand in its own test instead of passing silently.
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"),
             ("monitoring.coreos.com/v1", "PrometheusRule")}
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yaml"
CASES = {"defaults": None, **EXAMPLES}

helm.disable_logging()  # Helm logs an INFO line for the dashboard symlink on every load


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART) as c:
        yield c


def values_of(case: str) -> dict:
    path = CASES[case]
    return yaml.safe_load(path.read_text()) if path else {}


def render(chart, values: dict) -> dict[str, str]:
    """Template path -> rendered text, NOTES.txt and templates disabled by values left out."""
    out = chart.render(values, name="d3d", namespace="llm", is_install=True)
    return {k: v for k, v in out.items() if v.strip() and not k.endswith("NOTES.txt")}


def manifests(chart, values: dict) -> list[dict]:
    docs = []
    for text in render(chart, values).values():
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def one(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def server_container(docs: list[dict]) -> dict:
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == "server")


def yamllint_problems(text: str, rendered: bool) -> list[str]:
    conf = YAMLLINT
    if rendered:  # the dashboard ConfigMap embeds JSON with PromQL lines longer than any limit
        conf += "  line-length: disable\n"
    problems = linter.run(text, YamlLintConfig(conf))
    return [f"{p.line}:{p.column} {p.rule}: {p.desc}" for p in problems]


@pytest.mark.parametrize("case", list(CASES))
def test_lint_strict(case):
    report = helm.lint(CHART, values_of(case), strict=True, kube_version=f"v{KUBE_VERSIONS[-1]}")
    bad = [m for m in report["messages"] if m["severity"] >= 2]  # 2 warning, 3 error
    assert report["total_charts_linted"] == 1
    assert not bad and not report["errors"], bad or report["errors"]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kube", KUBE_VERSIONS)
def test_manifests_match_kubernetes_schemas(chart, case, kube):
    docs = manifests(chart, values_of(case))
    validated = set()
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CRD_KINDS:
            continue
        kubernetes_validate.validate(doc, kube, strict=True)  # raises on any error
        validated.add(doc["kind"])
    assert {"Deployment", "Service", "ServiceAccount"} <= validated


@pytest.mark.parametrize("case", list(CASES))
def test_yamllint_values_and_rendered_output(chart, case):
    if CASES[case]:
        assert yamllint_problems(CASES[case].read_text(), rendered=False) == []
    for path, text in render(chart, values_of(case)).items():
        assert yamllint_problems(text, rendered=True) == [], path


def test_yamllint_chart_defaults():
    assert yamllint_problems((CHART / "values.yaml").read_text(), rendered=False) == []
    assert yamllint_problems((CHART / "Chart.yaml").read_text(), rendered=False) == []


def gpu_resources(container: dict) -> tuple[object, object]:
    res = container.get("resources", {})
    return (
        res.get("limits", {}).get("nvidia.com/gpu"),
        res.get("requests", {}).get("nvidia.com/gpu"),
    )


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_cpu_profile_requests_no_gpu(chart):
    for case in ("defaults", "values-cpu"):
        c = server_container(manifests(chart, values_of(case)))
        assert gpu_resources(c) == (None, None)
        assert flag(c["args"], "--device") == "cpu"
        assert flag(c["args"], "--draft-device") is None
    c = server_container(manifests(chart, values_of("values-cpu")))
    assert flag(c["args"], "--draft-weights") == "int8"
    assert parse_args(c["args"][1:]).engine.draft_weights == "int8"
    defaults = server_container(manifests(chart, None))
    assert flag(defaults["args"], "--draft-weights") is None  # the server's own default
    assert flag(defaults["args"], "--tree-nodes") is None
    assert flag(defaults["args"], "--lookup-tokens") is None


@pytest.mark.parametrize("nodes", [0, 5])
def test_tree_nodes_reach_the_server(chart, nodes):
    c = server_container(manifests(chart, {"server": {"treeNodes": nodes, "lookupTokens": nodes}}))
    assert flag(c["args"], "--tree-nodes") == str(nodes)
    assert flag(c["args"], "--lookup-tokens") == str(nodes)
    engine = parse_args(c["args"][1:]).engine
    assert engine.tree_nodes == engine.lookup_tokens == nodes


def test_connection_defaults_are_the_servers(chart):
    """The chart passes the connection flags and the queue length always; its defaults are the
    server's own, so a release that sets none of them serves as `d3d serve` alone would."""
    server = chart.merge_values({})["server"]
    limits = ConnectionLimits()
    assert server["headerTimeout"] == limits.header_timeout
    assert server["keepAliveTimeout"] == limits.keep_alive_timeout
    assert server["maxConnections"] == limits.max_connections
    assert server["maxQueue"] == EngineConfig.max_queue


@pytest.mark.parametrize(
    "key, value, flag_name, read",
    [
        ("headerTimeout", 2.5, "--header-timeout", lambda cfg: cfg.connections.header_timeout),
        ("headerTimeout", 45, "--header-timeout", lambda cfg: cfg.connections.header_timeout),
        ("keepAliveTimeout", 75, "--keep-alive-timeout",
         lambda cfg: cfg.connections.keep_alive_timeout),
        ("keepAliveTimeout", 0.5, "--keep-alive-timeout",
         lambda cfg: cfg.connections.keep_alive_timeout),
        ("maxConnections", 4096, "--max-connections", lambda cfg: cfg.connections.max_connections),
        ("maxConnections", 10_000_000, "--max-connections",
         lambda cfg: cfg.connections.max_connections),
        ("maxQueue", 0, "--max-queue", lambda cfg: cfg.engine.max_queue),
        ("maxQueue", 64, "--max-queue", lambda cfg: cfg.engine.max_queue),
    ],
)
def test_connection_values_reach_the_server(chart, key, value, flag_name, read):
    c = server_container(manifests(chart, {"server": {key: value}}))
    assert c["args"].count(flag_name) == 1
    assert float(flag(c["args"], flag_name)) == value
    assert read(parse_args(c["args"][1:])) == value


def test_connection_cap_leaves_the_probes_room(chart):
    """Every running and waiting request holds a connection: the cap must exceed their sum by
    the probes' and the scrapers' 4, exactly."""
    for case in CASES:
        server = chart.merge_values(values_of(case))["server"]
        assert server["maxConnections"] >= server["maxConcurrency"] + server["maxQueue"] + 4, case
    room = {"maxConcurrency": 8, "maxQueue": 20}
    c = server_container(manifests(chart, {"server": {**room, "maxConnections": 32}}))
    assert parse_args(c["args"][1:]).connections.max_connections == 32
    with pytest.raises(helm.HelmRenderError, match="set it to at least 32"):
        chart.render({"server": {**room, "maxConnections": 31}}, name="d3d")


def test_single_gpu_gets_one_gpu_shared_by_drafter(chart):
    c = server_container(manifests(chart, values_of("values-single-gpu")))
    assert gpu_resources(c) == (1, 1)
    assert flag(c["args"], "--device") == "cuda:0"
    assert flag(c["args"], "--draft-device") is None  # same device as the target


def test_two_gpu_puts_drafter_on_second_gpu(chart):
    c = server_container(manifests(chart, values_of("values-two-gpu")))
    assert gpu_resources(c) == (2, 2)
    assert flag(c["args"], "--device") == "cuda:0"
    assert flag(c["args"], "--draft-device") == "cuda:1"
    assert flag(c["args"], "--backend") == "sglang"


@pytest.mark.parametrize("case", list(CASES))
def test_args_are_accepted_by_d3d_serve(chart, case):
    """The container's command line goes through the server's own argument parser and config
    checks, so a flag the server does not know (or a value it refuses) fails here."""
    values = values_of(case)
    c = server_container(manifests(chart, values))
    assert c["command"] == ["d3d"] and c["args"][0] == "serve"
    cfg = parse_args(c["args"][1:])
    merged = chart.merge_values(values)
    assert cfg.port == merged["server"]["port"] == c["ports"][0]["containerPort"]
    assert cfg.engine.mode.value == merged["server"]["mode"]
    assert cfg.backend.value == merged["server"]["backend"]
    block = merged["server"]["spec"].get("blockSize")  # null (Helm drops it): the server's default
    assert cfg.engine.spec.block_size == (block or SpecConfig.block_size)
    assert cfg.engine.fixed_block == block
    assert cfg.engine.max_batch_size == merged["server"]["maxConcurrency"]
    assert cfg.model_name == merged["server"]["servedModelName"]
    assert cfg.max_body_bytes == merged["server"]["maxBodyBytes"]
    assert cfg.engine.max_queue == merged["server"]["maxQueue"]
    assert cfg.connections == ConnectionLimits(
        merged["server"]["headerTimeout"], merged["server"]["keepAliveTimeout"],
        merged["server"]["maxConnections"])
    assert cfg.host == "0.0.0.0"  # the server's own default is 127.0.0.1; a pod must listen
    assert cfg.api_keys == ()  # keys come from the Secret through the environment, never args


def api_key_env(c: dict) -> dict | None:
    return next((e for e in c.get("env", []) if e["name"] == "D3D_API_KEY"), None)


def test_api_key_comes_from_a_secret(chart, monkeypatch):
    assert api_key_env(server_container(manifests(chart, {}))) is None  # no Secret, no keys
    c = server_container(manifests(chart, values_of("values-two-gpu")))
    ref = api_key_env(c)["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "d3d-api-keys", "key": "api-key"}
    # The server reads the variable the pod gets (several keys, comma-separated).
    monkeypatch.setenv("D3D_API_KEY", "k1,k2")
    assert parse_args(c["args"][1:]).api_keys == ("k1", "k2")
    assert "--metrics-need-key" not in c["args"]


def test_closed_metrics_are_scraped_with_the_key(chart):
    values = {**values_of("values-two-gpu")}
    values["server"] = {**values["server"], "metricsNeedKey": True}
    docs = manifests(chart, values)
    c = server_container(docs)
    assert "--metrics-need-key" in c["args"]
    (endpoint,) = one(docs, "ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["authorization"] == {
        "type": "Bearer", "credentials": {"name": "d3d-api-keys", "key": "api-key"}
    }
    # The probes stay on the open /health.
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"


@pytest.mark.parametrize("case", list(CASES))
def test_probes_hit_health_on_the_server_port(chart, case):
    c = server_container(manifests(chart, values_of(case)))
    assert [p["name"] for p in c["ports"]] == ["http"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe


@pytest.mark.parametrize("case", list(CASES))
def test_non_root_read_only_root_with_writable_caches(chart, case):
    docs = manifests(chart, values_of(case))
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    c = server_container(docs)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    env = {e["name"]: e.get("value") for e in c["env"]}
    for var in ("D3D_CACHE_DIR", "HF_HOME"):
        assert env[var].startswith("/cache/"), var
    assert "emptyDir" in volumes[mounts["/cache"]] and "emptyDir" in volumes[mounts["/tmp"]]
    assert env["HF_HUB_OFFLINE"] == "1"


def test_models_from_pvc_are_mounted_read_only(chart):
    docs = manifests(chart, values_of("values-two-gpu"))
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    c = server_container(docs)
    models = next(v for v in pod["volumes"] if v["name"] == "models")
    assert models["persistentVolumeClaim"] == {"claimName": "d3d-models", "readOnly": True}
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
    assert flag(c["args"], "--target") == "/models/Qwen3-8B"
    assert flag(c["args"], "--drafter") == "/models/Qwen3-8B-d3d-drafter"


def test_models_from_init_container_fill_an_empty_dir(chart):
    docs = manifests(chart, values_of("values-single-gpu"))
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert {"name": "models", "mountPath": "/models"} in init["volumeMounts"]
    assert init["command"][:2] == ["sh", "-c"]
    assert init["securityContext"]["readOnlyRootFilesystem"] is True
    assert "emptyDir" in next(v for v in pod["volumes"] if v["name"] == "models")
    assert flag(server_container(docs)["args"], "--target") == "/models/target"


def test_pvc_created_when_asked(chart):
    values = {"models": {"source": "pvc", "target": "t", "pvc": {"create": True, "size": "5Gi"}}}
    docs = manifests(chart, values)
    pvc = one(docs, "PersistentVolumeClaim")
    assert pvc["spec"]["resources"]["requests"]["storage"] == "5Gi"
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    claim = next(v for v in pod["volumes"] if v["name"] == "models")["persistentVolumeClaim"]
    assert claim["claimName"] == pvc["metadata"]["name"]


def test_builtin_models_need_no_volume_or_paths(chart):
    docs = manifests(chart, {})
    c = server_container(docs)
    assert "--target" not in c["args"] and "--drafter" not in c["args"]
    assert all(m["name"] != "models" for m in c["volumeMounts"])


def test_service_and_monitor_select_the_pods(chart):
    docs = manifests(chart, values_of("values-two-gpu"))
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    svc = one(docs, "Service")
    assert svc["spec"]["ports"][0]["targetPort"] == "http"
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    # ServiceMonitor is a CRD (skipped by kubernetes-validate above): check it by hand.
    mon = one(docs, "ServiceMonitor")
    assert mon["apiVersion"] == "monitoring.coreos.com/v1"
    assert mon["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert mon["spec"]["endpoints"] == [
        {"port": "http", "path": "/metrics", "interval": "15s", "scrapeTimeout": "10s"}
    ]
    assert mon["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_prometheus_rule_carries_the_alert_file(chart):
    """PrometheusRule is a CRD (skipped by kubernetes-validate): the rules are those of
    deploy/prometheus/alerts.yaml, which promtool checks (tests/test_deploy_alerts.py)."""
    rule = one(manifests(chart, values_of("values-two-gpu")), "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert rule["spec"] == yaml.safe_load(ALERTS.read_text())
    assert [r["alert"] for r in rule["spec"]["groups"][0]["rules"]]


def test_optional_objects_are_off_by_default(chart):
    kinds = {d["kind"] for d in manifests(chart, {})}
    assert kinds == {"Deployment", "Service", "ServiceAccount"}


def test_hpa_and_pdb(chart):
    docs = manifests(chart, values_of("values-two-gpu"))
    deploy = one(docs, "Deployment")
    assert "replicas" not in deploy["spec"]  # the HPA owns the replica count
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == deploy["metadata"]["name"]
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    pdb = one(docs, "PodDisruptionBudget")
    pod_labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()


def test_dashboard_configmap_carries_the_dashboard(chart):
    cm = one(manifests(chart, {"grafanaDashboard": {"enabled": True}}), "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["data"] == {"sglang-d3d.json": DASHBOARD.read_text()}


def test_notes_render(chart):
    notes = chart.render(values_of("values-two-gpu"), name="d3d", namespace="llm")
    text = notes["sglang-d3d/templates/NOTES.txt"]
    assert "drafter on cuda:1" in text and "port-forward svc/d3d-sglang-d3d 8000:8000" in text


BAD_VALUES = {
    "unknown backend": {"server": {"backend": "vllm"}},
    "unknown mode": {"server": {"mode": "turbo"}},
    "port as string": {"server": {"port": "8000"}},
    "gpu count as string": {"gpu": {"count": "two"}},
    "negative gpus": {"gpu": {"count": -1}},
    "block size too small": {"server": {"spec": {"blockSize": 1}}},
    "unknown branch policy": {"server": {"spec": {"branchPolicy": "best"}}},
    "bad draft device": {"server": {"draftDevice": "tpu:0"}},
    "unknown draft weights": {"server": {"draftWeights": "int4"}},
    "negative tree": {"server": {"treeNodes": -1}},
    "unknown top-level key": {"replicas": 3},
    "unknown nested key": {"server": {"blocksize": 8}},
    "pvc without claim": {"models": {"source": "pvc", "target": "t"}},
    "init without command": {"models": {"source": "init", "target": "t"}},
    "pvc without target": {"models": {"source": "pvc", "pvc": {"existingClaim": "m"}}},
    "absolute model path": {"models": {"source": "pvc", "target": "/t", "pvc": {"create": True}}},
    "bad quantity": {"cache": {"sizeLimit": "lots"}},
    "secret name not a DNS name": {"server": {"apiKeySecret": {"name": "My Keys", "key": "k"}}},
    "api key inline": {"server": {"apiKeySecret": {"name": "s", "key": "k", "value": "sk-1"}}},
    "body limit zero": {"server": {"maxBodyBytes": 0}},
    "header timeout zero": {"server": {"headerTimeout": 0}},
    "negative header timeout": {"server": {"headerTimeout": -1}},
    "header timeout with unit": {"server": {"headerTimeout": "30s"}},
    "keep-alive timeout zero": {"server": {"keepAliveTimeout": 0}},
    "keep-alive timeout as string": {"server": {"keepAliveTimeout": "60"}},
    "no connections": {"server": {"maxConnections": 0}},
    "fractional connections": {"server": {"maxConnections": 1024.5}},
    "connections as string": {"server": {"maxConnections": "1024"}},
    "negative queue": {"server": {"maxQueue": -1}},
    "connection value dropped": {"server": {"maxConnections": None}},
    "alert rule switch as string": {"prometheusRule": {"enabled": "yes"}},
}


@pytest.mark.parametrize("values", BAD_VALUES.values(), ids=list(BAD_VALUES))
def test_schema_refuses_invalid_values(chart, values):
    with pytest.raises(helm.HelmValuesError, match="schema"):
        chart.render(values, name="d3d")
    report = helm.lint(CHART, values, strict=True)
    assert any(m["severity"] == 3 for m in report["messages"])


@pytest.mark.parametrize(
    "values, message",
    [
        ({"server": {"draftDevice": "cuda:1"}, "gpu": {"count": 1}}, "needs gpu.count > 1"),
        ({"server": {"draftDevice": "cuda"}}, "needs gpu.count > 0"),
        ({"server": {"backend": "sglang"}}, "backend=sglang runs on CUDA"),
        ({"server": {"backend": "sglang", "mode": "fused"}, "gpu": {"count": 1}},
         "fused runs in the embedded backend only"),
        ({"server": {"backend": "sglang", "draftWeights": "int8"}, "gpu": {"count": 1}},
         "draftWeights=int8 is for the embedded backend"),
        ({"server": {"backend": "sglang", "treeNodes": 5}, "gpu": {"count": 1}},
         "treeNodes is for the embedded backend"),
        ({"server": {"backend": "sglang", "lookupTokens": 4}, "gpu": {"count": 1}},
         "lookupTokens is for the embedded backend"),
        ({"server": {"metricsNeedKey": True}}, "metricsNeedKey needs server.apiKeySecret.name"),
        ({"server": {"maxConnections": 100}}, "maxConnections=100 leaves the probes no connection"),
        ({"server": {"maxConcurrency": 1000}}, "set it to at least 1260"),
        (
            {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}},
            "minReplicas must not exceed",
        ),
    ],
)
def test_template_refuses_inconsistent_values(chart, values, message):
    chart.validate_schema(values)  # well-typed: the template's own checks catch these
    with pytest.raises(helm.HelmRenderError, match=message):
        chart.render(values, name="d3d")
