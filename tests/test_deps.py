"""The dependency registry, hardware detection from recorded answers, setup's lock, and doctor."""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from worker.config_loader import load_config
from worker.deps.environment import Lock, verify_environment
from worker.deps.hardware import HardwareProfile, detect_hardware, flags_within
from worker.deps.install import pip_install_command, write_lock
from worker.deps.registry import DEFAULT_REGISTRY, WORKER_ENGINES, Registry, RegistryError, apply_preset

REPO = Path(__file__).resolve().parent.parent
GIB = 1 << 30
AVX512 = "processor : 0\nflags : fpu sse2 avx avx2 avx512f avx512_bf16\n"
AVX2 = "processor : 0\nflags : fpu sse2 avx avx2\n"
ARM = "processor : 0\nFeatures : fp asimd sve\n"


class RecordedNVML:
    """Answers recorded from NVML (pynvml's API) on real machines, replayed."""

    def __init__(self, gpus, driver="580.159.04"):
        self.gpus, self.driver = gpus, driver

    def nvmlInit(self):
        if self.gpus is None:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        return self.gpus[index]

    def nvmlDeviceGetName(self, gpu):
        return gpu["name"].encode()

    def nvmlDeviceGetMemoryInfo(self, gpu):
        return type("Memory", (), {"total": gpu["memory"]})()

    def nvmlDeviceGetCudaComputeCapability(self, gpu):
        return gpu["cc"]

    def nvmlSystemGetDriverVersion(self):
        return self.driver


H100 = {"name": "NVIDIA H100 80GB HBM3", "memory": 81559 * (1 << 20), "cc": (9, 0)}
A100 = {"name": "NVIDIA A100-SXM4-40GB", "memory": 40960 * (1 << 20), "cc": (8, 0)}
RTX4090 = {"name": "NVIDIA GeForce RTX 4090", "memory": 24564 * (1 << 20), "cc": (8, 9)}


@pytest.fixture(scope="module")
def registry():
    return Registry.load()


def no_tools(*args, **kwargs):
    raise AssertionError("vendor tools must not be called when none is installed")


@pytest.mark.parametrize(("gpus", "cpuinfo", "machine", "profile"), [
    ([H100], AVX512, "x86_64", "nvidia-hopper"),
    ([A100], AVX2, "x86_64", "nvidia-ampere"),
    ([RTX4090], AVX2, "x86_64", "nvidia-ada"),
    ([H100, A100], AVX512, "x86_64", "nvidia-ampere"),
    (None, AVX512, "x86_64", "cpu-x86_64-avx512"),
    (None, AVX2, "x86_64", "cpu-x86_64-avx2"),
    ([], ARM, "aarch64", "cpu-arm64"),
], ids=["h100", "a100", "4090", "mixed", "none-avx512", "none-avx2", "none-arm64"])
def test_detection_from_recorded_nvml(registry, monkeypatch, gpus, cpuinfo, machine, profile):
    monkeypatch.setattr("shutil.which", lambda name: None)
    hardware = detect_hardware(nvml=RecordedNVML(gpus), cpuinfo=cpuinfo, machine=machine, run=no_tools)
    assert registry.match(hardware) == profile
    if gpus:
        assert hardware.vendor == "nvidia" and hardware.driver == "580.159.04"
        assert hardware.gpus[0].name == gpus[0]["name"] and hardware.gpus[0].memory_bytes > 20 * GIB
    if gpus and len(gpus) > 1:
        assert "mixed GPUs" in hardware.notes[0]


