"""The stubs in worker/gen are what proto/ generates now: a changed .proto without a rebuild fails here."""

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_generated_stubs_are_current(tmp_path):
    spec = importlib.util.spec_from_file_location("proto_generate", REPO / "proto" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    fresh = generate.generate(tmp_path)
    assert fresh, "protoc generated nothing"
    for path in fresh:
        installed = REPO / path.relative_to(tmp_path)
        assert installed.exists(), f"{installed} missing: reinstall (pip install -e .) to run the build"
        assert installed.read_bytes() == path.read_bytes(), (
            f"{installed} is stale: proto/ changed since the last build; reinstall (pip install -e .)")


def test_contract_names_are_stable():
    from worker.gen.cyllm.inference.v1 import inference_pb2 as pb

    service = pb.DESCRIPTOR.services_by_name["InferenceService"]
    method = service.methods_by_name["StreamPredict"]
    assert service.full_name == "cyllm.inference.v1.InferenceService"
    assert method.server_streaming and not method.client_streaming
    assert set(pb.DESCRIPTOR.services_by_name["WorkerControl"].methods_by_name) == {
        "GetInfo", "GetLoad", "Metrics", "Drain", "CacheEvents", "PrefixHashes"}


def test_a_wheel_from_a_fresh_tree_carries_the_stubs_and_the_registry(tmp_path):
    """`pip install .` (the container build) from a tree without worker/gen: the package discovery
    must see the stubs the build writes, and `cy-llm setup` needs the registry inside the wheel."""
    import shutil
    import subprocess
    import sys
    import zipfile

    tree = tmp_path / "src"
    tree.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(REPO / name, tree / name)
    for folder in ("proto", "worker", "deploy"):
        shutil.copytree(REPO / folder, tree / folder, ignore=shutil.ignore_patterns("gen", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "dist"), str(tree)], check=True)
    names = zipfile.ZipFile(next((tmp_path / "dist").glob("cy_llm-*.whl"))).namelist()
    assert "worker/gen/cyllm/inference/v1/inference_pb2_grpc.py" in names
    assert {"worker/deps/dependency_registry.json", "worker/deps/dependency_registry.schema.json"} <= set(names)
