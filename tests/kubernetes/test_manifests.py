"""packaging/kubernetes: every manifest against the real schemas, and tied to the config it ships.

No cluster runs here. What is checked, offline:
- each overlay renders with kustomize (`kubectl kustomize`), and every object it yields is valid
  against the Kubernetes API's own OpenAPI schemas (the `kubernetes-validate` package, strict:
  an unknown field is an error, as with `kubectl apply --validate=strict`), for the oldest and
  the newest Kubernetes release the manifests support;
- the LeaderWorkerSet against the openAPIV3Schema of the LeaderWorkerSet CRD (vendored, see
  SOURCE.md), made strict the same way, and its pod templates against Kubernetes' PodTemplate;
- the ConfigMap's config loads with kimi-serve's own loader (what `kimi-serve check` does) and
  its SGLang flags pass SGLang 0.5.23's real parser;
- the probes, grace period, ports, GPUs and mounts agree with that config.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from supervisor import config
from supervisor.config import Config
from supervisor.sglang.argv import build
from supervisor.sglang.options import run_sglang_parser
from testkit.kubernetes import KUBERNETES, OVERLAYS, render
from testkit.paths import REPO_ROOT

# The oldest release the manifests use fields of (PodDisruptionBudget's
# unhealthyPodEvictionPolicy is GA in 1.31), and the newest the validator ships schemas for.
KUBERNETES_VERSIONS = ("1.31.0", kubernetes_validate.latest_version())
CRD = Path(__file__).with_name("leaderworkerset.x-k8s.io_leaderworkersets.yaml")
LWS_API = "leaderworkerset.x-k8s.io/v1"
# Kubernetes' /readyz probe budget must also cover what comes before the load timer starts:
# the GPU cleaning (at most gpus.memory_free_timeout) and the one decode probe after the load.
# A router drain precedes SGLang's own drain at a stop (router.drain_timeout, 30s by default).
ROUTER_DRAIN_DEFAULT = 30.0
LEADER_ENV = {"LWS_WORKER_INDEX": "0", "LWS_LEADER_ADDRESS": "kimi-serve-0.kimi-serve.default"}
WORKER_ENV = {**LEADER_ENV, "LWS_WORKER_INDEX": "1"}


# ------------------------------------------------------------------------------ helpers


def objects(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = objects(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def pod_templates(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every pod template in an overlay, by role."""
    out: dict[str, dict[str, Any]] = {}
    for d in docs:
        if d["kind"] == "StatefulSet":
            out["one-node"] = d["spec"]["template"]
        elif d["kind"] == "LeaderWorkerSet":
            lwt = d["spec"]["leaderWorkerTemplate"]
            out["leader"] = lwt["leaderTemplate"]
            out["worker"] = lwt["workerTemplate"]
    return out


def container(template: dict[str, Any]) -> dict[str, Any]:
    (c,) = template["spec"]["containers"]
    assert c["name"] == "kimi-serve"
    return dict(c)


def ports(c: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in c.get("ports", [])}


def configmap_text(docs: list[dict[str, Any]]) -> str:
    (cm,) = [d for d in objects(docs, "ConfigMap") if d["metadata"]["name"].startswith("kimi-")]
    return str(cm["data"]["kimi-serve.yaml"])


def load_config(overlay: str, docs: list[dict[str, Any]], env: dict[str, str]) -> Config:
    """What `kimi-serve check` does with the ConfigMap's file, in the pod's environment."""
    mp = pytest.MonkeyPatch()
    try:
        for name, value in env.items():
            mp.setenv(name, value)
        return config.parse(configmap_text(docs), f"{overlay}: ConfigMap kimi-serve.yaml")
    finally:
        mp.undo()


def configs(rendered: dict[str, list[dict[str, Any]]]) -> Iterator[tuple[str, Config]]:
    """(role, its config) for every pod template."""
    yield "one-node", load_config("one-node", rendered["one-node"], {})
    yield "leader", load_config("multi-node", rendered["multi-node"], LEADER_ENV)
    yield "worker", load_config("multi-node", rendered["multi-node"], WORKER_ENV)


