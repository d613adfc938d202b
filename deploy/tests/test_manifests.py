"""Renders every overlay of deploy/k8s with kustomize, validates each object against the
Kubernetes JSON schemas (offline, kubernetes-validate), and checks what the schemas cannot:
devices, ports, selectors, autoscalers, budgets, the nested config.

Run:  bash deploy/ci-install.sh && python3 -m pytest deploy/tests -q
"""

from __future__ import annotations

import json
import re

import kubernetes_validate
import pytest
import yaml

import vlm_manifests as m

# Oldest Kubernetes the manifests target (gRPC probes are GA from 1.27) and the newest schema
# the installed kubernetes-validate ships.
K8S_VERSIONS = ["1.27", kubernetes_validate.utils.latest_version()]


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict]]:
    return {o: m.render(m.K8S / "overlays" / o) for o in m.OVERLAYS}


@pytest.fixture(scope="session")
def adapter_metrics() -> set[str]:
    return m.adapter_metric_names(m.adapter_rules())


def test_every_overlay_is_there():
    assert set(m.OVERLAYS) >= {"cpu", "nvidia", "rebellions"}, m.OVERLAYS


@pytest.mark.parametrize("overlay", m.OVERLAYS)
def test_renders(rendered, overlay):
    kinds = sorted({d["kind"] for d in rendered[overlay]})
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "ConfigMap"} <= set(kinds), kinds


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("overlay", m.OVERLAYS)
def test_schema_valid(rendered, overlay, version):
    errors = []
    for d in rendered[overlay]:
        if d.get("apiVersion", "").startswith("cert-manager.io/"):
            errors += m.check_cert_manager_object(d)
            continue
        try:
            kubernetes_validate.validate(d, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(x) for x in e.path)
            errors.append(f"{d['kind']}/{d['metadata']['name']}: {path}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            errors.append(e.message)
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("overlay", m.OVERLAYS)
def test_unique_names(rendered, overlay):
    keys = [(d["kind"], d["metadata"]["name"]) for d in rendered[overlay]]
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize(
    "check",
    [
        m.check_labels_and_selectors,
        m.check_services,
        m.check_ports_and_probes,
        m.check_gateway_upstreams,
        m.check_pdbs,
        m.check_configs,
        m.check_devices,
        m.check_model_source,
        m.check_references,
        m.check_pod_hardening,
        m.check_internal_tls,
    ],
    ids=lambda f: f.__name__,
)
@pytest.mark.parametrize("overlay", m.OVERLAYS)
def test_cross_object(rendered, overlay, check):
    problems = check(rendered[overlay])
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("overlay", m.OVERLAYS)
def test_hpas(rendered, overlay, adapter_metrics):
    problems = m.check_hpas(rendered[overlay], adapter_metrics)
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------- per overlay
def _part(docs, comp):
    dep = m.deployments(docs)[comp]
    cfg, _ = m.mounted_config(docs, dep)
    return dep, m.main_container(dep), (cfg if comp == "lm" else cfg["visual"])


def test_cpu_generates_the_tiny_model_in_every_pod(rendered):
    docs = rendered["cpu"]
    want = ["vlm", "make-model", "--preset", "tiny", "--seed", "0", "--out", "/models/tiny"]
    for comp, dep in m.deployments(docs).items():
        cmds = [ic.get("command", []) + ic.get("args", []) for ic in m.pod_spec(dep).get("initContainers", [])]
        assert want in cmds, f"{comp}: {cmds}"
        assert m.setting(m.main_container(dep), *m.MODEL) == "/models/tiny"
        for ic in m.pod_spec(dep)["initContainers"]:
            assert not any(r in ic.get("resources", {}).get("limits", {}) for r in m.DEVICE_RESOURCES)
    for comp in ("vision", "lm"):
        _, c, part = _part(docs, comp)
        assert m.device_count(c) == ("cpu", part["num_devices"])


def test_nvidia_gives_vision_and_lm_gpus(rendered):
    docs = rendered["nvidia"]
    for comp in ("vision", "lm"):
        dep, c, part = _part(docs, comp)
        lim = c["resources"]["limits"]
        assert int(lim.get("nvidia.com/gpu", 0)) >= 1, comp
        assert len(part["device"]) == part["num_devices"] == int(lim["nvidia.com/gpu"])
        assert any(t.get("key") == "nvidia.com/gpu" for t in m.pod_spec(dep).get("tolerations", []))
    gw = m.main_container(m.deployments(docs)["gateway"])
    assert "nvidia.com/gpu" not in gw["resources"].get("limits", {})
    # The GPU pods run the CUDA build.
    assert all(c["image"].endswith("-cuda") for dep in m.deployments(docs).values() for c in m.pod_spec(dep)["containers"])


def test_rebellions_is_the_seeds_16_device_disjoint_layout(rendered):
    docs = rendered["rebellions"]
    total = 0
    for comp in ("vision", "lm"):
        dep, c, part = _part(docs, comp)
        lim = c["resources"]["limits"]
        names = [r for r in ("rebellions.ai/ATOM", "rebellions.ai/npu") if r in lim]
        assert len(names) == 1, f"{comp}: one NPU resource name, got {names}"
        assert int(lim[names[0]]) == 8, comp
        # Each pod sees its own 8 NPUs as 0..7.
        assert part["device"] == list(range(8)), (comp, part["device"])
        assert part["num_devices"] == 8
        total += int(lim[names[0]])
    assert total == 16
    cfg = m.mounted_config(docs, m.deployments(docs)["lm"])[0]
    assert cfg["batch_size"] == 8 and cfg["decoder_batch_sizes"] == [1, 2, 4, 8]
    assert cfg["max_seq_len"] == 262144 and cfg["kvcache_partition_len"] == 16384
    assert "batch_size" not in cfg["visual"]


@pytest.mark.parametrize("overlay", m.OVERLAYS)
def test_all_services_read_one_config_and_it_is_nested(rendered, overlay):
    docs = rendered[overlay]
    cfgs = [m.mounted_config(docs, d)[0] for d in m.deployments(docs).values()]
    assert all(c == cfgs[0] for c in cfgs)
    cfg = cfgs[0]
    assert isinstance(cfg["visual"], dict)
    # Top level is the LM, `visual` the ViT: LM-only keys stay at the top.
    for k in ("kvcache_partition_len", "decoder_batch_sizes", "batch_size"):
        assert k in cfg and k not in cfg["visual"], k


# --------------------------------------------------------------------------- other files
def test_adapter_rules_and_helm_values_agree():
    rules = m.adapter_rules()
    values = yaml.safe_load((m.K8S / "prometheus-adapter" / "values.yaml").read_text())
    assert values["rules"]["custom"] == rules
    for r in rules:
        assert m.series_name(r["seriesQuery"]) in m.KNOWN_METRICS, r["seriesQuery"]
        assert "<<.LabelMatchers>>" in r["metricsQuery"] and "<<.GroupBy>>" in r["metricsQuery"]
        assert r["resources"]["overrides"]["pod"]["resource"] == "pod"
    assert {"vlm_vision_queue_depth", "vlm_lm_waiting"} <= m.adapter_metric_names(rules)


def test_dashboard_uses_only_exported_metrics():
    d = m.dashboard()
    panels = m.dashboard_panels(d)
    exprs = [t["expr"] for p in panels for t in p.get("targets", [])]
    assert exprs
    used = set().union(*(m.metric_names_in(e) for e in exprs))
    assert used <= m.KNOWN_METRICS, sorted(used - m.KNOWN_METRICS)
    # The main panels are there.
    titles = " | ".join(p["title"] for p in panels).lower()
    for want in ("ttft", "tokens / s", "queue", "bucket mix", "padding", "kv blocks"):
        assert want in titles, want
    for metric in ("vlm_lm_time_to_first_token_seconds", "vlm_lm_generated_tokens_total",
                   "vlm_vision_queue_depth", "vlm_lm_waiting", "vlm_vision_images_total",
                   "vlm_vision_padding_fraction", "vlm_lm_kv_blocks_used", "vlm_lm_kv_blocks_free"):
        assert metric in used, metric
    # Every query panel uses the datasource variable (no hard-wired datasource uid).
    for p in panels:
        if p.get("targets"):
            assert p["datasource"]["uid"] == "${datasource}", p["title"]


def test_dockerfile_builds_what_the_manifests_run():
    text = (m.DEPLOY / "docker" / "Dockerfile").read_text()
    pkgs = re.search(r'ARG PACKAGES="([^"]+)"', text).group(1).split()
    bins = re.search(r'ARG BINARIES="([^"]+)"', text).group(1).split()
    assert set(pkgs) == {"vlm-vision-service", "vlm-lm-service", "vlm-gateway", "vlm-cli"}
    assert set(bins) == m.BINARIES
    assert re.search(r"^FROM .* AS cpu$", text, re.M) and re.search(r"^FROM .* AS cuda$", text, re.M)
    # The CUDA stage enables the compute backends' CUDA build, a feature that exists.
    assert 'ARG CARGO_FEATURES="vlm-backends/cuda"' in text
    backends = (m.DEPLOY.parent / "backends" / "select" / "Cargo.toml").read_text()
    feature = re.search(r"^cuda = \[([^\]]*)\]$", backends, re.M)
    assert feature and '"vlm-backend-cuda/cuda"' in feature.group(1), feature
    # The last stage (plain `docker build`) is the CPU image; both run as the pods' user.
    assert re.findall(r"^FROM .* AS (\S+)$", text, re.M)[-1] == "cpu"
    users = re.findall(r"^USER (\d+):(\d+)$", text, re.M)
    assert users and all(int(u) == m.RUN_AS_USER for u, _ in users)
    ignore = (m.DEPLOY.parent / ".dockerignore").read_text().split()
    assert "target" in ignore and ".git" in ignore


# --------------------------------------------------------------------------- the checks bite
# Break one thing in a rendered overlay and the matching check must report it.
def _dep(docs, comp):
    return m.deployments(docs)[comp]


def _set_config(docs, dep, fn):
    cfg, _ = m.mounted_config(docs, dep)
    fn(cfg)
    cm_name = next(v for v in m.pod_spec(dep)["volumes"] if v["name"] == "config")["configMap"]["name"]
    cm = m.by_name(docs, "ConfigMap", cm_name)
    cm["data"]["config.yaml"] = yaml.safe_dump(cfg)


def _break_device_list(docs):
    _set_config(docs, _dep(docs, "vision"), lambda c: c["visual"].update(device=list(range(7))))


def _break_num_devices(docs):
    _set_config(docs, _dep(docs, "lm"), lambda c: c.update(num_devices=c["num_devices"] + 1))


def _break_device_limit(docs):
    c = m.main_container(_dep(docs, "lm"))
    what, n = m.device_count(c)
    c["resources"]["limits"][what] = n + 1 if what != "cpu" else str(n + 1)
    c["resources"]["requests"][what] = c["resources"]["limits"][what]


def _break_device_override(docs):
    m.main_container(_dep(docs, "vision"))["args"].append("--device=5")


def _break_probe_port(docs):
    m.main_container(_dep(docs, "vision"))["readinessProbe"]["grpc"]["port"] = 50062


def _break_listen_flag(docs):
    c = m.main_container(_dep(docs, "lm"))
    c["args"] = [a if not a.startswith("--listen=") else "--listen=0.0.0.0:50070" for a in c["args"]]


def _break_metrics_annotation(docs):
    _dep(docs, "gateway")["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] = "9999"


def _break_selectors(docs):
    # The LM Deployment's selector and pods now look like vision's.
    lm = _dep(docs, "lm")
    lm["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] = "vision"
    lm["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] = "vision"


def _break_headless(docs):
    m.by_name(docs, "Service", "vlm-vision")["spec"].pop("clusterIP")


def _break_hpa_target(docs):
    m.by_name(docs, "HorizontalPodAutoscaler", "vlm-lm")["spec"]["scaleTargetRef"]["name"] = "vlm-llm"


def _break_hpa_metric(docs):
    h = m.by_name(docs, "HorizontalPodAutoscaler", "vlm-vision")
    h["spec"]["metrics"][0]["pods"]["metric"]["name"] = "vlm_vision_queue"


def _break_pdb(docs):
    m.by_name(docs, "PodDisruptionBudget", "vlm-vision")["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] = "visual"


def _break_config_nesting(docs):
    _set_config(docs, _dep(docs, "lm"), lambda c: c["visual"].update(batch_size=8))


def _break_grace(docs):
    m.pod_spec(_dep(docs, "lm"))["terminationGracePeriodSeconds"] = 30


def _break_gateway_upstream(docs):
    c = m.main_container(_dep(docs, "gateway"))
    c["args"] = [a.replace("vlm-lm:50062", "vlm-lm:50061") for a in c["args"]]


def _break_lm_vision(docs):
    c = m.main_container(_dep(docs, "lm"))
    c["args"] = [a for a in c["args"] if not a.startswith("--vision")]


def _break_model_out(docs):
    for ic in m.pod_spec(_dep(docs, "vision")).get("initContainers", []):
        ic["command"] = [x if x != "/models/tiny" else "/models/small" for x in ic["command"]]


def _break_root(docs):
    m.pod_spec(_dep(docs, "gateway"))["securityContext"]["runAsNonRoot"] = False


def _break_tls_gateway(docs):
    c = m.main_container(_dep(docs, "gateway"))
    c["env"] = [e for e in c["env"] if not e["name"].startswith("VLM_INTERNAL_TLS_")]


def _break_tls_name(docs):
    m.by_name(docs, "Certificate", "vlm-vision-tls")["spec"]["dnsNames"] = ["vision"]


def _break_tls_probe(docs):
    m.main_container(_dep(docs, "lm"))["readinessProbe"] = {"grpc": {"port": 50062}}


def _break_tls_usage(docs):
    m.by_name(docs, "Certificate", "vlm-lm-tls")["spec"]["usages"] = ["client auth"]


def _break_tls_mount(docs):
    c = m.main_container(_dep(docs, "vision"))
    for e in c["env"]:
        if e["name"] == "VLM_INTERNAL_TLS_CA":
            e["value"] = "/etc/tls/ca.crt"


BREAKS = {
    "one service without mutual TLS": ("cpu-mtls", _break_tls_gateway, m.check_internal_tls),
    "vision certificate lacks the name the LM dials": ("cpu-mtls", _break_tls_name, m.check_internal_tls),
    "gRPC probe on a mutual-TLS port": ("cpu-mtls", _break_tls_probe, m.check_ports_and_probes),
    "LM certificate not for server auth": ("cpu-mtls", _break_tls_usage, m.check_internal_tls),
    "CA file on no mounted Secret": ("cpu-mtls", _break_tls_mount, m.check_internal_tls),
    "device list shorter than the allocation": ("rebellions", _break_device_list, m.check_devices),
    "num_devices off by one": ("nvidia", _break_num_devices, m.check_devices),
    "device limit changed": ("cpu", _break_device_limit, m.check_devices),
    "--device override disagrees": ("rebellions", _break_device_override, m.check_devices),
    "probe port not the --listen port": ("cpu", _break_probe_port, m.check_ports_and_probes),
    "--listen moved, probes not": ("nvidia", _break_listen_flag, m.check_ports_and_probes),
    "scrape annotation on the wrong port": ("cpu", _break_metrics_annotation, m.check_ports_and_probes),
    "vision and LM selectors overlap": ("cpu", _break_selectors, m.check_labels_and_selectors),
    "vision Service not headless": ("cpu", _break_headless, m.check_services),
    "HPA targets a missing Deployment": ("cpu", _break_hpa_target, None),
    "HPA metric no adapter rule serves": ("rebellions", _break_hpa_metric, None),
    "PDB selects no pods": ("nvidia", _break_pdb, m.check_pdbs),
    "batch_size under visual": ("cpu", _break_config_nesting, m.check_configs),
    "grace period shorter than the drain": ("cpu", _break_grace, m.check_ports_and_probes),
    "gateway --lm port is vision's": ("cpu", _break_gateway_upstream, m.check_gateway_upstreams),
    "LM given no vision replicas": ("nvidia", _break_lm_vision, m.check_gateway_upstreams),
    "make-model writes elsewhere": ("cpu", _break_model_out, m.check_model_source),
    "pod may run as root": ("cpu", _break_root, m.check_pod_hardening),
}


@pytest.mark.parametrize("name", list(BREAKS))
def test_check_catches(rendered, adapter_metrics, name):
    overlay, breaker, check = BREAKS[name]
    run = check or (lambda d: m.check_hpas(d, adapter_metrics))
    docs = m.mutate(rendered[overlay])
    # Whatever the clean overlay reports is test_cross_object's business; here the break must
    # add a new problem.
    before = set(run(docs))
    breaker(docs)
    new = set(run(docs)) - before
    assert new, f"{name}: no check noticed"


def test_cert_manager_objects_are_checked_like_a_schema(rendered):
    cert = json.loads(json.dumps(m.by_name(rendered["cpu-mtls"], "Certificate", "vlm-lm-tls")))
    assert m.check_cert_manager_object(cert) == []
    cert["spec"]["dnsName"] = cert["spec"].pop("dnsNames")
    cert["spec"]["usages"].append("server-auth")
    problems = m.check_cert_manager_object(cert)
    assert any("dnsName" in p for p in problems) and any("server-auth" in p for p in problems), problems


def test_schema_validation_catches_a_typo(rendered):
    d = json.loads(json.dumps(m.objects(rendered["cpu"], "Deployment")[0]))
    d["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["prot"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(d, K8S_VERSIONS[-1], strict=True)
