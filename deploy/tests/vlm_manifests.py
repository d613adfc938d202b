"""Rendering and cross-object checks of the vlm Kubernetes manifests (deploy/k8s).

The schema validation (kubernetes-validate) proves each object is well-formed; the checks here
prove what a schema cannot: that objects agree with each other and with the services' flags.
Each check takes the rendered objects and returns a list of problems (empty = fine), so that
the tests can also feed them deliberately broken manifests and see them complain.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import yaml

# The contract and the object helpers, and the TLS checks, are re-exported: the tests read
# them as vlm_manifests.SERVICES, vlm_manifests.render, ...
from manifest_contract import *  # noqa: E402,F401,F403
from manifest_tls import check_cert_manager_object, check_internal_tls, internal_tls  # noqa: E402,F401


def container_port(container: dict, name: str) -> int | None:
    for p in container.get("ports", []):
        if p.get("name") == name:
            return p["containerPort"]
    return None


def selector_matches(selector: dict, labels: dict) -> bool:
    """matchLabels + matchExpressions (In, NotIn, Exists, DoesNotExist) against labels.
    A Service's selector is a plain map: pass it as {"matchLabels": map}."""
    if not selector or (not selector.get("matchLabels") and not selector.get("matchExpressions")):
        return False  # an empty selector selects everything: never what we mean here
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions") or []:
        k, op, vals = e["key"], e["operator"], e.get("values", [])
        if op == "In" and labels.get(k) not in vals:
            return False
        if op == "NotIn" and labels.get(k) in vals:
            return False
        if op == "Exists" and k not in labels:
            return False
        if op == "DoesNotExist" and k in labels:
            return False
    return True


def selected_deployments(docs: list[dict], selector: dict) -> list[str]:
    return [
        d["metadata"]["name"]
        for d in objects(docs, "Deployment")
        if selector_matches(selector, d["spec"]["template"]["metadata"].get("labels", {}))
    ]


def quantity(q: Any) -> float:
    """A Kubernetes quantity as a float (cpu in cores, memory in bytes)."""
    s = str(q)
    suffixes = {
        "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
        "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
    }
    for suf in sorted(suffixes, key=len, reverse=True):
        if s.endswith(suf):
            return float(s[: -len(suf)]) * suffixes[suf]
    return float(s)


def config_maps_data(docs: list[dict]) -> dict[str, dict]:
    return {c["metadata"]["name"]: c.get("data", {}) for c in objects(docs, "ConfigMap")}


def mounted_config(docs: list[dict], dep: dict) -> tuple[dict | None, list[str]]:
    """The parsed config file a Deployment's main container reads (--config / VLM_CONFIG)."""
    problems = []
    name = dep["metadata"]["name"]
    c = main_container(dep)
    path = setting(c, *CONFIG)
    if not path:
        return None, [f"{name}: no --config / VLM_CONFIG"]
    mount = next(
        (m for m in c.get("volumeMounts", []) if path.startswith(m["mountPath"].rstrip("/") + "/")),
        None,
    )
    if mount is None:
        return None, [f"{name}: config {path} is on no mounted volume"]
    vol = next((v for v in pod_spec(dep).get("volumes", []) if v["name"] == mount["name"]), None)
    if vol is None or "configMap" not in vol:
        return None, [f"{name}: config {path} is not on a ConfigMap volume"]
    cm_name = vol["configMap"]["name"]
    data = config_maps_data(docs).get(cm_name)
    if data is None:
        return None, [f"{name}: ConfigMap {cm_name} (holding {path}) is not in the output"]
    key = path[len(mount["mountPath"].rstrip("/")) + 1:]
    if vol["configMap"].get("items"):
        items = {i["path"]: i["key"] for i in vol["configMap"]["items"]}
        key = items.get(key, key)
    if key not in data:
        return None, [f"{name}: ConfigMap {cm_name} has no key {key!r} for {path}"]
    try:
        cfg = yaml.safe_load(data[key])
    except yaml.YAMLError as e:
        return None, [f"{name}: {cm_name}/{key} does not parse: {e}"]
    return cfg, problems