def templates(rendered: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    return {**pod_templates(rendered["one-node"]), **pod_templates(rendered["multi-node"])}


def strict(schema: Any) -> Any:
    """The CRD schema as the API server applies it with strict field validation: an object
    with listed properties admits no others, unless it preserves unknown fields."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def lws_schema() -> dict[str, Any]:
    # 1.3 MB of YAML: libyaml's loader reads it in 0.1 s, the pure-Python one in 1.5 s.
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load(CRD.read_text(), Loader=loader)
    assert crd["spec"]["group"] == "leaderworkerset.x-k8s.io"
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    assert v1["served"] and v1["storage"]
    schema = strict(v1["schema"]["openAPIV3Schema"])
    jsonschema.Draft4Validator.check_schema(schema)
    return dict(schema)


def lws_errors(schema: dict[str, Any], doc: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft4Validator(schema)
    return [
        f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}"
        for e in validator.iter_errors(doc)
    ]


def k8s_errors(doc: dict[str, Any], version: str) -> list[str]:
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{'.'.join(str(p) for p in exc.path)}: {exc.message}"]
    return []


# ------------------------------------------------------------------------------ schemas


def test_each_overlay_renders_what_it_should(rendered: dict[str, list[dict[str, Any]]]) -> None:
    common = ["ConfigMap", "NetworkPolicy", "PodDisruptionBudget", "Service", "Service"]
    kinds = {o: sorted(d["kind"] for d in docs) for o, docs in rendered.items()}
    assert kinds == {
        "one-node": sorted([*common, "StatefulSet"]),
        "multi-node": sorted([*common, "LeaderWorkerSet"]),
    }


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_builtin_object_is_valid_for_kubernetes(
    rendered: dict[str, list[dict[str, Any]]], overlay: str, version: str
) -> None:
    checked = 0
    for doc in rendered[overlay]:
        if doc["apiVersion"] == LWS_API:
            continue
        assert k8s_errors(doc, version) == [], f"{doc['kind']}/{doc['metadata']['name']}"
        checked += 1
    assert checked == (6 if overlay == "one-node" else 5)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_manifest_file_is_valid_on_its_own(version: str) -> None:
    # Each file is a complete object, readable (and applicable) without kustomize.
    files = [
        f
        for f in sorted(KUBERNETES.rglob("*.yaml"))
        if f.name not in ("kustomization.yaml", "kustomizeconfig.yaml", "kimi-serve.yaml")
    ]
    assert len(files) == 7
    for f in files:
        for doc in yaml.safe_load_all(f.read_text()):
            if doc["apiVersion"] != LWS_API:
                assert k8s_errors(doc, version) == [], f.name


def test_the_leaderworkerset_matches_its_crd(
    rendered: dict[str, list[dict[str, Any]]], lws_schema: dict[str, Any]
) -> None:
    lws = one(rendered["multi-node"], "LeaderWorkerSet")
    assert lws["apiVersion"] == LWS_API
    assert lws_errors(lws_schema, lws) == []
    # The file as written, before kustomize fills in the ConfigMap name and the image.
    raw = yaml.safe_load((KUBERNETES / "multi-node" / "leaderworkerset.yaml").read_text())
    assert lws_errors(lws_schema, raw) == []


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_leaderworkerset_pod_templates_are_valid_pod_templates(
    rendered: dict[str, list[dict[str, Any]]], version: str
) -> None:
    # The CRD copies PodTemplateSpec's schema; check against Kubernetes' own as well.
    for role in ("leader", "worker"):
        template = pod_templates(rendered["multi-node"])[role]
        doc = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": role},
            "template": template,
        }
        assert k8s_errors(doc, version) == [], role


def test_the_validators_reject_what_a_cluster_would(
    rendered: dict[str, list[dict[str, Any]]], lws_schema: dict[str, Any]
) -> None:
    """The checks above can fail: typical mistakes are caught by each validator."""
    lws = one(rendered["multi-node"], "LeaderWorkerSet")
    bad = copy.deepcopy(lws)
    bad["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "RecreateGroupOnRestart"
    assert any("is not one of" in e for e in lws_errors(lws_schema, bad))
    bad = copy.deepcopy(lws)
    bad["spec"]["leaderWorkerTemplate"]["sise"] = 2
    assert any("sise" in e for e in lws_errors(lws_schema, bad))
    bad = copy.deepcopy(lws)
    leader = bad["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]
    leader["startupProbe"]["failureThreshold"] = "200"
    assert lws_errors(lws_schema, bad)

    sts = one(rendered["one-node"], "StatefulSet")
    bad = copy.deepcopy(sts)
    bad["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    assert k8s_errors(bad, KUBERNETES_VERSIONS[-1])
    bad = copy.deepcopy(sts)
    bad["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "120s"
    assert k8s_errors(bad, KUBERNETES_VERSIONS[-1])


# ------------------------------------------------------------------------------ the config


def test_the_configmap_config_checks_ok(rendered: dict[str, list[dict[str, Any]]]) -> None:
    got = {role: cfg for role, cfg in configs(rendered)}
    assert got["one-node"].restart.mode == "relaunch"
    for role in ("leader", "worker"):
        assert got[role].restart.mode == "exit", role
    assert got["leader"].sglang.args["node-rank"] == "0"
    assert got["worker"].sglang.args["node-rank"] == "1"
    assert got["worker"].sglang.args["dist-init-addr"] == "kimi-serve-0.kimi-serve.default:20000"
    # SGLang's environment as the shipped host config has it (SPT_NOENV keeps the owner marker
    # readable in the titled workers, docs/sglang.md).
    shipped = config.load(str(REPO_ROOT / "etc" / "kimi-serve.yaml")).sglang.env
    assert shipped["SPT_NOENV"] == "1"
    for role, cfg in got.items():
        assert cfg.sglang.env == shipped, role


def test_the_multi_node_config_needs_the_lws_environment(
    rendered: dict[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in LEADER_ENV:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(config.ConfigError) as err:
        config.parse(configmap_text(rendered["multi-node"]), "kimi-serve.yaml")
    assert {i.path for i in err.value.issues} == {
        "sglang.args.node-rank",
        "sglang.args.dist-init-addr",
        "group.leader",
    }


def test_the_worker_s_readiness_is_gated_on_the_leader_with_the_secret_token(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    got = dict(configs(rendered))
    leader, worker = got["leader"], got["worker"]
    # The worker polls the leader's admin endpoint (LWS_LEADER_ADDRESS, admin.listen's port):
    # its /readyz follows the leader's decode-verified readiness of the same launch.
    leader_admin = f"http://{LEADER_ENV['LWS_LEADER_ADDRESS']}:{leader.admin.port}"
    assert worker.group.role == "follower" and worker.group.peers == (leader_admin,)
    assert worker.group.coordinated
    # The leader polls no one but answers GET /group.
    assert leader.group.role == "leader" and leader.group.peers == () and leader.group.answers
    assert worker.admin.port == leader.admin.port
    # One token on both pods, presented by the worker and checked by the leader.
    assert worker.group.token_file == worker.admin.token_file == leader.admin.token_file
    for role, cfg in (("leader", leader), ("worker", worker)):
        assert cfg.admin.allow_remote is True, role  # the kubelet and the worker reach it
        template = templates(rendered)[role]
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        mounts = {m["mountPath"]: m for m in container(template)["volumeMounts"]}
        token = Path(cfg.admin.token_file)
        mount = mounts[str(token.parent)]
        assert mount["readOnly"] is True, role
        secret = volumes[mount["name"]]["secret"]
        # Owner-only: kimi-serve refuses a token file group or others may read.
        assert secret["defaultMode"] == 0o400, role
        assert secret["secretName"] == "kimi-serve-admin-token", role
        assert [i["path"] for i in secret["items"]] == [token.name], role
    # The worker reaches the leader's admin port: the replica's pods may talk on every port.
    policy = one(rendered["multi-node"], "NetworkPolicy")["spec"]
    labels = templates(rendered)["worker"]["metadata"]["labels"]
    assert any(
        "ports" not in r
        and any(
            f.get("podSelector", {}).get("matchLabels", {}).items() <= labels.items()
            for f in r.get("from", [])
        )
        for r in policy["ingress"]
    )


@pytest.mark.slow
def test_the_configmap_flags_pass_sglang_s_own_parser(
    rendered: dict[str, list[dict[str, Any]]], sglang_python: str
) -> None:
    requests = []
    for _role, cfg in configs(rendered):
        for profile in cfg.profile_names:
            spec = build(cfg, profile)
            assert spec.argv[1:3] == ("-m", "sglang.launch_server")
            requests.append((spec.argv[3:], {}))
    report = run_sglang_parser(sglang_python, requests)
    assert report.failure is None, report.failure
    assert report.version == "0.5.23"
    assert len(report.verdicts) == len(requests) == 6
    for (argv, _), verdict in zip(requests, report.verdicts, strict=True):
        assert verdict.ok, f"{' '.join(argv)}: {verdict.errors}"


# ------------------------------------------------------------------------------ ties


def test_startup_probe_covers_cleaning_a_whole_load_and_a_probe(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    t = templates(rendered)
    for role, cfg in configs(rendered):
        probe = container(t[role])["startupProbe"]
        budget = probe["periodSeconds"] * probe["failureThreshold"]
        needed = (
            cfg.gpus.memory_free_timeout + cfg.readiness.load_timeout + cfg.readiness.probe.timeout
        )
        assert budget >= needed, f"{role}: {budget}s < {needed}s"
        assert budget >= cfg.readiness.load_timeout
        assert probe["httpGet"]["path"] == "/readyz"


def test_readiness_and_liveness_probe_the_daemon(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    t = templates(rendered)
    assert set(t) == {"one-node", "leader", "worker"}
    for role, cfg in configs(rendered):
        c = container(t[role])
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz", role
        assert c["livenessProbe"]["httpGet"]["path"] == "/livez", role
        for name in ("startupProbe", "readinessProbe", "livenessProbe"):
            port = c[name]["httpGet"]["port"]
            assert ports(c)[port] == cfg.admin.port, (role, name)
            # A probe answer is local work on the daemon's loop; never the SGLang probe's 30s.
            assert c[name]["timeoutSeconds"] < cfg.readiness.probe.timeout
        # A stalled loop is noticed within a minute; one slow answer never kills the pod.
        live = c["livenessProbe"]
        assert live["failureThreshold"] >= 3
        assert live["periodSeconds"] * live["failureThreshold"] <= 120


def test_grace_period_outlasts_router_and_sglang_drains(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    t = templates(rendered)
    for role, cfg in configs(rendered):
        router = getattr(cfg, "router", None)
        router_drain = getattr(router, "drain_timeout", ROUTER_DRAIN_DEFAULT)
        grace = t[role]["spec"]["terminationGracePeriodSeconds"]
        assert grace > router_drain + cfg.stop.drain_timeout + 10, role


def test_ports_match_the_config(rendered: dict[str, list[dict[str, Any]]]) -> None:
    t = templates(rendered)
    for role, cfg in configs(rendered):
        p = ports(container(t[role]))
        assert p["admin"] == cfg.admin.port, role
        # Probes and the Service reach the pod address, not loopback.
        assert cfg.admin.host == "0.0.0.0", role
        if role != "worker":  # a follower serves no API
            assert p["sglang"] == cfg.sglang.port, role
            assert cfg.sglang.host == "0.0.0.0", role
    # The rendezvous port the workers dial is the leader's declared one.
    leader = dict(configs(rendered))["leader"]
    addr = str(leader.sglang.args["dist-init-addr"])
    assert int(addr.rpartition(":")[2]) == ports(container(t["leader"]))["dist-init"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_target_declared_ports_on_the_right_pods(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    docs = rendered[overlay]
    t = pod_templates(docs)
    services = {s["metadata"]["name"]: s for s in objects(docs, "Service")}
    assert set(services) == {"kimi-serve", "kimi-serve-pods"}
    traffic = services["kimi-serve"]["spec"]
    assert [p["targetPort"] for p in traffic["ports"]] == ["sglang"]
    # Only ready pods carry traffic; the admin Service lists every pod for Prometheus.
    assert not traffic.get("publishNotReadyAddresses", False)
    assert services["kimi-serve-pods"]["spec"]["publishNotReadyAddresses"] is True
    if overlay == "one-node":
        labels = t["one-node"]["metadata"]["labels"]
        for s in services.values():
            assert s["spec"]["selector"].items() <= labels.items()
            for p in s["spec"]["ports"]:
                assert p["targetPort"] in ports(container(t["one-node"]))
        assert one(docs, "StatefulSet")["spec"]["serviceName"] == "kimi-serve-pods"
    else:
        # The LeaderWorkerSet controller labels its pods with its name and the worker index
        # (0: the leader); traffic goes to the leader only.
        lws = one(docs, "LeaderWorkerSet")
        name = lws["metadata"]["name"]
        assert traffic["selector"] == {
            "leaderworkerset.sigs.k8s.io/name": name,
            "leaderworkerset.sigs.k8s.io/worker-index": "0",
        }
        assert services["kimi-serve-pods"]["spec"]["selector"] == {
            "leaderworkerset.sigs.k8s.io/name": name
        }
        assert "sglang" in ports(container(t["leader"]))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policy_and_pdb_select_the_pods(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    docs = rendered[overlay]
    policy = one(docs, "NetworkPolicy")["spec"]
    pdb = one(docs, "PodDisruptionBudget")["spec"]
    for role, template in pod_templates(docs).items():
        labels = template["metadata"]["labels"]
        assert policy["podSelector"]["matchLabels"].items() <= labels.items(), role
        if overlay == "one-node":
            assert pdb["selector"]["matchLabels"].items() <= labels.items()
    if overlay == "multi-node":
        lws = one(docs, "LeaderWorkerSet")
        assert pdb["selector"]["matchLabels"] == {
            "leaderworkerset.sigs.k8s.io/name": lws["metadata"]["name"]
        }
    assert pdb["maxUnavailable"] == 1
    # The admin port is open only to the monitoring namespace and the replica's own pods.
    admin_rules = [
        r for r in policy["ingress"] if r.get("ports") == [{"port": "admin", "protocol": "TCP"}]
    ]
    assert len(admin_rules) == 1 and admin_rules[0]["from"]


def test_the_leaderworkerset_relaunches_the_group_together(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    docs = rendered["multi-node"]
    lws = one(docs, "LeaderWorkerSet")["spec"]
    lwt = lws["leaderWorkerTemplate"]
    assert lwt["restartPolicy"] == "RecreateGroupOnPodRestart"
    # Workers must join the rendezvous before the leader can be ready.
    assert lws["startupPolicy"] == "LeaderCreated"
    for role, cfg in configs(rendered):
        if role == "one-node":
            continue
        assert lwt["size"] == cfg.sglang.args["nnodes"] == 2
        assert cfg.restart.mode == "exit"
        # Each node brings tp-size / nnodes GPUs.
        gpus = container(templates(rendered)[role])["resources"]["limits"]["nvidia.com/gpu"]
        assert gpus * lwt["size"] == config.tp_size(cfg.sglang.args)
    one_node = dict(configs(rendered))["one-node"]
    c = container(templates(rendered)["one-node"])
    assert c["resources"]["limits"]["nvidia.com/gpu"] == config.tp_size(one_node.sglang.args)
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 8


def test_the_pod_runs_kimi_serve_on_the_mounted_config(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    for overlay, docs in rendered.items():
        (cm,) = [d for d in objects(docs, "ConfigMap") if d["metadata"]["name"].startswith("kimi-")]
        # kustomize's content hash: a config change rolls the pods.
        assert re.fullmatch(r"kimi-serve-config-[a-z0-9]{10}", cm["metadata"]["name"]), overlay
        for role, template in pod_templates(docs).items():
            c = container(template)
            assert c["command"][:3] == ["kimi-serve", "run", "--config"], role
            assert c["image"] == "registry.example.com/kimi-serve:0.1.0", role
            volumes = {v["name"]: v for v in template["spec"]["volumes"]}
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            path = Path(c["command"][3])
            assert volumes[mounts[str(path.parent)]]["configMap"]["name"] == cm["metadata"]["name"]
            assert path.name in cm["data"]
            cfg = load_config(overlay, docs, WORKER_ENV)
            # The daemon's own directory inside the emptyDir (the volume's root is 0777).
            state_volume = volumes[mounts[str(Path(cfg.state_dir).parent)]]
            assert state_volume.get("emptyDir") == {}, role
            model_root = next(m for m in mounts if cfg.sglang.model_path.startswith(m + "/"))
            assert "persistentVolumeClaim" in volumes[mounts[model_root]], role
            shm = volumes[mounts["/dev/shm"]]["emptyDir"]
            assert shm["medium"] == "Memory" and shm["sizeLimit"].endswith("Gi"), role
            # The pause container reaps SGLang's orphans; kimi-serve is not PID 1.
            assert template["spec"]["shareProcessNamespace"] is True, role


def test_the_pods_are_confined(rendered: dict[str, list[dict[str, Any]]]) -> None:
    # The pod runs model code (trust_remote_code): no API token, no capabilities, no setuid
    # gain, the runtime's seccomp profile, a read-only image with writable volumes where the
    # daemon and SGLang write; non-root where the token's owner allows (docs/kubernetes.md).
    for role, template in templates(rendered).items():
        spec = template["spec"]
        assert spec["automountServiceAccountToken"] is False, role
        pod = spec["securityContext"]
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}, role
        c = container(template)
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False, role
        assert sc["capabilities"] == {"drop": ["ALL"]}, role
        assert "add" not in sc["capabilities"] and not sc.get("privileged"), role
        assert sc["readOnlyRootFilesystem"] is True, role
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        cfg = dict(configs(rendered))[role]
        env = {e["name"]: e.get("value") for e in c["env"]}
        for writable in (str(Path(cfg.state_dir).parent), "/tmp", "/dev/shm", env["HOME"]):
            mount = mounts[writable]
            assert not mount.get("readOnly"), (role, writable)
            assert "emptyDir" in volumes[mount["name"]], (role, writable)
        if role == "one-node":
            assert pod["runAsNonRoot"] is True and pod["runAsUser"] > 0, role
            assert pod["runAsGroup"] > 0, role
            # The cache claim is writable for the non-root user (the caches persist).
            assert pod["fsGroup"] == pod["runAsGroup"], role
        else:
            assert "fsGroup" not in pod, role  # it would make the Secret's token group-readable
            # The Secret's token file is root's, 0400: read by uid 0 with no capability.
            assert pod["runAsUser"] == 0 and sc["capabilities"]["drop"] == ["ALL"], role
            assert "/etc/kimi-serve-token" in mounts, role


def test_rendering_is_deterministic() -> None:
    assert render("multi-node") == render("multi-node")


def test_the_token_directory_is_the_daemons_own_inside_a_0777_emptydir(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """The kubelet makes an emptyDir mode 0777 (pkg/volume/emptydir): the token rules refuse
    that as the token's directory, so state_dir is a directory the daemon makes inside it."""
    from supervisor import secret_files as admin_token
    from supervisor.process.identity import RecordStore

    for role, cfg in configs(rendered):
        mount = tmp_path / role
        mount.mkdir()
        mount.chmod(0o777)  # as the kubelet leaves an emptyDir
        with pytest.raises(admin_token.TokenFileError):
            admin_token.check_directory(mount)
        assert Path(cfg.state_dir).parent != Path(cfg.state_dir)
        state = mount / Path(cfg.state_dir).name
        RecordStore(str(state)).check_writable()  # what the daemon does first at start
        admin_token.check_directory(state)  # then the token can go there


def test_the_cache_volume_as_the_kubelet_leaves_it_passes_the_cache_owner_check(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """The check `check`, `preflight` and the daemon make of warm.cache_dir (a directory
    another user can write is refused: SGLang runs the kernels it finds there), held to each
    pod as the kubelet makes its volumes: the `cache` claim root's and, with fsGroup, of that
    group, setgid and group-writable (2775); an emptyDir 0777."""
    from supervisor.sglang import caches

    for role, template in templates(rendered).items():
        spec = template["spec"]
        pod = spec["securityContext"]
        c = container(template)
        cfg = dict(configs(rendered))[role]
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        claims = {t["metadata"]["name"] for t in _claim_templates(rendered, role)}
        name = mounts[cfg.warm.cache_dir]
        # A claim of its own (not an emptyDir, which is 0777 and would be refused).
        assert name in claims and name not in volumes, (role, name)
        mount = tmp_path / role
        mount.mkdir()
        group = pod.get("fsGroup", 0)
        if os.geteuid() == 0:
            os.chown(mount, 0, group)
        mount.chmod(0o2775 if "fsGroup" in pod else 0o755)
        st = mount.stat()
        uids = frozenset({0, pod["runAsUser"]})
        gids = frozenset({pod.get("runAsGroup", 0), group, st.st_gid})
        assert caches.owner_problem(str(mount), uids, gids) is None, role
        empty = tmp_path / f"{role}-emptydir"
        empty.mkdir()
        empty.chmod(0o777)  # what the kubelet makes of an emptyDir
        assert "writable by every user" in (caches.owner_problem(str(empty), uids, gids) or "")


def _claim_templates(rendered: dict[str, list[dict[str, Any]]], role: str) -> list[dict[str, Any]]:
    if role == "one-node":
        return one(rendered["one-node"], "StatefulSet")["spec"]["volumeClaimTemplates"]
    lws = one(rendered["multi-node"], "LeaderWorkerSet")
    return lws["spec"]["leaderWorkerTemplate"].get("volumeClaimTemplates", [])
