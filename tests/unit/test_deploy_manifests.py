"""The container recipe and the Kubernetes manifests: valid against the Kubernetes schemas
(offline), and every flag they pass exists in the program they start.
"""

import re
import shlex
from pathlib import Path

import pytest

from deploy.launcher import build_parser as serve_parser
from scheduler_service.main import build_parser as scheduler_parser
from worker.serve.main import build_parser as worker_parser

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
PARSERS = {
    "pagedserve-scheduler": scheduler_parser,
    "pagedserve-worker": worker_parser,
    "serve": serve_parser,
}


def documents():
    yaml = pytest.importorskip("yaml")
    return [
        d
        for path in sorted((DEPLOY / "k8s").glob("*.yaml"))
        for d in yaml.safe_load_all(path.read_text())
        if d
    ]


def flags_of(program: str, text: str) -> set[str]:
    """Long flags in a command line (`--name value` or `--name=value`)."""
    assert program in text, f"{program} is not started here"
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", text.split(program, 1)[1]))


def known_flags(program: str) -> set[str]:
    return {s for a in PARSERS[program]()._actions for s in a.option_strings}


def test_manifests_validate_against_the_kubernetes_schemas():
    kv = pytest.importorskip("kubernetes_validate")
    docs = documents()
    assert {d["kind"] for d in docs} == {
        "Deployment",
        "Service",
        "StatefulSet",
        "ServiceAccount",
        "Role",
        "RoleBinding",
    }
    version = kv.utils.latest_version()
    for doc in docs:
        kv.validate(doc, version, strict=True)  # raises on any unknown or mistyped field


def smg_parser():
    import argparse

    from smg.router_args import RouterArgs

    parser = argparse.ArgumentParser()
    RouterArgs.add_cli_args(parser)
    return parser


def test_the_gateway_manifest_fronts_the_schedulers_with_flags_smg_takes():
    """SMG's container: every flag parses with SMG's own parser; it discovers the scheduler pods
    (the headless Service's selector) on their gRPC port, under a role that may read pods.
    """
    docs = {d["metadata"]["name"] + "/" + d["kind"]: d for d in documents()}
    pod = docs["pagedserve-gateway/Deployment"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["command"] == ["smg", "launch"]
    args = smg_parser().parse_args(container["args"])
    servers = docs["pagedserve-servers/Service"]
    assert servers["spec"]["clusterIP"] == "None"
    selector = dict(s.split("=") for s in args.selector)
    assert selector == servers["spec"]["selector"]
    sched = docs["pagedserve-scheduler/Deployment"]
    assert selector.items() <= sched["spec"]["template"]["metadata"]["labels"].items()
    grpc_port = next(
        p["containerPort"]
        for p in sched["spec"]["template"]["spec"]["containers"][0]["ports"]
        if p["name"] == "grpc"
    )
    assert args.service_discovery and args.service_discovery_port == grpc_port
    assert args.policy == "cache_aware"
    role = docs["pagedserve-gateway/Role"]["rules"][0]
    assert "pods" in role["resources"] and {"list", "watch"} <= set(role["verbs"])
    assert (
        pod["serviceAccountName"] == docs["pagedserve-gateway/RoleBinding"]["subjects"][0]["name"]
    )


def test_every_flag_the_manifests_pass_exists():
    containers = [
        c
        for d in documents()
        if d["kind"] in ("Deployment", "StatefulSet")
        for c in d["spec"]["template"]["spec"]["containers"]
        if c["name"] != "gateway"
    ]
    seen = set()
    for c in containers:
        line = " ".join(c.get("command", []) + c.get("args", []))
        program = re.search(
            r"(?<![\w/-])(pagedserve-scheduler|pagedserve-worker)(?![\w:])", line
        ).group(1)
        seen.add(program)
        unknown = flags_of(program, line) - known_flags(program)
        assert not unknown, f"{c['name']}: {unknown}"
    assert seen == {"pagedserve-scheduler", "pagedserve-worker"}


def test_workers_statefulset_matches_the_schedulers_parallel_layout():
    docs = {d["metadata"]["name"] + "/" + d["kind"]: d for d in documents()}
    sched = docs["pagedserve-scheduler/Deployment"]["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]
    args = dict(a.lstrip("-").split("=", 1) for a in sched)
    workers = docs["pagedserve-worker/StatefulSet"]
    env = {
        e["name"]: e.get("value")
        for e in workers["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert int(env["TP"]) == int(args["tensor-parallel-size"])
    assert workers["spec"]["replicas"] == int(args["tensor-parallel-size"]) * int(
        args["data-parallel-size"]
    )


def test_the_container_recipe_starts_programs_with_flags_that_exist():
    text = (DEPLOY / "Dockerfile").read_text()
    cmd = re.search(r"^CMD (\[.*\])$", text, re.M).group(1)
    line = " ".join(__import__("json").loads(cmd))
    assert not flags_of("serve", line) - known_flags("serve")
    for program in ("pagedserve-scheduler", "pagedserve-worker"):
        for comment in re.findall(rf"^# \w+:\s+({program} .*)$", text, re.M):
            assert not flags_of(program, " ".join(shlex.split(comment))) - known_flags(program), (
                comment
            )


def test_stopping_under_kubernetes_drains_before_anything_is_cut():
    """The scheduler's preStop starts the drain and its grace period outlasts --drain-timeout; the
    workers wait for their draining scheduler (--stop-timeout) within a grace period longer than the
    scheduler's.
    """
    docs = {d["metadata"]["name"] + "/" + d["kind"]: d for d in documents()}
    sched_pod = docs["pagedserve-scheduler/Deployment"]["spec"]["template"]["spec"]
    sched = sched_pod["containers"][0]
    drain = float(dict(a.lstrip("-").split("=", 1) for a in sched["args"])["drain-timeout"])
    assert sched_pod["terminationGracePeriodSeconds"] > drain
    assert "kill -TERM 1" in " ".join(sched["lifecycle"]["preStop"]["exec"]["command"])
    worker_pod = docs["pagedserve-worker/StatefulSet"]["spec"]["template"]["spec"]
    stop = float(
        re.search(r"--stop-timeout (\d+)", " ".join(worker_pod["containers"][0]["args"])).group(1)
    )
    assert drain < stop < worker_pod["terminationGracePeriodSeconds"]
    assert worker_pod["terminationGracePeriodSeconds"] > sched_pod["terminationGracePeriodSeconds"]


def test_the_grafana_dashboard_graphs_series_the_server_exports():
    """Every series the dashboard's queries name is one the scheduler exports (a renamed metric
    would leave a panel empty without a word), and every exported series is on the dashboard.
    """
    import json

    from scheduler_service.runtime.metrics import Metrics

    dash = json.loads((DEPLOY / "grafana" / "pagedserve.json").read_text())
    queried = {
        m
        for p in dash["panels"]
        for t in p["targets"]
        for m in re.findall(r"pagedserve_[a-z_]+", t["expr"])
    }
    series = {
        f.name: {
            f.name + suffix
            for suffix in {
                "counter": ["_total"],
                "gauge": [""],
                "histogram": ["_bucket", "_count", "_sum"],
            }[f.type]
        }
        for f in Metrics().registry.collect()
    }
    assert queried <= set().union(*series.values()), queried - set().union(*series.values())
    assert not [name for name, names in series.items() if not names & queried], (
        "exported but not graphed"
    )