def device_count(container: dict) -> tuple[str, int | None]:
    """(what a device is, how many the container gets): an accelerator limit if there is one,
    else whole CPU cores."""
    limits = container.get("resources", {}).get("limits", {})
    for r in DEVICE_RESOURCES:
        if r in limits:
            return r, int(limits[r])
    cpu = limits.get("cpu")
    if cpu is None:
        return "cpu", None
    cores = quantity(cpu)
    return "cpu", int(cores) if cores == int(cores) else None


def as_list(v: Any) -> list:
    if v is None:
        return []
    return v if isinstance(v, list) else [v]


# --------------------------------------------------------------------------- checks
def check_config_shape(cfg: Any) -> list[str]:
    """The nested config's shape and the library's rules (mirrors DESIGN.md)."""
    p = []
    if not isinstance(cfg, dict):
        return [f"config is a {type(cfg).__name__}, not a mapping"]
    unknown = set(cfg) - TOP_KEYS
    if unknown:
        p.append(f"config: unknown top-level keys {sorted(unknown)}")
    vis = cfg.get("visual")
    if not isinstance(vis, dict):
        p.append("config: `visual` (the ViT part) is missing or not a mapping")
        vis = {}
    if "batch_size" in vis:
        p.append("config: batch_size is one value for the whole model; it may not be set under visual")
    unknown = set(vis) - VISUAL_KEYS
    if unknown:
        p.append(f"config: unknown visual keys {sorted(unknown)}")
    for req in ("max_seq_len", "kvcache_partition_len", "batch_size", "num_devices", "device"):
        if req not in cfg:
            p.append(f"config: top-level {req} missing")
    for req in ("max_seq_len", "num_devices", "device"):
        if req not in vis and not (req == "max_seq_len" and "max_seq_lens" in vis):
            p.append(f"config: visual.{req} missing")

    for where, part in (("top level", cfg), ("visual", vis)):
        n = part.get("num_devices", part.get("tensor_parallel_size"))
        dev = as_list(part.get("device"))
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dev):
            p.append(f"config {where}: device ids must be non-negative integers, got {dev}")
        if len(set(dev)) != len(dev):
            p.append(f"config {where}: device list {dev} repeats an id")
        if n is not None and n != len(dev):
            p.append(f"config {where}: num_devices {n} != len(device) {len(dev)}")
        dt = part.get("dtype")
        if dt is not None and str(dt).lower() not in DTYPES:
            p.append(f"config {where}: dtype {dt!r} is not one of f32, f16, bf16")

    bs = cfg.get("batch_size")
    dbs = cfg.get("decoder_batch_sizes")
    if isinstance(bs, int) and dbs is not None:
        dbs = as_list(dbs)
        if any((not isinstance(b, int)) or b < 1 or b > bs for b in dbs):
            p.append(f"config: decoder_batch_sizes {dbs} must be positive and <= batch_size {bs}")
        elif len(dbs) == 1 and dbs[0] != bs:
            p.append(f"config: a single decoder_batch_sizes value {dbs[0]} must equal batch_size {bs}")
        elif max(dbs) != bs:
            p.append(f"config: the largest decoder batch {max(dbs)} should equal batch_size {bs}")
    msl, part = cfg.get("max_seq_len"), cfg.get("kvcache_partition_len")
    if isinstance(msl, int) and isinstance(part, int) and part > 0:
        if msl % part:
            p.append(f"config: max_seq_len {msl} is not a multiple of kvcache_partition_len {part}")
        elif msl // part < 2:
            p.append(f"config: max_seq_len {msl} must hold at least two partitions of {part}")
    pcs = cfg.get("prefill_chunk_size", 128)
    if not (isinstance(pcs, int) and pcs > 0 and pcs % 64 == 0):
        p.append(f"config: prefill_chunk_size {pcs} must be a positive multiple of 64")
    kb = cfg.get("kvcache_num_blocks", 0)
    if not (isinstance(kb, int) and kb >= 0):
        p.append(f"config: kvcache_num_blocks {kb} must be >= 0 (0 = automatic)")

    buckets = as_list(vis.get("max_seq_len", vis.get("max_seq_lens")))
    if not buckets or any((not isinstance(b, int)) or b <= 0 or b % 4 for b in buckets):
        p.append(f"config: visual.max_seq_len {buckets} must be positive multiples of 4")
    elif buckets != sorted(set(buckets)):
        p.append(f"config: visual.max_seq_len buckets {buckets} should be distinct and ascending")
    ov = vis.get("oversize")
    if ov is not None and ov not in ("reject", "downscale"):
        p.append(f"config: visual.oversize {ov!r} is not reject or downscale")
    lo, hi = vis.get("min_pixels"), vis.get("max_pixels")
    if isinstance(lo, int) and isinstance(hi, int):
        if lo > hi:
            p.append(f"config: visual.min_pixels {lo} > max_pixels {hi}")
        if buckets and all(isinstance(b, int) for b in buckets) and hi // PATCH_PIXELS > max(buckets):
            p.append(
                f"config: visual.max_pixels {hi} is {hi // PATCH_PIXELS} patches, more than the "
                f"largest ViT bucket {max(buckets)}: allowed images would have no bucket"
            )
    return p


