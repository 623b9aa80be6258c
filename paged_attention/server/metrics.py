"""The server's Prometheus metrics: the engine's state after every step (requests running and
waiting, KV blocks used and free, prefix-cache hits, preemptions, tokens) and per-request
latencies (time to first token, inter-token latency, end to end) as histograms.

Every value is read in the engine's owner thread (:meth:`ServerMetrics.on_step`, the only place
the engine may be read) and kept in the server's own registry, so several servers in one
process (tests) do not share counters. The names follow vLLM's ``vllm:`` metrics where one
matches, with the ``paged_attention_`` prefix.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from paged_attention.engine import RequestOutput
from paged_attention.server.protocol import FINISH_REASONS

PREFIX = "paged_attention_"
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 20, 40)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 300, 600)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._snapshot: dict[str, float] = {}
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Seconds from a request's arrival to its first generated token.",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Seconds between consecutive engine steps that gave a request tokens.",
            buckets=ITL_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Seconds from a request's arrival to its end.",
            buckets=E2E_BUCKETS,
            registry=self.registry,
        )
        self.requests = Counter(
            PREFIX + "requests_finished",
            "Requests that ended, by finish reason (stop, length, abort, rejected).",
            ["finish_reason"],
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(self))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def on_step(self, engine, outputs: list[RequestOutput]) -> None:
        """Owner thread: record ``outputs`` and take a snapshot of the engine's state."""
        for output in outputs:
            metrics = output.metrics
            if output.rejected is not None:
                self.requests.labels("rejected").inc()
                continue
            if metrics is not None and any(output.new_tokens):
                times = metrics.token_times
                if len(times) == 1:
                    self.ttft.observe(times[0] - metrics.arrival_time)
                elif len(times) > 1:
                    self.itl.observe(times[-1] - times[-2])
            if output.finished:
                reasons = {FINISH_REASONS[r] for r in output.finish_reasons if r is not None}
                # a request of several samples counts once, by the reason that ended it
                label = next((r for r in ("abort", "length") if r in reasons), "stop")
                self.requests.labels(label).inc()
                if metrics is not None and metrics.finished_time is not None:
                    self.e2e.observe(metrics.finished_time - metrics.arrival_time)
        manager, scheduler, stats = engine.block_manager, engine.scheduler, engine.stats
        total = manager.num_device_blocks
        free = manager.num_free_device_blocks()
        self._snapshot = {  # one assignment: a scrape sees one step's values together
            "running": len(scheduler.running),
            "waiting": len(scheduler.waiting),
            "swapped": len(scheduler.swapped),
            "blocks_total": total,
            "blocks_free": free,
            "blocks_used": total - free,
            "prompt_tokens": stats.prompt_tokens,
            "prompt_tokens_cached": stats.prompt_tokens_cached,
            "generated_tokens": stats.generated_tokens,
            "preemptions": stats.swaps_out + stats.preemptions_by_recompute,
            "steps": stats.steps,
            "draft_tokens": stats.draft_tokens,
            "accepted_draft_tokens": stats.accepted_draft_tokens,
        }


class _EngineCollector:
    """The engine's gauges and counters, from the last snapshot."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self):
        s = self.metrics._snapshot
        if not s:
            return
        gauges = [
            ("num_requests_running", "Requests running in the engine.", s["running"]),
            ("num_requests_waiting", "Requests waiting to be admitted.", s["waiting"]),
            ("num_requests_swapped", "Requests preempted to host memory.", s["swapped"]),
            ("kv_blocks_total", "Device KV-cache blocks of the pool.", s["blocks_total"]),
            ("kv_blocks_used", "Device KV-cache blocks in use.", s["blocks_used"]),
            (
                "kv_blocks_free",
                "Device KV-cache blocks free (unreferenced prefix-cache blocks count as free).",
                s["blocks_free"],
            ),
            (
                "kv_cache_usage_ratio",
                "Fraction of the device KV-cache blocks in use.",
                s["blocks_used"] / max(s["blocks_total"], 1),
            ),
            (
                "prefix_cache_hit_rate",
                "Fraction of the admitted prompt tokens served by the prefix cache.",
                s["prompt_tokens_cached"] / max(s["prompt_tokens"], 1),
            ),
        ]
        for name, help_text, value in gauges:
            yield GaugeMetricFamily(PREFIX + name, help_text, value=value)
        counters = [
            ("prompt_tokens", "Prompt tokens of the admitted requests.", "prompt_tokens"),
            (
                "prefix_cache_hit_tokens",
                "Prompt tokens served by the prefix cache at admission.",
                "prompt_tokens_cached",
            ),
            ("generation_tokens", "Tokens generated, over all sequences.", "generated_tokens"),
            ("num_preemptions", "Requests preempted (swapped out or recomputed).", "preemptions"),
            ("engine_steps", "Engine steps run.", "steps"),
            (
                "spec_decode_num_draft_tokens",
                "Drafted tokens verified (speculative decoding).",
                "draft_tokens",
            ),
            (
                "spec_decode_num_accepted_tokens",
                "Drafted tokens the model accepted (speculative decoding).",
                "accepted_draft_tokens",
            ),
        ]
        for name, help_text, key in counters:
            yield CounterMetricFamily(PREFIX + name, help_text, value=s[key])
