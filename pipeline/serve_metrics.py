"""The engine's own Prometheus metrics, beside Ray Serve's, under vLLM's names with a `specee_` prefix
(vLLM: `vllm:num_requests_waiting`, ...). Each is recorded twice:

- with ray.serve.metrics: Ray's metrics agent exports them on the node's metrics port with Serve's
  (`ray_serve_*`), as `ray_specee_*`, tagged with the replica's deployment / replica / application: the
  aggregate over replicas;
- in the replica's own prometheus_client registry, served by the app at GET /metrics (labels
  model_name and replica): what this one replica has seen. Through Serve's proxy a scrape reaches one
  replica of several, so the replica label keeps each replica's counters their own series.

    specee_num_requests_running       gauge      prompts decoding
    specee_num_requests_waiting       gauge      prompts admitted and waiting for a row
    specee_batch_occupancy_perc       gauge      rows decoding / max_batch_size
    specee_generation_tokens_per_s    gauge      generated tokens per second over the last interval
    specee_kv_cache_usage_perc        gauge      KV budget blocks in use (lanes and prefix cache)
    specee_num_preemptions_total      counter    rows preempted for KV memory (a gauge of the count in Ray's)
    specee_prefix_cache_hit_tokens_total counter prompt tokens found in the prefix cache
    specee_prompt_tokens_total        counter
    specee_generation_tokens_total    counter
    specee_request_success_total      counter    tag finished_reason: stop | length
    specee_time_to_first_token_seconds   histogram
    specee_inter_token_latency_seconds   histogram  mean time per output token after the first, per prompt
    specee_e2e_request_latency_seconds   histogram
    specee_exit_layer                    histogram  decoder layers run per generated token (SpecEE)
    specee_spec_decode_tokens_per_step   histogram  tokens a verify step produced, per prompt (accepted + 1)
"""
from __future__ import annotations

import threading
import time

import prometheus_client

LATENCY_BUCKETS = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0]
ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.2, 0.5, 1.0]
# the text format prometheus_client.generate_latest writes
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


class Metric:
    """One metric in Ray's metrics and in a replica's registry, updated together. kind: gauge, counter
    or histogram; `extra` tag keys are given per update (tags=...)."""

    def __init__(self, kind: str, name: str, doc: str, registry: prometheus_client.CollectorRegistry, *,
                 ray_tags: dict, labels: dict, buckets: list[float] | None = None, extra: tuple[str, ...] = ()):
        from ray.serve import metrics as m

        keys = (*ray_tags, *extra)
        if kind == "histogram":
            self._ray = m.Histogram(name, doc, boundaries=buckets, tag_keys=keys)
            local = prometheus_client.Histogram(name, doc, (*labels, *extra), registry=registry, buckets=buckets)
        else:
            self._ray = {"gauge": m.Gauge, "counter": m.Counter}[kind](name, doc, tag_keys=keys)
            local = {"gauge": prometheus_client.Gauge, "counter": prometheus_client.Counter}[kind](
                name, doc, (*labels, *extra), registry=registry)
        self._ray.set_default_tags(dict(ray_tags))  # serve adds its tags into the dict it is given
        self._labels = labels
        self._local = local.labels(**labels) if not extra else local

    def _child(self, tags: dict | None):
        return self._local.labels(**self._labels, **tags) if tags else self._local

    def set(self, value: float) -> None:
        self._ray.set(value)
        self._child(None).set(value)

    def inc(self, value: float = 1, tags: dict | None = None) -> None:
        self._ray.inc(value, tags=tags)
        self._child(tags).inc(value)

    def observe(self, value: float) -> None:
        self._ray.observe(value)
        self._child(None).observe(value)