def check_labels_and_selectors(docs: list[dict]) -> list[str]:
    p = []
    deps = deployments(docs)
    if set(deps) != set(SERVICES):
        p.append(f"expected one Deployment per component {sorted(SERVICES)}, got {sorted(map(str, deps))}")
    for comp, d in deps.items():
        labels = d["spec"]["template"]["metadata"].get("labels", {})
        if labels.get("app.kubernetes.io/name") != "vlm":
            p.append(f"{d['metadata']['name']}: pod label app.kubernetes.io/name is not vlm")
        sel = d["spec"]["selector"]
        if not selector_matches(sel, labels):
            p.append(f"{d['metadata']['name']}: selector does not match its own pod template")
        if sel.get("matchLabels", {}).get("app.kubernetes.io/component") != comp:
            p.append(f"{d['metadata']['name']}: selector does not pin app.kubernetes.io/component={comp}")
    # Every selector picks the pods of exactly one Deployment.
    for d in objects(docs, "Deployment"):
        hits = selected_deployments(docs, d["spec"]["selector"])
        if hits != [d["metadata"]["name"]]:
            p.append(f"Deployment {d['metadata']['name']}: selector matches the pods of {hits}")
    # Vision and LM never share pods (disjoint device pools need disjoint pods).
    if "vision" in deps and "lm" in deps:
        v, l = deps["vision"], deps["lm"]
        vl = v["spec"]["template"]["metadata"].get("labels", {})
        ll = l["spec"]["template"]["metadata"].get("labels", {})
        if selector_matches(v["spec"]["selector"], ll) or selector_matches(l["spec"]["selector"], vl):
            p.append("vision and LM selectors are not disjoint")
    return p


def check_services(docs: list[dict]) -> list[str]:
    p = []
    deps = deployments(docs)
    for svc in objects(docs, "Service"):
        name = svc["metadata"]["name"]
        hits = selected_deployments(docs, {"matchLabels": svc["spec"].get("selector", {})})
        if len(hits) != 1:
            p.append(f"Service {name}: selects the pods of {hits}, expected exactly one Deployment")
            continue
        dep = by_name(docs, "Deployment", hits[0])
        comp = component(svc)
        if comp and deps.get(comp) is not dep:
            p.append(f"Service {name} (component {comp}) selects {hits[0]}")
        c = main_container(dep)
        for port in svc["spec"].get("ports", []):
            tp = port.get("targetPort", port["port"])
            cp = container_port(c, tp) if isinstance(tp, str) else tp
            if cp is None or cp not in [x["containerPort"] for x in c.get("ports", [])]:
                p.append(f"Service {name}: port {port.get('name')} targets {tp!r}, not a port of {hits[0]}")
        if "grpc" not in [x.get("name") for x in svc["spec"].get("ports", [])]:
            p.append(f"Service {name}: no port named grpc")
        headless = svc["spec"].get("clusterIP") == "None"
        if comp in ("vision", "lm") and not headless:
            p.append(f"Service {name}: the {comp} Service must be headless (clusterIP: None) so the gateway sees every replica")
        if comp in ("vision", "lm") and svc["spec"].get("publishNotReadyAddresses"):
            p.append(f"Service {name}: publishes not-ready (draining) replicas")
    for comp in ("gateway", "vision", "lm"):
        if not [s for s in objects(docs, "Service") if component(s) == comp]:
            p.append(f"no Service for {comp}")
    return p


