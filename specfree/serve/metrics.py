"""Prometheus metrics of one server, in its own registry (two apps in one process never mix)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from specfree.types import Generation

__all__ = ["CONTENT_TYPE_LATEST", "Metrics"]


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter("specfree_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.queue_length = Gauge("specfree_queue_length", "requests waiting for the engine", registry=r)
        self.running = Gauge("specfree_running", "requests the engine is decoding (up to serve.max_batch)", registry=r)
        self.prompt_tokens = Counter("specfree_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.completion_tokens = Counter("specfree_completion_tokens", "tokens generated", registry=r)
        self.steps = Counter("specfree_steps", "decoding steps (one target forward each)", registry=r)
        self.accepted = Counter("specfree_accepted_draft_tokens", "drafted tokens the model accepted", registry=r)
        self.tokens_per_step = Histogram("specfree_tokens_per_step", "tokens emitted per step (accepted + 1)",
                                         buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32), registry=r)
        self.tokens_per_s = Histogram("specfree_request_tokens_per_second", "generated tokens per second, per request",
                                      buckets=(1, 5, 10, 20, 40, 80, 160, 320, 640), registry=r)
        self.last_tokens_per_s = Gauge("specfree_last_request_tokens_per_second",
                                       "generated tokens per second of the last finished request", registry=r)
        self.ttft = Histogram("specfree_time_to_first_token_seconds", "arrival to first token, queue wait included",
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120), registry=r)
        self.cancelled = Counter("specfree_cancelled", "requests stopped early (client gone or timeout)", registry=r)
        self.cached_tokens = Counter("specfree_prompt_cached_tokens",
                                     "prompt tokens whose KV was reused from the last request (prompt cache)", registry=r)
        self.prefilled_tokens = Counter("specfree_prompt_prefilled_tokens",
                                        "prompt tokens the prefill ran (the rest came from the prompt cache, "
                                        "and each prompt's last token runs in its first step)", registry=r)

    def finished(self, generation: Generation) -> None:
        self.prompt_tokens.inc(generation.prompt_tokens)
        self.cached_tokens.inc(generation.cached_tokens)
        self.prefilled_tokens.inc(generation.prefilled_tokens)
        self.completion_tokens.inc(len(generation.tokens))
        self.steps.inc(len(generation.steps))
        self.accepted.inc(sum(step.accepted for step in generation.steps))
        for step in generation.steps:
            self.tokens_per_step.observe(step.emitted)
        self.tokens_per_s.observe(generation.tokens_per_s)
        self.last_tokens_per_s.set(generation.tokens_per_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
