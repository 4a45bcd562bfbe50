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
        "GetInfo", "GetLoad", "Metrics", "Drain"}