def check_ports_and_probes(docs: list[dict]) -> list[str]:
    p = []
    for comp, dep in deployments(docs).items():
        if comp not in SERVICES:
            continue
        spec = SERVICES[comp]
        name = dep["metadata"]["name"]
        c = main_container(dep)
        if c.get("command", [None])[0] != spec["binary"]:
            p.append(f"{name}: runs {c.get('command')}, expected the {spec['binary']} binary")
        listen = setting(c, *spec["grpc"])
        grpc_port = port_of(listen)
        if container_port(c, "grpc") != grpc_port:
            p.append(f"{name}: containerPort grpc {container_port(c, 'grpc')} != {spec['grpc'][0]} port {grpc_port}")
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            pr = c.get(probe)
            if pr is None:
                if probe != "startupProbe":
                    p.append(f"{name}: no {probe}")
                continue
            if internal_tls(c) and comp != "gateway":
                # A kubelet's gRPC probe speaks plain text: with mutual TLS on the gRPC port
                # the probe is the metrics server's /readyz (what the gRPC health says).
                http = pr.get("httpGet") or {}
                if "grpc" in pr or http.get("path") != "/readyz":
                    p.append(f"{name}: {probe} must be httpGet /readyz with the gRPC port on mutual TLS, got {pr}")
                elif http.get("port") not in (spec["metrics_port_name"], port_of(setting(c, *spec["metrics"]))):
                    p.append(f"{name}: {probe} port {http.get('port')} is not the metrics port")
                continue
            if "grpc" not in pr:
                p.append(f"{name}: {probe} is not a grpc.health.v1 probe")
                continue
            if pr["grpc"].get("port") != grpc_port:
                p.append(f"{name}: {probe} port {pr['grpc'].get('port')} != {spec['grpc'][0]} port {grpc_port}")
            if pr["grpc"].get("service", "") != "":
                p.append(f"{name}: {probe} asks service {pr['grpc']['service']!r}; only \"\" (overall) is served")
        metrics_port = port_of(setting(c, *spec["metrics"]))
        if container_port(c, spec["metrics_port_name"]) != metrics_port:
            p.append(
                f"{name}: containerPort {spec['metrics_port_name']} "
                f"{container_port(c, spec['metrics_port_name'])} != {spec['metrics'][0]} port {metrics_port}"
            )
        ann = dep["spec"]["template"]["metadata"].get("annotations", {})
        if ann.get("prometheus.io/scrape") != "true":
            p.append(f"{name}: pod lacks prometheus.io/scrape: \"true\"")
        if ann.get("prometheus.io/port") != str(metrics_port):
            p.append(f"{name}: prometheus.io/port {ann.get('prometheus.io/port')} != metrics port {metrics_port}")
        if ann.get("prometheus.io/path", "/metrics") != "/metrics":
            p.append(f"{name}: prometheus.io/path is not /metrics")
        # Drain: SIGTERM -> NOT_SERVING -> up to DRAIN_SECONDS of in-flight work.
        grace = pod_spec(dep).get("terminationGracePeriodSeconds", 30)
        if grace < DRAIN_SECONDS + 10:
            p.append(f"{name}: terminationGracePeriodSeconds {grace} < drain {DRAIN_SECONDS} s + margin")
        lp = c.get("livenessProbe", {})
        if lp and lp.get("periodSeconds", 10) * lp.get("failureThreshold", 3) < DRAIN_SECONDS:
            p.append(f"{name}: livenessProbe would restart a draining (NOT_SERVING) replica within {DRAIN_SECONDS} s")
    return p


def check_gateway_upstreams(docs: list[dict]) -> list[str]:
    """The gateway's --vision/--lm and the LM's --vision name the headless Services."""
    p = []
    for who, upstreams in (("gateway", GATEWAY_UPSTREAMS), ("lm", LM_UPSTREAMS)):
        dep = deployments(docs).get(who)
        if dep is None:
            p.append(f"no {who} Deployment")
            continue
        p += _check_upstreams(who, main_container(dep), upstreams, docs)
    return p


