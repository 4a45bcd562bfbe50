"""The `cy-llm` command: serve, generate, models prepare, bench. The only place that reads the environment."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from worker.config import Config, ConfigError
from worker.config_loader import load_config

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


def _config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML file (env CYLLM_CONFIG)")
    parser.add_argument("--socket", help="Unix socket path (env CYLLM_SOCKET)")
    parser.add_argument("--model", help="model folder or embedded model name (env CYLLM_MODEL)")
    parser.add_argument("--engine", help="engine name: native (default) | transformers | vllm | trtllm | synthetic (env CYLLM_ENGINE)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override any config key, e.g. resources.max_concurrency=4 or engine.args.tokens_per_s=1e5")


def _build_config(args: argparse.Namespace) -> Config:
    overrides: dict[str, Any] = {"server.socket": args.socket, "engine.model": args.model, "engine.name": args.engine}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(key, "--set takes SECTION.KEY=VALUE")
        overrides[key.strip()] = value
    config = load_config(args.config or os.environ.get("CYLLM_CONFIG"), os.environ, overrides)
    _limit_cpu_isa(config.engine.cpu_isa)
    return config


def _limit_cpu_isa(isa: str) -> None:
    """engine.cpu_isa below the CPU's best: oneDNN and ATen take their limit only from the
    environment, read once, at their first op; nothing has run one yet."""
    from worker.deps.hardware import isa_environment, this_cpu

    for key, value in isa_environment(isa, *this_cpu()).items():
        os.environ.setdefault(key, value)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cy-llm", description="cy-llm inference worker")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="serve StreamPredict on a Unix socket")
    _config_args(serve)

    gen = commands.add_parser("generate", help="send one request to a running worker and print the text")
    _config_args(gen)
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    gen.add_argument("--max-tokens", type=int)
    gen.add_argument("--temperature", type=float)
    gen.add_argument("--top-p", type=float)
    gen.add_argument("--top-k", type=int)
    gen.add_argument("--min-p", type=float)
    gen.add_argument("--repetition-penalty", type=float)
    gen.add_argument("--presence-penalty", type=float)
    gen.add_argument("--frequency-penalty", type=float)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--stop-token-id", action="append", type=int, default=[], dest="stop_token_ids")
    gen.add_argument("--seed", type=int)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--priority", type=int)
    gen.add_argument("--request-id")
    gen.add_argument("--adapter")
    gen.add_argument("--request-model", dest="request_model", help="the request's model field")
    gen.add_argument("--speculative", action=argparse.BooleanOptionalAction,
                     help="ask for speculative decoding, or opt out of it (default: the engine's setting)")
    gen.add_argument("--timeout", type=float, help="gRPC deadline in seconds")
    gen.add_argument("--wait", type=float, default=0.0, help="wait up to this many seconds for the worker to be ready")

    health = commands.add_parser("health", help="probe a worker over its socket: exit 0 when SERVING")
    _config_args(health)
    health.add_argument("--ready", action="store_true", help="the inference service (model loaded, making progress), "
                                                             "not only the process")
    health.add_argument("--timeout", type=float, default=3.0)

    models = commands.add_parser("models", help="embedded models")
    model_commands = models.add_subparsers(dest="models_command", required=True)
    prepare = model_commands.add_parser("prepare", help="convert an embedded model into the cache once")
    prepare.add_argument("name")
    prepare.add_argument("--cache-dir", help="default: models.cache_dir (env CYLLM_CACHE_DIR)")
    model_commands.add_parser("list", help="embedded models and whether they are prepared")

    kb = commands.add_parser("kb", help="local knowledge bases for rag adapters")
    kb_commands = kb.add_subparsers(dest="kb_command", required=True)
    index = kb_commands.add_parser("index", help="index a folder of text/markdown files (replaces NAME)")
    _config_args(index)
    index.add_argument("folder")
    index.add_argument("--name", required=True)
    search = kb_commands.add_parser("search", help="the top passages of NAME for a query")
    _config_args(search)
    search.add_argument("name")
    search.add_argument("query")
    search.add_argument("-k", type=int, default=3)

    setup = commands.add_parser("setup", help="detect the hardware, resolve an engine stack, write the lock, install it")
    setup.add_argument("--engine", help="transformers | native | vllm | trtllm (default: the hardware's default)")
    setup.add_argument("--hardware", default="auto", help="auto, a vendor (cpu, nvidia, amd, ascend) or a profile name")
    setup.add_argument("--registry", help="registry JSON (default: deploy/dependency_registry.json; env CYLLM_REGISTRY)")
    setup.add_argument("--lock", default="requirements.lock", help="where to write the lock file")
    setup.add_argument("--dry-run", action="store_true", help="resolve with pip but install nothing")
    setup.add_argument("--yes", action="store_true", help="install without asking")

    doctor = commands.add_parser("doctor", help="check the environment against the lock and the hardware")
    _config_args(doctor)
    doctor.add_argument("--lock", default="requirements.lock")
    doctor.add_argument("--registry")

    bench = commands.add_parser("bench", help="concurrent streams: over the socket, or the engine in-process")
    _config_args(bench)
    bench.add_argument("--streams", type=int, default=1)
    bench.add_argument("--max-tokens", type=int, default=128)
    bench.add_argument("--prompt", default=None)
    bench.add_argument("--json", dest="json_out")
    bench.add_argument("--target", help="a gRPC host:port (e.g. the sidecar) instead of the worker's socket")
    bench.add_argument("--in-process", action="store_true",
                       help="build the configured engine here and drive it without gRPC")
    return parser


def main(argv: list[str] | None = None) -> int:
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
    args = _parser().parse_args(argv)
    try:
        if args.command == "serve":
            return _serve(_build_config(args))
        if args.command == "generate":
            return _generate(args, _build_config(args))
        if args.command == "health":
            from worker.client import check_health

            return check_health(_build_config(args).server.socket, args.ready, args.timeout)
        if args.command == "models":
            return _models(args)
        if args.command == "bench":
            return _bench(args, _build_config(args))
        if args.command == "kb":
            return _kb(args, _build_config(args))
        if args.command == "setup":
            from worker.deps.commands import setup

            return setup(args.engine, args.hardware, args.registry or os.environ.get("CYLLM_REGISTRY"), args.lock,
                         args.dry_run, args.yes, os.environ)
        if args.command == "doctor":
            from worker.deps.commands import doctor

            return doctor(args.lock, args.registry or os.environ.get("CYLLM_REGISTRY"), _build_config(args))
    except ConfigError as exc:
        print(f"cy-llm: configuration error: {exc}", file=sys.stderr)
        return 2
    return 2


def _kb(args: argparse.Namespace, config: Config) -> int:
    from worker.adapters.knowledge_base import KnowledgeBase, KnowledgeBaseError, build_index

    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", args.name) or args.name.startswith("."):
        print("cy-llm: a knowledge base name is 1-64 letters, digits and ._-", file=sys.stderr)
        return 2
    path = Path(config.adapters.kb_dir) / f"{args.name}.sqlite"
    try:
        if args.kb_command == "index":
            def progress(done: int, total: int, passages: int) -> None:
                print(f"\rindexed {done}/{total} files, {passages} passages", end="", file=sys.stderr, flush=True)

            count = build_index(Path(args.folder), path, progress)
            print(f"\n{path}: {count} passages", file=sys.stderr)
            return 0
        for passage in KnowledgeBase(path).search(args.query, args.k):
            print(f"[{passage.source}] score {passage.score:.2f}\n{passage.text}\n")
        return 0
    except KnowledgeBaseError as exc:
        print(f"cy-llm: {exc}", file=sys.stderr)
        return 1


def _serve(config: Config) -> int:
    from worker.engines.factory import create_engine
    from worker.listener import SocketInUse
    from worker.server import Worker
    from worker.telemetry import configure_logging

    configure_logging(config.server.log_level)
    try:
        config = _with_preset(config)
        worker = Worker(config, create_engine)
    except ConfigError as exc:
        print(f"cy-llm: configuration error: {exc}", file=sys.stderr)
        return 2
    try:
        code = run_async(worker.run())
        if worker.engine.still_loading():
            # Stopped mid-load: finalizing the interpreter around a thread inside the load's native
            # code aborts the process (CUDA: "terminate called without an active exception").
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        return code
    except SocketInUse as exc:
        print(f"cy-llm: {exc}", file=sys.stderr)
        return 1


def _with_preset(config: Config) -> Config:
    """Applies the registry's preset for the detected (hardware, engine) where the config is silent;
    an engine.cpu_isa below the CPU's best picks the profile of a CPU whose best it is."""
    import dataclasses

    from worker.deps.hardware import detect_hardware, flags_within
    from worker.deps.registry import WORKER_ENGINES, Registry, RegistryError, apply_preset
    from worker.engines.factory import ENGINES
    from worker.telemetry import get_logger

    log = get_logger("cy-llm")
    if not config.engine.use_preset or config.engine.name not in WORKER_ENGINES or config.engine.name not in ENGINES:
        return config
    try:
        registry = Registry.load(os.environ.get("CYLLM_REGISTRY"))
        hardware = detect_hardware()
        if hardware.vendor == "cpu":
            hardware = dataclasses.replace(hardware, cpu_flags=flags_within(config.engine.cpu_isa, hardware.arch,
                                                                            hardware.cpu_flags))
        profile = registry.match(hardware)
    except RegistryError as exc:
        log.warning("no preset applied", reason=str(exc))
        return config
    preset = registry.preset(profile, config.engine.name)
    if preset is None:
        log.info("no preset for this hardware and engine", hardware=profile, engine=config.engine.name)
        return config
    config, applied = apply_preset(config, preset, ENGINES[config.engine.name]().preset_args)
    log.info("preset applied", hardware=profile, engine=config.engine.name, applied=applied,
             kept_from_config=sorted(k for k in config.explicit_keys if k.startswith(("resources.", "engine.args."))))
    return config