def test_amd_and_ascend_from_their_tools(registry, monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: f"/usr/bin/{name}" if name in ("rocm-smi", "npu-smi") else None)
    rocm = json.dumps({"card0": {"Card Series": "AMD Instinct MI300X", "VRAM Total Memory (B)": str(192 * GIB)}})
    npu = "NPU ID : 0\nProduct Name : Ascend 910B\nNPU ID : 1\nProduct Name : Ascend 910B\n"

    def run(command, **kwargs):
        out = rocm if command[0] == "rocm-smi" else npu
        return subprocess.CompletedProcess(command, 0, out, "")

    amd = detect_hardware(nvml=RecordedNVML(None), cpuinfo=AVX2, machine="x86_64", run=run)
    assert (amd.vendor, amd.gpus[0].name, amd.gpus[0].memory_bytes) == ("amd", "AMD Instinct MI300X", 192 * GIB)
    assert registry.match(amd) == "amd-rocm"
    monkeypatch.setattr("shutil.which", lambda name: "/usr/bin/npu-smi" if name == "npu-smi" else None)
    ascend = detect_hardware(nvml=RecordedNVML(None), cpuinfo=ARM, machine="aarch64", run=run)
    assert (ascend.vendor, len(ascend.gpus)) == ("ascend", 2)
    assert registry.match(ascend) == "ascend"


def test_every_pair_resolves_or_is_refused_with_a_reason(registry):
    for profile in registry.profiles:
        for engine in WORKER_ENGINES:
            try:
                requirements = registry.resolve(profile, engine)
            except RegistryError as error:
                reason = registry.refusal(profile, engine)
                assert reason, f"({profile}, {engine}) neither resolves nor is refused"
                assert reason in str(error) and "engines for" in str(error)
                continue
            assert requirements.requirements and registry.refusal(profile, engine) is None
            assert all(("==" in r) for r in requirements.requirements), "requirement sets are pinned"
            assert registry.preset(profile, engine) is not None, f"no preset for ({profile}, {engine})"


def test_vendor_shortcuts_pick_the_detected_profile(registry):
    here = HardwareProfile("cpu", "x86_64", frozenset({"avx2", "avx512f"}))
    assert registry.pick_profile("cpu", here) == "cpu-x86_64-avx512"
    assert registry.pick_profile("auto", here) == "cpu-x86_64-avx512"
    assert registry.pick_profile("nvidia-hopper", here) == "nvidia-hopper"
    with pytest.raises(RegistryError, match="unknown hardware 'tpu'"):
        registry.pick_profile("tpu", here)
    with pytest.raises(RegistryError, match="TensorRT-LLM runs on NVIDIA GPUs only"):
        registry.resolve("cpu-x86_64-avx2", "trtllm")


def cpu_requirement_sets(registry):
    sets = {}
    for profile in ("cpu-x86_64-avx512", "cpu-x86_64-avx2"):
        for engine in WORKER_ENGINES:
            if registry.refusal(profile, engine) is None:
                requirements = registry.resolve(profile, engine)
                sets.setdefault(requirements.requirements, requirements)
    return list(sets.values())


@pytest.mark.parametrize("index", range(2), ids=["transformers-native", "vllm"])
def test_cpu_sets_pass_pips_resolver(registry, tmp_path, index):
    """pip resolves the pinned set for real (--dry-run --report): versions that fit together."""
    requirements = cpu_requirement_sets(registry)[index]
    lock = write_lock(tmp_path / "requirements.lock", requirements, registry)
    report = tmp_path / "report.json"
    command = pip_install_command(lock, requirements, os.environ, dry_run=True, report=report)
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    installed = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    for line in requirements.requirements:
        name, _, version = line.partition("==")
        assert installed[name.lower()] == version, f"pip chose {installed.get(name.lower())} for {line}"