def _check_upstreams(who: str, c: dict, upstreams: dict, docs: list[dict]) -> list[str]:
    p = []
    for comp, (flag, env) in upstreams.items():
        addrs = setting(c, flag, env)
        if not addrs:
            p.append(f"{who}: no {flag} / {env}")
            continue
        m = re.fullmatch(r"dns:///([a-z0-9.-]+):(\d+)", addrs)
        if not m:
            p.append(f"{who}: {flag} {addrs!r} is not dns:///<headless service>:<port>")
            continue
        host, port = m.group(1), int(m.group(2))
        svc = by_name(docs, "Service", host.split(".")[0])
        if svc is None:
            p.append(f"{who}: {flag} names Service {host}, which is not in the output")
            continue
        if component(svc) != comp or svc["spec"].get("clusterIP") != "None":
            p.append(f"{who}: {flag} names {host}, not the headless {comp} Service")
        grpc = [x for x in svc["spec"]["ports"] if x.get("name") == "grpc"]
        if not grpc or grpc[0]["port"] != port:
            p.append(f"{who}: {flag} port {port} != Service {host} grpc port {grpc[0]['port'] if grpc else None}")
    return p


def check_hpas(docs: list[dict], adapter_metrics: set[str]) -> list[str]:
    p = []
    deps = deployments(docs)
    for comp in SERVICES:
        if not [h for h in objects(docs, "HorizontalPodAutoscaler") if component(h) == comp]:
            p.append(f"no HorizontalPodAutoscaler for {comp}")
    for h in objects(docs, "HorizontalPodAutoscaler"):
        name = h["metadata"]["name"]
        ref = h["spec"]["scaleTargetRef"]
        target = by_name(docs, ref["kind"], ref["name"]) if ref.get("kind") == "Deployment" else None
        if target is None or ref.get("apiVersion") != "apps/v1":
            p.append(f"HPA {name}: scaleTargetRef {ref} is not a Deployment in the output")
            continue
        if h["spec"].get("minReplicas", 1) > h["spec"]["maxReplicas"]:
            p.append(f"HPA {name}: minReplicas > maxReplicas")
        comp = component(h)
        if comp and deps.get(comp) is not target:
            p.append(f"HPA {name} (component {comp}) scales {ref['name']}")
        metrics = h["spec"].get("metrics", [])
        kinds = {m["type"] for m in metrics}
        custom = [m["pods"]["metric"]["name"] for m in metrics if m["type"] == "Pods"]
        custom += [m["object"]["metric"]["name"] for m in metrics if m["type"] == "Object"]
        for mname in custom:
            if mname not in adapter_metrics:
                p.append(f"HPA {name}: custom metric {mname} is served by no prometheus-adapter rule")
            if mname not in KNOWN_METRICS:
                p.append(f"HPA {name}: {mname} is not a metric the services export")
        cpu = [m for m in metrics if m["type"] == "Resource" and m["resource"]["name"] == "cpu"]
        if not cpu:
            p.append(f"HPA {name}: no CPU metric (the fallback when custom metrics are missing)")
        elif cpu[0]["resource"]["target"]["type"] == "Utilization":
            for c in pod_spec(target)["containers"]:
                if "cpu" not in c.get("resources", {}).get("requests", {}):
                    p.append(f"HPA {name}: CPU utilization needs a cpu request on {c['name']}")
        want = HPA_CUSTOM_METRIC.get(comp)
        if want and want not in custom:
            p.append(f"HPA {name}: the {comp} HPA must follow {want}, follows {custom}")
        if want and "Resource" not in kinds:
            p.append(f"HPA {name}: no Resource (CPU) fallback")
    return p