def _generate(args: argparse.Namespace, config: Config) -> int:
    from worker.client import build_request, generate

    request = build_request(
        args.prompt, chat=args.chat, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty, stop=args.stop,
        stop_token_ids=args.stop_token_ids, seed=args.seed, ignore_eos=args.ignore_eos or None,
        priority=args.priority, request_id=args.request_id, adapter=args.adapter, model=args.request_model,
        speculative=args.speculative)
    return generate(config.server.socket, request, wait_s=args.wait, timeout_s=args.timeout)


def _models(args: argparse.Namespace) -> int:
    from worker.models import EMBEDDED_MODELS, prepare_model

    cache_dir = getattr(args, "cache_dir", None) or load_config(None, os.environ).models.cache_dir
    if args.models_command == "list":
        for name in EMBEDDED_MODELS:
            prepared = os.path.isfile(os.path.join(cache_dir, name, "config.json"))
            print(f"{name}\t{'prepared' if prepared else 'not prepared'}\t{os.path.join(cache_dir, name)}")
        return 0
    print(prepare_model(args.name, cache_dir, log=lambda m: print(m, file=sys.stderr)))
    return 0


def _bench(args: argparse.Namespace, config: Config) -> int:
    from worker.loadgen import DEFAULT_PROMPT, bench
    from worker.telemetry import configure_logging

    configure_logging(config.server.log_level)  # logs to stderr; stdout carries the JSON result
    target = args.target or f"unix:{config.server.socket}"
    result = bench(None if args.in_process else target, config if args.in_process else None,
                   args.streams, args.max_tokens, args.prompt or DEFAULT_PROMPT, args.json_out)
    print(json.dumps(result, indent=2))
    return 1 if result["errors"] else 0


def run_async(coroutine) -> int:
    try:
        import uvloop
    except ImportError:
        import asyncio

        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


if __name__ == "__main__":
    sys.exit(main())