class EngineMetrics:
    """A replica's engine metrics (see the module docstring); exposition() is its /metrics text."""

    def __init__(self, model_name: str, num_layers: int, max_rows: int, replica: str = "-"):
        self.max_rows = max_rows
        self.registry = prometheus_client.CollectorRegistry()
        ray_tags = {"model_name": model_name}  # Ray adds deployment, replica and application

        def metric(kind: str, name: str, doc: str, **kw) -> Metric:
            return Metric(kind, name, doc, self.registry, ray_tags=ray_tags,
                          labels={"model_name": model_name, "replica": replica}, **kw)

        self.running = metric("gauge", "specee_num_requests_running", "prompts decoding")
        self.waiting = metric("gauge", "specee_num_requests_waiting", "prompts waiting for a row")
        self.occupancy = metric("gauge", "specee_batch_occupancy_perc", "rows decoding / max_batch_size")
        self.rate = metric("gauge", "specee_generation_tokens_per_s", "generated tokens per second, last interval")
        self.kv_usage = metric("gauge", "specee_kv_cache_usage_perc", "KV budget blocks in use (lanes and prefix cache)")
        # the engine reports a running count: a gauge in Ray's metrics (as before), a counter here
        from ray.serve import metrics as m

        self._preemptions_ray = m.Gauge("specee_num_preemptions_total", "rows preempted for KV memory",
                                        tag_keys=tuple(ray_tags))
        self._preemptions_ray.set_default_tags(dict(ray_tags))
        self._preemptions = prometheus_client.Counter(
            "specee_num_preemptions_total", "rows preempted for KV memory", ("model_name", "replica"),
            registry=self.registry).labels(model_name=model_name, replica=replica)
        self._preempted = 0
        self.prefix_hits = metric("counter", "specee_prefix_cache_hit_tokens_total",
                                  "prompt tokens found in the prefix cache")
        self.prompt_tokens = metric("counter", "specee_prompt_tokens_total", "prompt tokens")
        self.generation_tokens = metric("counter", "specee_generation_tokens_total", "generated tokens")
        self.success = metric("counter", "specee_request_success_total", "prompts finished", extra=("finished_reason",))
        self.ttft = metric("histogram", "specee_time_to_first_token_seconds", "time to first token",
                           buckets=LATENCY_BUCKETS)
        self.itl = metric("histogram", "specee_inter_token_latency_seconds", "mean time per output token after the first",
                          buckets=ITL_BUCKETS)
        self.e2e = metric("histogram", "specee_e2e_request_latency_seconds", "end-to-end latency of a prompt",
                          buckets=LATENCY_BUCKETS)
        self.exit_layer = metric("histogram", "specee_exit_layer", "decoder layers run per generated token",
                                 buckets=[l + 0.5 for l in range(1, num_layers)])
        self.accepted = metric("histogram", "specee_spec_decode_tokens_per_step", "tokens per verify step, per prompt",
                               buckets=[1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 8])
        self._lock = threading.Lock()
        self._tokens_since = 0
        self._since = time.monotonic()

    def exposition(self) -> bytes:
        """This replica's metrics in Prometheus' text format (PROMETHEUS_TEXT)."""
        return prometheus_client.generate_latest(self.registry)

    def finished(self, results, mode: str) -> None:
        """Record the prompts of a request that ended (GenerationResults)."""
        n = 0
        for r in results:
            if r is None:
                continue
            n += len(r.token_ids)
            self.prompt_tokens.inc(r.prompt_tokens)
            if r.cached_prompt_tokens:
                self.prefix_hits.inc(r.cached_prompt_tokens)
            self.generation_tokens.inc(len(r.token_ids))
            self.success.inc(1, tags={"finished_reason": r.finish_reason})
            self.ttft.observe(r.metrics["ttft_s"])
            self.e2e.observe(r.metrics["e2e_latency_s"])
            if len(r.token_ids) > 1:
                self.itl.observe(r.metrics["tpot_s"])
            if mode == "specee":
                for layer in r.exit_layers:
                    self.exit_layer.observe(layer)
            per_step = r.stats.get("mean_tokens_per_step")
            if mode == "spec" and per_step:
                self.accepted.observe(per_step)
        with self._lock:
            self._tokens_since += n

    def memory(self, report: dict) -> None:
        """The engine core's KV budget (EngineCore.memory())."""
        self.kv_usage.set(100.0 * report["kv_blocks_used"] / max(report["kv_blocks"], 1))
        self._preemptions_ray.set(report["preemptions"])
        with self._lock:  # the health check's thread and the event loop both report
            new, self._preempted = report["preemptions"] - self._preempted, max(report["preemptions"], self._preempted)
        if new > 0:
            self._preemptions.inc(new)

    def load(self, running: int, waiting: int) -> None:
        """The batch's state now, and the token rate since the last call."""
        self.running.set(running)
        self.waiting.set(waiting)
        self.occupancy.set(100.0 * min(running, self.max_rows) / self.max_rows)
        with self._lock:
            now = time.monotonic()
            if now - self._since >= 1.0:
                self.rate.set(self._tokens_since / (now - self._since))
                self._tokens_since, self._since = 0, now