def check_pdbs(docs: list[dict]) -> list[str]:
    p = []
    for comp in SERVICES:
        if not [b for b in objects(docs, "PodDisruptionBudget") if component(b) == comp]:
            p.append(f"no PodDisruptionBudget for {comp}")
    for b in objects(docs, "PodDisruptionBudget"):
        name = b["metadata"]["name"]
        hits = selected_deployments(docs, b["spec"].get("selector", {}))
        if len(hits) != 1:
            p.append(f"PDB {name}: selects the pods of {hits}, expected exactly one Deployment")
            continue
        comp = component(b)
        if comp and deployments(docs).get(comp) is not by_name(docs, "Deployment", hits[0]):
            p.append(f"PDB {name} (component {comp}) selects {hits[0]}")
        if "maxUnavailable" not in b["spec"] and "minAvailable" not in b["spec"]:
            p.append(f"PDB {name}: neither maxUnavailable nor minAvailable")
    return p


def check_devices(docs: list[dict]) -> list[str]:
    """Each part's device list == num_devices == the pod's device allocation, ids 0..n-1."""
    p = []
    deps = deployments(docs)
    for comp, dep in deps.items():
        spec = SERVICES.get(comp)
        if spec is None:
            continue
        name = dep["metadata"]["name"]
        c = main_container(dep)
        what, count = device_count(c)
        if spec["device"] is None:
            if what != "cpu":
                p.append(f"{name}: the gateway asks for {what}; it needs no accelerator")
            continue
        cfg, probs = mounted_config(docs, dep)
        p += probs
        if cfg is None:
            continue
        part = cfg if spec["config_part"] == "top" else (cfg.get("visual") or {})
        label = "top-level " if spec["config_part"] == "top" else "visual."
        dev = as_list(part.get("device"))
        override = setting(c, *spec["device"])
        if override is not None:
            o = [int(x) for x in override.split(",") if x.strip()]
            if o != dev:
                p.append(f"{name}: {spec['device'][0]} {o} disagrees with the config's {label}device {dev}")
            dev = o
        n = part.get("num_devices", part.get("tensor_parallel_size"))
        if count is None:
            p.append(f"{name}: no whole-number device limit ({what}); cannot match the {label}device list")
            continue
        if not (len(dev) == n == count):
            p.append(
                f"{name}: {label}device has {len(dev)} ids, {label}num_devices is {n}, "
                f"the pod is given {count} x {what}: they must agree"
            )
        if sorted(dev) != list(range(count)):
            p.append(
                f"{name}: {label}device {dev} must be 0..{count - 1}: a pod addresses the "
                f"{count} {what} it is given from 0"
            )
        if what == "cpu":
            req = c.get("resources", {}).get("requests", {}).get("cpu")
            lim = c.get("resources", {}).get("limits", {}).get("cpu")
            if req is None or quantity(req) != quantity(lim):
                p.append(f"{name}: cpu request {req} != limit {lim}: pinned cores need Guaranteed QoS")
        else:
            req = c.get("resources", {}).get("requests", {}).get(what)
            if req is not None and int(req) != count:
                p.append(f"{name}: {what} request {req} != limit {count}")
    return p


def check_model_source(docs: list[dict]) -> list[str]:
    """Every service finds its model on a mounted volume; an emptyDir is filled in-pod."""
    p = []
    pvcs = {x["metadata"]["name"] for x in objects(docs, "PersistentVolumeClaim")}
    for comp, dep in deployments(docs).items():
        name = dep["metadata"]["name"]
        spec = pod_spec(dep)
        c = main_container(dep)
        model = setting(c, *MODEL)
        if not model:
            p.append(f"{name}: no --model / VLM_MODEL")
            continue
        mount = next(
            (m for m in c.get("volumeMounts", []) if model == m["mountPath"] or model.startswith(m["mountPath"].rstrip("/") + "/")),
            None,
        )
        if mount is None:
            p.append(f"{name}: model {model} is on no mounted volume")
            continue
        vol = next((v for v in spec.get("volumes", []) if v["name"] == mount["name"]), None)
        if vol is None:
            p.append(f"{name}: volume {mount['name']} is mounted but not defined")
            continue
        sources = [k for k in vol if k != "name"]
        if len(sources) != 1:
            p.append(f"{name}: volume {vol['name']} has sources {sources}, expected one")
        if "persistentVolumeClaim" in vol and vol["persistentVolumeClaim"]["claimName"] not in pvcs:
            p.append(f"{name}: PVC {vol['persistentVolumeClaim']['claimName']} is not in the output")
        if "emptyDir" in vol:
            makers = []
            for ic in spec.get("initContainers", []):
                cmd = list(ic.get("command", [])) + list(ic.get("args", []))
                if cmd[:2] == ["vlm", "make-model"] and any(m["name"] == vol["name"] for m in ic.get("volumeMounts", [])):
                    makers.append(cmd)
            if not makers:
                p.append(f"{name}: model volume {vol['name']} is an emptyDir and no initContainer runs vlm make-model into it")
            for cmd in makers:
                out = cmd[cmd.index("--out") + 1] if "--out" in cmd else None
                if out != model:
                    p.append(f"{name}: make-model writes {out}, the service reads {model}")
                if "--seed" not in cmd:
                    p.append(f"{name}: make-model without --seed is not deterministic across replicas")
    return p


