"""The internal APIs' mutual TLS in the manifests: each service's three files, the Secrets and
cert-manager objects behind them, and the names the certificates must carry.
"""

from __future__ import annotations

import re

from manifest_contract import (
    GATEWAY_UPSTREAMS,
    LM_UPSTREAMS,
    SERVICES,
    deployments,
    main_container,
    objects,
    pod_spec,
    setting,
)


# The internal APIs' mutual TLS: the three files each service reads (flag, env var).
INTERNAL_TLS = {
    "cert": ("--internal-tls-cert", "VLM_INTERNAL_TLS_CERT"),
    "key": ("--internal-tls-key", "VLM_INTERNAL_TLS_KEY"),
    "ca": ("--internal-tls-ca", "VLM_INTERNAL_TLS_CA"),
}
# cert-manager's kinds (CRDs: not in the Kubernetes schemas), the spec keys each may have and
# those it must.
CERT_MANAGER_KINDS = {
    "Certificate": (
        {"secretName", "commonName", "dnsNames", "ipAddresses", "uris", "duration", "renewBefore",
         "privateKey", "usages", "issuerRef", "isCA", "subject", "secretTemplate"},
        {"secretName", "issuerRef"},
    ),
    "Issuer": ({"selfSigned", "ca", "acme", "vault", "venafi"}, set()),
    "ClusterIssuer": ({"selfSigned", "ca", "acme", "vault", "venafi"}, set()),
}
CERT_USAGES = {"digital signature", "key encipherment", "server auth", "client auth", "cert sign", "crl sign"}


def internal_tls(container: dict) -> dict[str, str | None]:
    """The --internal-tls-* files a container is given ({} when none)."""
    got = {k: setting(container, *fe) for k, fe in INTERNAL_TLS.items()}
    return got if any(got.values()) else {}


def check_cert_manager_object(d: dict) -> list[str]:
    """What a schema would say of a cert-manager.io/v1 object (their CRDs are not in the
    Kubernetes schemas kubernetes-validate ships)."""
    kind, name = d["kind"], d["metadata"]["name"]
    if d.get("apiVersion") != "cert-manager.io/v1" or kind not in CERT_MANAGER_KINDS:
        return [f"{kind}/{name}: unknown cert-manager object {d.get('apiVersion')}"]
    allowed, required = CERT_MANAGER_KINDS[kind]
    spec = d.get("spec") or {}
    p = [f"{kind}/{name}: spec.{k} is not a field" for k in spec if k not in allowed]
    p += [f"{kind}/{name}: spec.{k} is required" for k in required if k not in spec]
    if kind != "Certificate" and len(spec) != 1:
        p.append(f"{kind}/{name}: exactly one issuer type, got {sorted(spec)}")
    if kind == "Certificate":
        ref = spec.get("issuerRef") or {}
        if ref.get("kind", "Issuer") not in ("Issuer", "ClusterIssuer") or not ref.get("name"):
            p.append(f"{kind}/{name}: issuerRef {ref} names no Issuer")
        p += [f"{kind}/{name}: usage {u!r} is not one of cert-manager's" for u in spec.get("usages", []) if u not in CERT_USAGES]
    return p


def check_internal_tls(docs: list[dict]) -> list[str]:
    """Mutual TLS is all or nothing: when one service has --internal-tls-*, all three do, from a
    mounted Secret that a Certificate of the output fills, issued by an Issuer of the output;
    vision's and the LM's certificates carry the names their callers dial (--vision/--lm
    dns:///NAME:PORT) and serve as servers; every certificate is for client auth."""
    p = []
    deps = deployments(docs)
    tls = {comp: internal_tls(main_container(dep)) for comp, dep in deps.items() if comp in SERVICES}
    if not any(tls.values()):
        return p
    certs = {d["spec"].get("secretName"): d for d in objects(docs, "Certificate")}
    issuers = {d["metadata"]["name"] for d in objects(docs, "Issuer")}
    for d in objects(docs, "Certificate"):
        ref = d["spec"].get("issuerRef", {})
        if ref.get("kind", "Issuer") == "Issuer" and ref.get("name") not in issuers:
            p.append(f"Certificate/{d['metadata']['name']}: issuer {ref.get('name')} is not in the output")
    for d in objects(docs, "Issuer"):
        ca = (d["spec"].get("ca") or {}).get("secretName")
        if ca and ca not in certs:
            p.append(f"Issuer/{d['metadata']['name']}: CA Secret {ca} comes from no Certificate")
    cert_of: dict[str, dict] = {}
    for comp, files in tls.items():
        name = deps[comp]["metadata"]["name"]
        if not files:
            p.append(f"{name}: no --internal-tls-* while the other services have them")
            continue
        missing = [k for k, v in files.items() if not v]
        if missing:
            p.append(f"{name}: internal TLS lacks {missing}")
            continue
        c = main_container(deps[comp])
        mounts = {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
        secrets = {v["name"]: v["secret"]["secretName"] for v in pod_spec(deps[comp]).get("volumes", []) if "secret" in v}
        held = [(mounts[v], sec) for v, sec in secrets.items() if v in mounts]
        for k, path in files.items():
            under = [sec for mp, sec in held if path.startswith(mp.rstrip("/") + "/")]
            if not under:
                p.append(f"{name}: internal TLS {k} {path} is on no mounted Secret")
                continue
            cert = certs.get(under[0])
            if cert is None:
                p.append(f"{name}: Secret {under[0]} comes from no Certificate")
                continue
            cert_of[comp] = cert
            key = path.rsplit("/", 1)[1]
            if key != {"cert": "tls.crt", "key": "tls.key", "ca": "ca.crt"}[k]:
                p.append(f"{name}: internal TLS {k} is {key}, cert-manager writes it as another key")
    for comp, cert in cert_of.items():
        usages = set(cert["spec"].get("usages", []))
        if "client auth" not in usages:
            p.append(f"Certificate/{cert['metadata']['name']}: {comp} dials others but lacks client auth")
        if comp != "gateway" and "server auth" not in usages:
            p.append(f"Certificate/{cert['metadata']['name']}: {comp} serves but lacks server auth")
    for who, upstreams in (("gateway", GATEWAY_UPSTREAMS), ("lm", LM_UPSTREAMS)):
        if who not in deps:
            continue
        for comp, (flag, env) in upstreams.items():
            addrs = setting(main_container(deps[who]), flag, env) or ""
            m = re.fullmatch(r"dns:///([a-z0-9.-]+):(\d+)", addrs)
            cert = cert_of.get(comp)
            if m and cert and m.group(1) not in cert["spec"].get("dnsNames", []):
                p.append(
                    f"{who} dials {m.group(1)} ({flag}) but Certificate/{cert['metadata']['name']} "
                    f"names {cert['spec'].get('dnsNames')}"
                )
    return p