def bad_registry(tmp_path, mutate):
    data = json.loads(DEFAULT_REGISTRY.read_text())
    mutate(data)
    path = tmp_path / "dependency_registry.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(("mutate", "where"), [
    (lambda d: d["hardware"]["nvidia-hopper"].update(vendor="intel"), "$.hardware.nvidia-hopper.vendor"),
    (lambda d: d["matrix"][0]["requirements"].__setitem__(1, "transformers>>5"), "$.matrix[0].requirements[1]"),
    (lambda d: d["matrix"][2]["hardware"].__setitem__(0, "cpu-riscv"), "$.matrix[2].hardware[0]"),
    (lambda d: d["matrix"].append(copy.deepcopy(d["matrix"][0])), "$.matrix[13]"),
    (lambda d: d["presets"][1].pop("block_size"), "$.presets[1]"),
    (lambda d: d["engines"]["vllm"].update(version="latest"), "$.engines.vllm.version"),
    (lambda d: d["matrix"][5]["packages"].__setitem__(0, "vllm-tpu"), "$.matrix[5].packages[0]"),
], ids=["vendor", "requirement", "unknown-profile", "duplicate-pair", "missing-key", "version", "unknown-package"])
def test_bad_registry_files_are_rejected_with_the_path(tmp_path, mutate, where):
    with pytest.raises(RegistryError) as error:
        Registry.load(bad_registry(tmp_path, mutate))
    assert where in str(error.value)


def test_not_json_and_missing_files(tmp_path):
    (tmp_path / "r.json").write_text("{nope")
    with pytest.raises(RegistryError, match="not JSON"):
        Registry.load(tmp_path / "r.json")
    with pytest.raises(RegistryError, match="no registry at"):
        Registry.load(tmp_path / "absent.json")


def test_doctor_catches_a_wrong_torch_and_a_missing_package():
    lock = Lock(("torch==2.13.0+cpu", "gguf==0.19.0", "accelerate==1.15.0"), {"remove-after-install": "torchvision"})
    versions = {"torch": "2.15.0", "accelerate": "1.15.0", "torchvision": "0.28.0"}
    checks = verify_environment(lock, HardwareProfile("cpu", "x86_64"), "/tmp/cyllm-doctor/w.sock",
                                installed=versions.get, torch_probe=lambda: {
                                    "version": "2.15.0", "cuda": "12.9", "hip": None, "cuda_available": False})
    failed = {c.name: c.detail for c in checks if not c.ok}
    assert failed["torch"] == "2.15.0 installed, lock wants ==2.13.0+cpu"
    assert failed["gguf"].startswith("missing")
    assert "torchvision" in failed and "torch device" in failed  # a CUDA build on a CPU host
    assert "accelerate" not in failed


def test_doctor_wants_cuda_torch_on_nvidia_hosts():
    gpu_host = HardwareProfile("nvidia", "x86_64", gpus=(), driver="580")
    checks = verify_environment(Lock((), {}), gpu_host, "/tmp/x/w.sock", installed=lambda n: None,
                                torch_probe=lambda: {"version": "2.13.0+cpu", "cuda": None, "hip": None, "cuda_available": False})
    assert not next(c for c in checks if c.name == "torch device").ok