def check_references(docs: list[dict]) -> list[str]:
    """Non-optional ConfigMaps, Secrets and PVCs that pods use exist in the output."""
    p = []
    have = {(d["kind"], d["metadata"]["name"]) for d in docs}
    # cert-manager makes the Secret a Certificate names.
    have |= {("Secret", d["spec"]["secretName"]) for d in objects(docs, "Certificate")}
    for dep in objects(docs, "Deployment"):
        name = dep["metadata"]["name"]
        spec = pod_spec(dep)
        for v in spec.get("volumes", []):
            for key, kind, field in (("configMap", "ConfigMap", "name"), ("secret", "Secret", "secretName"),
                                     ("persistentVolumeClaim", "PersistentVolumeClaim", "claimName")):
                if key in v and not v[key].get("optional") and (kind, v[key][field]) not in have:
                    p.append(f"{name}: volume {v['name']} needs {kind} {v[key][field]}, not in the output")
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            mounts = {m["name"] for m in c.get("volumeMounts", [])}
            missing = mounts - {v["name"] for v in spec.get("volumes", [])}
            if missing:
                p.append(f"{name}/{c['name']}: mounts undefined volumes {sorted(missing)}")
            # A mount inside a ConfigMap/Secret volume needs a mount point the runtime cannot
            # create in that read-only volume.
            vols = {v["name"]: v for v in spec.get("volumes", [])}
            for outer in c.get("volumeMounts", []):
                ov = vols.get(outer["name"], {})
                if not any(k in ov for k in ("configMap", "secret", "projected", "downwardAPI")):
                    continue
                for inner in c.get("volumeMounts", []):
                    if inner["mountPath"].startswith(outer["mountPath"].rstrip("/") + "/"):
                        p.append(f"{name}/{c['name']}: {inner['mountPath']} is mounted inside read-only volume {outer['name']}")
            for e in c.get("env", []):
                ref = e.get("valueFrom", {})
                for key, kind in (("configMapKeyRef", "ConfigMap"), ("secretKeyRef", "Secret")):
                    if key in ref and not ref[key].get("optional") and (kind, ref[key]["name"]) not in have:
                        p.append(f"{name}: env {e['name']} needs {kind} {ref[key]['name']}")
    return p


