"""The server's Prometheus metrics (``GET /metrics``), through ``prometheus_client``.

Each server owns its :class:`~prometheus_client.CollectorRegistry` (not the process-wide
default), so that two servers in one process, as in tests, do not collide. The scheduler
writes them; the app only renders them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

#: Seconds buckets for time to first token and request latency (CPU serving: up to minutes).
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300)
#: Seconds buckets for one batched round.
_STEP_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2)


class ServerMetrics:
    """Counters, gauges and histograms of one server (names prefixed ``knapspec_``)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests = Counter(
            "knapspec_requests",
            "Finished generation requests by outcome (stop, length, cancelled, error) "
            "and refused ones (rejected_queue_full, rejected_unavailable, invalid)",
            ["outcome"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "knapspec_prompt_tokens", "Prompt tokens of admitted requests", registry=registry
        )
        self.cached_prompt_tokens = Counter(
            "knapspec_cached_prompt_tokens",
            "Prompt tokens whose K/V came from the prefix cache (not prefilled again)",
            registry=registry,
        )
        self.generation_tokens = Counter(
            "knapspec_generation_tokens", "Tokens generated (committed)", registry=registry
        )
        self.queue_depth = Gauge(
            "knapspec_queue_depth", "Requests waiting for a batch row", registry=registry
        )
        self.batch_size = Gauge(
            "knapspec_batch_size", "Rows decoding in the running batch", registry=registry
        )
        self.tokens_per_step = Histogram(
            "knapspec_accepted_tokens_per_step",
            "Tokens a row committed in one batched round (accepted drafts + 1)",
            buckets=tuple(range(1, 18)),
            registry=registry,
        )
        self.drafted_tokens = Counter(
            "knapspec_drafted_tokens", "Draft tokens verified", registry=registry
        )
        self.accepted_tokens = Counter(
            "knapspec_accepted_draft_tokens", "Draft tokens accepted", registry=registry
        )
        self.time_to_first_token = Histogram(
            "knapspec_time_to_first_token_seconds",
            "From a request's arrival to its first token (queueing and prefill included)",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.step_time = Histogram(
            "knapspec_step_seconds",
            "One batched speculative round (draft, verify, commit) over every running row",
            buckets=_STEP_BUCKETS,
            registry=registry,
        )
        self.prefill_time = Histogram(
            "knapspec_prefill_seconds",
            "One admitted request's prefill (prefix-cache lookup, forward, first token); "
            "the running rows wait meanwhile",
            buckets=_STEP_BUCKETS,
            registry=registry,
        )
        self.request_time = Histogram(
            "knapspec_request_seconds",
            "From a request's arrival to its last token",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )

    def render(self) -> bytes:
        """The exposition text of every metric."""
        return generate_latest(self.registry)


__all__ = ["ServerMetrics"]