def test_doctor_command_exits_non_zero_with_the_list(tmp_path):
    lock = tmp_path / "requirements.lock"
    lock.write_text("# engine: transformers\nnot-a-real-package-cyllm==1.0\ngrpcio==0.0.1\n")
    result = subprocess.run([sys.executable, "-m", "worker", "doctor", "--lock", str(lock),
                             "--socket", f"{tmp_path}/s/w.sock"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 1
    assert "not-a-real-package-cyllm: missing" in result.stderr and "grpcio:" in result.stderr


def test_setup_refuses_an_impossible_pair_with_what_is_valid(tmp_path):
    result = subprocess.run([sys.executable, "-m", "worker", "setup", "--engine", "trtllm", "--hardware", "cpu",
                             "--lock", str(tmp_path / "l"), "--dry-run"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 2
    assert "TensorRT-LLM runs on NVIDIA GPUs only" in result.stderr and "engines for cpu-x86_64" in result.stderr
    assert "trtllm        no" in result.stdout


def test_presets_fill_only_what_the_config_leaves_unset(registry):
    preset = registry.preset("nvidia-hopper", "vllm")
    config = load_config(None, {"HOME": "/h"}, {"engine.name": "transformers", "engine.args.max_num_seqs": "7"})
    applied_config, applied = apply_preset(config, preset, ("gpu_memory_utilization", "max_num_seqs", "block_size"))
    assert applied_config.resources.max_concurrency == 512
    assert applied_config.engine.args == {"max_num_seqs": 7, "gpu_memory_utilization": 0.92, "block_size": 16}
    assert "engine.args.max_num_seqs" not in applied
    explicit = load_config(None, {"HOME": "/h", "CYLLM_RESOURCES__MAX_CONCURRENCY": "3"})
    assert apply_preset(explicit, preset, ())[0].resources.max_concurrency == 3
    # Burst slots run above the limit, so the engine's batch grows by them unless set explicitly.
    burst = load_config(None, {"HOME": "/h"}, {"tenants.burst_slots": 3})
    applied_config, applied = apply_preset(burst, preset, ("max_num_seqs",))
    assert (applied_config.resources.max_concurrency, applied_config.engine.args["max_num_seqs"]) == (512, 515)
    assert applied["engine.args.max_num_seqs"] == 515
    assert apply_preset(burst, preset, ())[0].engine.args.get("max_num_seqs") is None, "an engine without the key"


def test_cpu_presets_pick_the_dtype_native_measured_fastest(registry):
    """bf16 on AVX-512 (oneDNN runs it), fp32 on AVX2 (bench/results/engines_cpu*.json); an
    explicit engine.dtype stays."""
    assert registry.preset("cpu-x86_64-avx512", "native").dtype == "bfloat16"
    assert registry.preset("cpu-x86_64-avx2", "native").dtype == "float32"
    assert registry.preset("cpu-arm64", "native").dtype is None  # not measured: the engine's auto
    preset = registry.preset("cpu-x86_64-avx512", "native")
    applied_config, applied = apply_preset(load_config(None, {"HOME": "/h"}), preset, ())
    assert applied_config.engine.dtype == "bfloat16" and applied["engine.dtype"] == "bfloat16"
    explicit = load_config(None, {"HOME": "/h", "CYLLM_ENGINE__DTYPE": "float32"})
    assert apply_preset(explicit, preset, ())[0].engine.dtype == "float32"


def test_an_isa_below_the_best_picks_that_isa_s_profile(registry):
    """engine.cpu_isa=avx2 on an AVX-512 CPU runs what an AVX2-only CPU runs, so it gets that
    profile's preset (fp32, not the bf16 that oneDNN no longer runs)."""
    flags = frozenset({"avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                       "avx512cd", "avx512_bf16", "amx_bf16"})
    profile = lambda isa: registry.match(HardwareProfile("cpu", "x86_64", flags_within(isa, "x86_64", flags)))  # noqa: E731
    assert [profile(isa) for isa in ("auto", "avx512", "avx2")] == ["cpu-x86_64-avx512"] * 2 + ["cpu-x86_64-avx2"]
    assert flags_within("default", "x86_64", flags) == frozenset({"bmi2"})
    assert flags_within("avx2", "x86_64", flags - {"avx512f"}) == flags - {"avx512f"}  # already its best


def test_arm64_pins_have_aarch64_wheels(registry, tmp_path):
    """pip on this x86_64 host, asked for aarch64 wheels. torch's aarch64 CPU build lives on PyTorch's
    CPU index only (PyPI's aarch64 torch is a CUDA build), which this network cannot reach, so torch
    is the one pin left out; the rest must exist for the platform."""
    requirements = registry.resolve("cpu-arm64", "transformers")
    assert "torch==2.13.0+cpu" in requirements.requirements
    pins = [r for r in requirements.requirements if not r.startswith("torch==")]
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps", "--only-binary=:all:",
         "--platform", "manylinux2014_aarch64", "--platform", "manylinux_2_28_aarch64", "--python-version", "3.11",
         "--implementation", "cp", "--target", str(tmp_path / "t"), "--quiet", *pins],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