def check_pod_hardening(docs: list[dict]) -> list[str]:
    p = []
    for dep in objects(docs, "Deployment"):
        name = dep["metadata"]["name"]
        spec = pod_spec(dep)
        sc = spec.get("securityContext", {})
        if not sc.get("runAsNonRoot") or not sc.get("runAsUser"):
            p.append(f"{name}: pod must set runAsNonRoot and a non-zero runAsUser")
        if sc.get("runAsUser") not in (None, RUN_AS_USER):
            p.append(f"{name}: runAsUser {sc.get('runAsUser')} != the image's user {RUN_AS_USER}")
        if spec.get("automountServiceAccountToken") is not False:
            p.append(f"{name}: mounts a service account token it does not use")
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            csc = c.get("securityContext", {})
            if csc.get("allowPrivilegeEscalation") is not False:
                p.append(f"{name}/{c['name']}: allowPrivilegeEscalation is not false")
            if "ALL" not in csc.get("capabilities", {}).get("drop", []):
                p.append(f"{name}/{c['name']}: does not drop ALL capabilities")
            if csc.get("readOnlyRootFilesystem") is not True:
                p.append(f"{name}/{c['name']}: root filesystem is writable")
            if csc.get("runAsUser") == 0 or csc.get("privileged"):
                p.append(f"{name}/{c['name']}: runs as root or privileged")
            res = c.get("resources", {})
            for kind in ("requests", "limits"):
                for r in ("cpu", "memory"):
                    if r not in res.get(kind, {}):
                        p.append(f"{name}/{c['name']}: no {r} {kind[:-1]}")
            for r, req in res.get("requests", {}).items():
                lim = res.get("limits", {}).get(r)
                if lim is not None and quantity(lim) < quantity(req):
                    p.append(f"{name}/{c['name']}: {r} limit {lim} < request {req}")
            cmd = c.get("command", [None])[0]
            if cmd not in BINARIES:
                p.append(f"{name}/{c['name']}: command {cmd!r} is not one of the image's binaries {sorted(BINARIES)}")
            image = c.get("image", "")
            if not image or image.rsplit("/", 1)[-1].split(":")[0].split("@")[0] != "vlm":
                p.append(f"{name}/{c['name']}: image {image!r} is not the vlm image")
        if "OTEL_SERVICE_NAME" not in {e["name"] for e in main_container(dep).get("env", [])}:
            p.append(f"{name}: no OTEL_SERVICE_NAME")
    return p


def check_configs(docs: list[dict]) -> list[str]:
    """Every service's config file is in a ConfigMap, parses, and is a valid nested config;
    all three read the same one."""
    p, seen = [], {}
    for comp, dep in deployments(docs).items():
        cfg, probs = mounted_config(docs, dep)
        p += probs
        if cfg is None:
            continue
        seen[comp] = cfg
        p += [f"{dep['metadata']['name']}: {m}" for m in check_config_shape(cfg)]
    if len({json.dumps(c, sort_keys=True) for c in seen.values()}) > 1:
        p.append("the services read different configs; one nested config drives all three")
    return p


def all_problems(docs: list[dict], adapter_metrics: set[str]) -> list[str]:
    return (
        check_labels_and_selectors(docs)
        + check_services(docs)
        + check_ports_and_probes(docs)
        + check_gateway_upstreams(docs)
        + check_hpas(docs, adapter_metrics)
        + check_pdbs(docs)
        + check_configs(docs)
        + check_devices(docs)
        + check_model_source(docs)
        + check_references(docs)
        + check_pod_hardening(docs)
        + check_internal_tls(docs)
    )


# --------------------------------------------------------------------------- other files
def adapter_rules() -> list[dict]:
    return yaml.safe_load((K8S / "prometheus-adapter" / "rules.yaml").read_text())["rules"]


def adapter_metric_names(rules: list[dict]) -> set[str]:
    """The custom-metric names the adapter serves (name.as, else the series name)."""
    out = set()
    for r in rules:
        as_ = (r.get("name") or {}).get("as")
        out.add(as_ if as_ else series_name(r["seriesQuery"]))
    return out


def series_name(query: str) -> str:
    m = re.match(r"\s*([a-zA-Z_:][a-zA-Z0-9_:]*)", query)
    if m:
        return m.group(1)
    m = re.search(r'__name__\s*=~?\s*"([^"]+)"', query)
    return m.group(1) if m else ""


def metric_names_in(expr: str) -> set[str]:
    """vlm_* metric names used in a PromQL expression, histogram suffixes removed."""
    out = set()
    for n in re.findall(r"\bvlm_[a-z0-9_]+", expr):
        for suf in ("_bucket", "_sum", "_count"):
            if n.endswith(suf) and n[: -len(suf)] in HISTOGRAMS:
                n = n[: -len(suf)]
        out.add(n)
    return out


def dashboard() -> dict:
    return json.loads((DEPLOY / "grafana" / "vlm-dashboard.json").read_text())


def dashboard_panels(d: dict) -> list[dict]:
    out = []
    for p in d.get("panels", []):
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def mutate(docs: list[dict]) -> list[dict]:
    return copy.deepcopy(docs)
