"""Config: one validated object from YAML, environment and flags; errors name the key."""

from pathlib import Path

import pytest

from worker.config import ConfigError
from worker.config_loader import load_config

REPO = Path(__file__).resolve().parent.parent
ENV = {"HOME": "/home/u"}


def test_defaults_match_the_documented_ones():
    config = load_config(None, ENV)
    assert (config.sampling.temperature, config.sampling.top_p, config.sampling.max_tokens) == (0.7, 0.95, 512)
    assert config.engine.model == "smollm2-135m-instruct"
    assert config.models.cache_dir == "/home/u/.cache/cy-llm/models"


def test_example_config_loads():
    config = load_config(REPO / "deploy" / "worker.yaml", ENV)
    assert config.server.socket == "/run/cy-llm/worker.sock"
    assert config.resources.max_concurrency == 8


def test_precedence_yaml_then_env_then_flags(tmp_path):
    path = tmp_path / "w.yaml"
    path.write_text("resources:\n  max_concurrency: 3\n  max_queue: 7\nengine:\n  name: synthetic\n")
    env = {**ENV, "CYLLM_RESOURCES__MAX_QUEUE": "9", "CYLLM_RESOURCES__QUEUE_TIMEOUT_S": "2.5",
           "CYLLM_ENGINE__ARGS__TOKENS_PER_S": "50"}
    config = load_config(path, env, {"resources.queue_timeout_s": "4", "engine.args.budget_tokens": "10"})
    assert config.resources.max_concurrency == 3
    assert config.resources.max_queue == 9
    assert config.resources.queue_timeout_s == 4.0
    assert config.engine.args == {"tokens_per_s": 50, "budget_tokens": 10}


def test_opentelemetry_s_variables_configure_tracing():
    assert load_config(None, ENV).tracing.otlp_endpoint == ""  # off unless configured
    env = {**ENV, "OTEL_EXPORTER_OTLP_ENDPOINT": "http://all:4317", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://traces:4317",
           "OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25", "OTEL_SERVICE_NAME": "w7"}
    tracing = load_config(None, env).tracing
    assert (tracing.otlp_endpoint, tracing.sampler, tracing.sample_ratio, tracing.service_name) == (
        "http://traces:4317", "traceidratio", 0.25, "w7")
    # cy-llm's own names win over OpenTelemetry's.
    env["CYLLM_TRACING__SAMPLE_RATIO"] = "0.5"
    assert load_config(None, env).tracing.sample_ratio == 0.5


@pytest.mark.parametrize(
    ("env", "key"),
    [
        ({"CYLLM_RESOURCES__MAX_QUEUE": "many"}, "resources.max_queue"),
        ({"CYLLM_RESOURCES__MAX_CONCURRENCY": "0"}, "resources.max_concurrency"),
        ({"CYLLM_SAMPLING__TOP_P": "0"}, "sampling.top_p"),
        ({"CYLLM_SAMPLING__TEMPERATURE": "nan"}, "sampling.temperature"),
        ({"CYLLM_ENGINE__DTYPE": "int3"}, "engine.dtype"),
        ({"CYLLM_RESOURCES__NOPE": "1"}, "resources.nope"),
        ({"CYLLM_WHAT__X": "1"}, "what.x"),
        ({"CYLLM_SOCKET": "/tmp/" + "s" * 120}, "server.socket"),
        ({"CYLLM_SERVER__EXIT_WITH_PARENT": "perhaps"}, "server.exit_with_parent"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector:4317"}, "tracing.otlp_endpoint"),
        ({"OTEL_TRACES_SAMPLER": "jaeger_remote"}, "tracing.sampler"),
        ({"OTEL_TRACES_SAMPLER_ARG": "1.5"}, "tracing.sample_ratio"),
    ],
)
def test_errors_name_the_key(env, key):
    with pytest.raises(ConfigError) as error:
        load_config(None, {**ENV, **env})
    assert error.value.key == key
    assert str(error.value).startswith(key)


def test_yaml_errors_name_the_section(tmp_path):
    path = tmp_path / "w.yaml"
    path.write_text("engin:\n  name: x\n")
    with pytest.raises(ConfigError, match="^engin: unknown section"):
        load_config(path, ENV)
    path.write_text("resources:\n  max_queue: [1, 2]\n")
    with pytest.raises(ConfigError, match="^resources.max_queue"):
        load_config(path, ENV)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml", ENV)
