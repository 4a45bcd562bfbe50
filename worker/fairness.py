"""Tenants: who a request is for, and how the TaskScheduler shares slots and budget between them.

A tenant is named by one PredictRequest.metadata key (tenants.key: the sidecar puts the gateway's
fairness header, or the API key's name, there); `default` when absent.

The fair policy is the Virtual Token Counter (Sheng et al., "Fairness in Serving Large Language
Models", OSDI '24): each tenant's counter adds up the service it received, prompt tokens at
admission and generated tokens as they come, each weighted (prompt_weight, output_weight) and
divided by the tenant's weight. The waiting request admitted next is the oldest of the tenant
with the lowest counter, within the highest priority waiting. A tenant that becomes active (no
request running or waiting before this one) is lifted to the lowest counter of the active
tenants, so time spent idle is not credit to spend later, and a newcomer does not starve the
others. `fcfs` admits in arrival order within a priority, as before.

Per-tenant caps (max_concurrency, max_budget_share of the KV budget) hold a tenant's requests back
without blocking anyone else's.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping

from worker.errors import InvalidRequest

DEFAULT_TENANT = "default"
OTHER_TENANTS = "other"  # the metrics label of tenants past the labelled ones
MAX_TENANT_BYTES = 128
POLICIES = ("vtc", "fcfs")
LIMIT_KEYS = {"weight": float, "max_concurrency": int, "max_budget_share": float}


@dataclass(frozen=True, slots=True)
class TenantLimits:
    weight: float = 1.0
    max_concurrency: int = 0  # 0: no cap beyond the worker's
    max_budget_share: float = 1.0


def parse_limits(key: str, spec: Any) -> TenantLimits:
    """One `tenants.named` entry; raises ValueError naming what is wrong."""
    if not isinstance(spec, Mapping):
        raise ValueError(f"{key}: a mapping of {', '.join(LIMIT_KEYS)}")
    unknown = set(spec) - set(LIMIT_KEYS)
    if unknown:
        raise ValueError(f"{key}.{sorted(unknown)[0]}: unknown key; expected one of {', '.join(LIMIT_KEYS)}")
    values = {}
    for name, kind in LIMIT_KEYS.items():
        if name in spec:
            value = spec[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
                raise ValueError(f"{key}.{name}: {value!r} is not a valid {kind.__name__}")
            values[name] = kind(value)
    limits = TenantLimits(**values)
    if not 0 < limits.weight <= 1e6:
        raise ValueError(f"{key}.weight: must be within (0, 1e6]")
    if limits.max_concurrency < 0:
        raise ValueError(f"{key}.max_concurrency: must be 0 (no cap) or more")
    if not 0 < limits.max_budget_share <= 1:
        raise ValueError(f"{key}.max_budget_share: must be within (0, 1]")
    return limits


@dataclass(slots=True)
class TenantStats:
    """Counted per metrics label (bounded), read by the metrics collector at scrape time."""

    admitted: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    rejections: Counter[str] = field(default_factory=Counter)


class Fairness:
    def __init__(self, *, key: str = "x-gateway-inference-fairness-id", policy: str = "vtc", prompt_weight: float = 1.0,
                 output_weight: float = 2.0, named: Mapping[str, TenantLimits] | None = None, metric_tenants: int = 20,
                 headroom_slots: int = 0, burst_slots: int = 0, recent_s: float = 30.0):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}")
        self.key = key
        self.policy = policy
        self.prompt_weight = prompt_weight
        self.output_weight = output_weight
        self.named = dict(named or {})
        self.metric_tenants = metric_tenants
        self.headroom_slots = headroom_slots
        self.burst_slots = burst_slots
        self.recent_s = recent_s
        self.counters: dict[str, float] = {}  # tenant -> virtual tokens served
        self.stats: dict[str, TenantStats] = {}  # metrics label -> counts
        self._labels: dict[str, str] = {}

    @classmethod
    def from_config(cls, config) -> Fairness:
        """From the `tenants` section (config.TenantsConfig, validated)."""
        named = {name: parse_limits(f"tenants.named.{name}", spec) for name, spec in config.named.items()}
        return cls(key=config.key, policy=config.policy, prompt_weight=config.prompt_weight,
                   output_weight=config.output_weight, named=named, metric_tenants=config.metric_tenants,
                   headroom_slots=config.headroom_slots, burst_slots=config.burst_slots,
                   recent_s=config.recent_s)

    def tenant_of(self, metadata: Mapping[str, str]) -> str:
        name = metadata.get(self.key, "") or DEFAULT_TENANT
        if len(name.encode()) > MAX_TENANT_BYTES or not name.isprintable():
            raise InvalidRequest(f"metadata {self.key!r} names a tenant in at most {MAX_TENANT_BYTES} printable bytes")
        return name

    def limits(self, tenant: str) -> TenantLimits:
        return self.named.get(tenant) or self.named.get(DEFAULT_TENANT) or TenantLimits()

    def label(self, tenant: str) -> str:
        """The tenant's metrics label: its name for the configured tenants and the first
        metric_tenants others seen, `other` for the rest, so the series stay bounded."""
        label = self._labels.get(tenant)
        if label is None:
            seen = len(self._labels) - sum(1 for t in self._labels if t in self.named)
            label = tenant if tenant in self.named or seen < self.metric_tenants else OTHER_TENANTS
            if label != OTHER_TENANTS:
                self._labels[tenant] = label
        return label

    def stats_of(self, tenant: str) -> TenantStats:
        label = self.label(tenant)
        if label not in self.stats:
            self.stats[label] = TenantStats()
        return self.stats[label]

    def activate(self, tenant: str, active: set[str]) -> None:
        """`tenant` has nothing running or waiting and now asks again: no credit for its idle time.
        The floor never falls (whoever joins is lifted to it), so the counters of idle tenants at
        or below it can be forgotten: they would be lifted anyway."""
        if active:
            floor = min(self.counters.get(t, 0.0) for t in active)
        else:  # an idle worker: everyone starts level with the most served
            floor = max(self.counters.values(), default=0.0)
        self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)
        if len(self.counters) > 2 * len(active) + 64:
            self.counters = {t: c for t, c in self.counters.items() if c > floor or t in active or t == tenant}

    def charge(self, tenant: str, prompt_tokens: int = 0, generated_tokens: int = 0) -> None:
        weighted = self.prompt_weight * prompt_tokens + self.output_weight * generated_tokens
        self.counters[tenant] = self.counters.get(tenant, 0.0) + weighted / self.limits(tenant).weight
        stats = self.stats_of(tenant)
        stats.prompt_tokens += prompt_tokens
        stats.generated_tokens += generated_tokens

    def behind(self, tenant: str, others: list[str]) -> bool:
        """Under VTC, whether `tenant` has had less service than each of `others`: VTC admits it
        before any of them (FCFS ranks no one by service)."""
        counter = self.counters.get(tenant, 0.0)
        return self.policy == "vtc" and all(counter < self.counters.get(t, 0.0) for t in others)

    def order(self, tenant: str, priority: int, sequence: int) -> tuple:
        """The sort key of a tenant's oldest waiting request: lowest goes first."""
        if self.policy == "fcfs":
            return (-priority, sequence)
        return (-priority, self.counters.get(tenant, 0.0), sequence)
