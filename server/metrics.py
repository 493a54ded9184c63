"""Prometheus metrics, named as vLLM names them (``specserve:`` prefix, ``model_name`` label).

Request-level figures are counted in the server where the events happen (tokens arriving,
requests finishing). Engine-level figures (queue lengths, KV usage, preemptions, prefix-cache
lookups) are read at scrape time from the engine client's totals, which carry the counters
across engine restarts so that they never go backwards.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# The *_created series add nothing a dashboard uses (vLLM turns them off too).
disable_created_metrics()

PREFIX = "specserve:"
LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


class EngineStatsCollector(Collector):
    def __init__(self, model_name: str, stats: Callable[[], object | None]):
        self.model_name = model_name
        self.stats = stats

    def collect(self):
        s = self.stats()
        labels = ["model_name"]
        gauges = {
            "num_requests_running": ("Requests in the engine's running batch", "num_running"),
            "num_requests_waiting": ("Requests waiting to be scheduled", "num_waiting"),
            "kv_cache_usage_perc": ("KV-cache usage, 1 means 100 percent", "kv_cache_usage"),
        }
        for name, (doc, attr) in gauges.items():
            g = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            g.add_metric([self.model_name], float(getattr(s, attr, 0) if s else 0))
            yield g
        counters = {
            "num_preemptions": "Preemptions by recompute",
            "prefix_cache_queries": "Prompt tokens looked up in the prefix cache",
            "prefix_cache_hits": "Prompt tokens found in the prefix cache",
        }
        for attr, doc in counters.items():
            c = CounterMetricFamily(PREFIX + attr, doc, labels=labels)
            c.add_metric([self.model_name], int(getattr(s, attr, 0) if s else 0))
            yield c
        yield from self._spec_decode(s)

    def _spec_decode(self, s):
        """vLLM's spec_decode_* counters, labelled by the decoder that drafted (none for an
        engine with no drafting decoder loaded, which has no drafts to count)."""
        by_decoder = getattr(s, "spec_by_decoder", ()) if s else ()
        if not by_decoder:
            return
        labels = ["model_name", "decoder"]
        names = {
            "spec_decode_num_drafts": "Draft runs verified",
            "spec_decode_num_draft_tokens": "Draft tokens proposed",
            "spec_decode_num_accepted_tokens": "Draft tokens accepted",
        }
        families = [CounterMetricFamily(PREFIX + n, doc, labels=labels) for n, doc in names.items()]
        per_pos = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position",
            labels=[*labels, "position"],
        )
        for decoder, (drafts, draft_tokens, accepted, per_position) in by_decoder:
            values = [self.model_name, decoder]
            for family, count in zip(families, (drafts, draft_tokens, accepted), strict=True):
                family.add_metric(values, count)
            for position, count in enumerate(per_position):
                per_pos.add_metric([*values, str(position)], count)
        yield from families
        yield per_pos
        trimmed = CounterMetricFamily(
            PREFIX + "spec_decode_num_trimmed_draft_tokens",
            "Draft tokens drafted but not verified: their chance of standing was under what "
            "a verified row costs (the draft policy's floor)",
            labels=["model_name"],
        )
        trimmed.add_metric([self.model_name], getattr(s, "spec_num_trimmed_drafts", 0))
        yield trimmed
        yield from self._draft_policy(s)

    def _draft_policy(self, s):
        """The goodput policy's choices (when it is on): steps per decoder and draft length
        (length 0: that decoder's sequences ran plain), and its last prediction of a step's
        time against what the step took."""
        lengths = getattr(s, "spec_draft_lengths", ())
        if not lengths:
            return
        chosen = CounterMetricFamily(
            PREFIX + "spec_decode_draft_length_chosen",
            "Choices of each draft length by the draft policy, per decoder (a hybrid's per draft "
            "source: decoder:source); one per step and decoder (or source) that drafted",
            labels=["model_name", "decoder", "length"],
        )
        for decoder, counts in lengths:
            for length, count in enumerate(counts):
                chosen.add_metric([self.model_name, decoder, str(length)], count)
        yield chosen
        for name, doc, attr in (
            ("spec_policy_predicted_step_seconds", "The draft policy's predicted step time",
             "spec_policy_predicted_seconds"),
            ("spec_policy_measured_step_seconds", "That step's drafting and forward time",
             "spec_policy_measured_seconds"),
        ):  # fmt: skip
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            g.add_metric([self.model_name], float(getattr(s, attr, 0.0)))
            yield g


class ServerMetrics:
    """All metrics of one served model, in a registry of their own."""

    def __init__(self, model_name: str, engine_stats: Callable[[], object | None]):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        reg, labels = self.registry, ["model_name"]

        def counter(name, doc, extra=()):
            return Counter(PREFIX + name, doc, labels + list(extra), registry=reg)

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=reg)

        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens processed")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self.request_success = counter(
            "request_success", "Finished requests", extra=["finished_reason"]
        )
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token", LATENCY_BUCKETS)
        self.itl = histogram(
            "inter_token_latency_seconds", "Time between output tokens", LATENCY_BUCKETS
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency", LATENCY_BUCKETS)
        self.queue_time = histogram(
            "request_queue_time_seconds", "Time waiting before first scheduled", LATENCY_BUCKETS
        )
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per request", TOKEN_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per request", TOKEN_BUCKETS
        )
        reg.register(EngineStatsCollector(model_name, engine_stats))
        # Every series exists from the start, at zero, not only after its first event.
        for metric in (
            self.prompt_tokens,
            self.generation_tokens,
            self.ttft,
            self.itl,
            self.e2e,
            self.queue_time,
            self.request_prompt_tokens,
            self.request_generation_tokens,
        ):
            metric.labels(model_name)
        for reason in ("stop", "length"):
            self.request_success.labels(model_name, reason)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # Event hooks, called by the request handlers.
    def on_tokens(self, count: int, gap: float | None, sequences: int) -> None:
        """``count`` new tokens over ``sequences`` sequences, ``gap`` after their last ones."""
        self.generation_tokens.labels(self.model_name).inc(count)
        if gap is not None:
            for _ in range(sequences):
                self.itl.labels(self.model_name).observe(gap)

    def on_first_token(self, ttft: float, queue_time: float | None, prompt_tokens: int) -> None:
        self.ttft.labels(self.model_name).observe(ttft)
        if queue_time is not None:
            self.queue_time.labels(self.model_name).observe(max(0.0, queue_time))
        self.prompt_tokens.labels(self.model_name).inc(prompt_tokens)
        self.request_prompt_tokens.labels(self.model_name).observe(prompt_tokens)

    def on_finished(self, reason: str, e2e: float, generated_tokens: int) -> None:
        self.request_success.labels(self.model_name, reason).inc()
        self.e2e.labels(self.model_name).observe(e2e)
        self.request_generation_tokens.labels(self.model_name).observe(generated_tokens)
