"""Prometheus metrics (cyllm_ prefix) and structlog JSON logging for the worker."""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Iterable

import structlog
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, CounterMetricFamily

if TYPE_CHECKING:
    from worker.engines.base import BaseEngine
    from worker.scheduler import TaskScheduler

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
PER_TOKEN_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)


class Metrics:
    """The worker's metrics in a registry of their own, rendered by WorkerControl.Metrics."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("cyllm_requests", "Requests ended, by gRPC status", ["status"], registry=r)
        self.queue_time = Histogram("cyllm_queue_time_seconds", "Time from arrival to admission",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("cyllm_time_to_first_token_seconds", "Time from arrival to the first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("cyllm_time_per_output_token_seconds", "Mean time between output tokens",
                              buckets=PER_TOKEN_BUCKETS, registry=r)
        self.prompt_tokens = Counter("cyllm_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("cyllm_generation_tokens", "Tokens generated", registry=r)
        self.tenant_queue_time = Histogram("cyllm_tenant_queue_time_seconds", "Time from arrival to admission, by tenant",
                                           ["tenant"], buckets=LATENCY_BUCKETS, registry=r)
        self.spans_exported = Counter("cyllm_spans_exported", "Trace spans sent to the OTLP collector", registry=r)
        self.spans_dropped = Counter("cyllm_spans_dropped", "Trace spans that never reached the collector, by reason",
                                     ["reason"], registry=r)

    def watch(self, scheduler: TaskScheduler, engine: BaseEngine) -> None:
        """Reads queue, running, budget and rejections off the scheduler, and the engine's own
        count of requests, memory and prefix cache, at scrape time."""
        self.registry.register(_SchedulerCollector(scheduler, engine))

    def render(self) -> str:
        return generate_latest(self.registry).decode()


class _SchedulerCollector:
    def __init__(self, scheduler: TaskScheduler, engine: BaseEngine):
        self.scheduler = scheduler
        self.engine = engine

    def describe(self) -> Iterable:
        return []

    def collect(self) -> Iterable:
        load = self.scheduler.load()
        for name, help_text, value in (
            ("cyllm_queue_depth", "Requests waiting for admission", load.queued),
            ("cyllm_running_requests", "Requests admitted and running", load.running),
            ("cyllm_kv_budget_used_tokens", "KV budget held by running requests", load.budget_used),
            ("cyllm_kv_budget_total_tokens", "KV budget the engine can hold", load.budget_total),
            ("cyllm_max_concurrency", "Concurrency slots", load.max_concurrency),
            ("cyllm_draining", "1 while the worker drains", int(load.draining)),
            ("cyllm_engine_unfinished_requests", "Requests the engine itself still holds", self.engine.num_unfinished()),
        ):
            yield GaugeMetricFamily(name, help_text, value=value)
        rejections = CounterMetricFamily("cyllm_rejections", "Requests refused admission, by reason",
                                         labels=["reason"])
        for reason, count in sorted(self.scheduler.rejections.items()):
            rejections.add_metric([reason], count)
        yield rejections
        yield from self._tenants()
        memory = GaugeMetricFamily("cyllm_device_memory_used_bytes", "Memory in use per device",
                                   labels=["device"])
        for device, used in self.engine.get_memory_usage().items():
            memory.add_metric([device], used)
        yield memory
        if (prefix := self.engine.prefix_cache_stats()) is not None:
            yield CounterMetricFamily("cyllm_prefix_cache_queries_tokens", "Prompt tokens looked up in the prefix cache",
                                      value=prefix[0])
            yield CounterMetricFamily("cyllm_prefix_cache_hits_tokens", "Prompt tokens found in the prefix cache",
                                      value=prefix[1])
        if (speculation := self.engine.speculation_stats()) is not None:
            for name, help_text, value in zip(
                    ("cyllm_speculative_drafts", "cyllm_speculative_draft_tokens", "cyllm_speculative_accepted_tokens"),
                    ("Steps a sequence's proposed tokens were checked in", "Tokens proposed by speculative decoding",
                     "Proposed tokens accepted (acceptance rate: accepted / draft tokens)"), speculation):
                yield CounterMetricFamily(name, help_text, value=value)

    def _tenants(self) -> Iterable:
        """Per tenant (label: its name, or `other` past fairness.metric_tenants): what it was
        admitted, refused and served, what it waits with and runs, and its VTC counter."""
        fairness, scheduler = self.scheduler.fairness, self.scheduler
        families = {
            "admitted": CounterMetricFamily("cyllm_tenant_admitted", "Requests admitted, by tenant", labels=["tenant"]),
            "rejected": CounterMetricFamily("cyllm_tenant_rejections", "Requests refused admission, by tenant and reason",
                                            labels=["tenant", "reason"]),
            "tokens": CounterMetricFamily("cyllm_tenant_tokens", "Tokens served, by tenant and kind (prompt, generated)",
                                          labels=["tenant", "kind"]),
            "queued": GaugeMetricFamily("cyllm_tenant_queued_requests", "Requests waiting, by tenant", labels=["tenant"]),
            "running": GaugeMetricFamily("cyllm_tenant_running_requests", "Requests running, by tenant", labels=["tenant"]),
            "service": GaugeMetricFamily("cyllm_tenant_virtual_tokens", "The fairness policy's counter of service "
                                         "received (weighted tokens / weight), by tenant", labels=["tenant"]),
        }
        for label, stats in sorted(fairness.stats.items()):
            families["admitted"].add_metric([label], stats.admitted)
            for reason, count in sorted(stats.rejections.items()):
                families["rejected"].add_metric([label, reason], count)
            families["tokens"].add_metric([label, "prompt"], stats.prompt_tokens)
            families["tokens"].add_metric([label, "generated"], stats.generated_tokens)
        for family, counts in (("queued", scheduler.queued_by_tenant()), ("running", scheduler.tenant_running),
                               ("service", fairness.counters)):
            by_label: dict[str, float] = {}
            for tenant, value in counts.items():
                label = fairness.label(tenant)
                by_label[label] = max(by_label.get(label, 0), value) if family == "service" else by_label.get(label, 0) + value
            for label, value in sorted(by_label.items()):
                families[family].add_metric([label], value)
        yield from families.values()


def configure_logging(level: str = "info") -> None:
    """JSON lines on stderr; request_id and other context come from structlog's contextvars."""
    numeric = getattr(logging, level.upper())
    logging.basicConfig(stream=sys.stderr, level=numeric, format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)
