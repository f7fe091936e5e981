"""The engine's own Prometheus metrics, beside Ray Serve's, under vLLM's names with a `specee_` prefix
(vLLM: `vllm:num_requests_waiting`, ...). They are recorded with ray.serve.metrics, so Ray's metrics
agent exports them on the node's metrics port with Serve's (`ray_serve_*`) and the replica's
deployment / replica / application tags.

    specee_num_requests_running       gauge      prompts decoding (continuous) or in the engine call (request)
    specee_num_requests_waiting       gauge      prompts admitted and waiting for a row
    specee_batch_occupancy_perc       gauge      rows decoding / max_batch_size
    specee_generation_tokens_per_s    gauge      generated tokens per second over the last interval
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

LATENCY_BUCKETS = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0]
ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.2, 0.5, 1.0]


class EngineMetrics:
    def __init__(self, model_name: str, num_layers: int, max_rows: int):
        from ray.serve import metrics as m

        self.max_rows = max_rows
        tags = ("model_name",)
        self._tags = {"model_name": model_name}
        self.running = m.Gauge("specee_num_requests_running", "prompts decoding", tag_keys=tags)
        self.waiting = m.Gauge("specee_num_requests_waiting", "prompts waiting for a row", tag_keys=tags)
        self.occupancy = m.Gauge("specee_batch_occupancy_perc", "rows decoding / max_batch_size", tag_keys=tags)
        self.rate = m.Gauge("specee_generation_tokens_per_s", "generated tokens per second, last interval",
                            tag_keys=tags)
        self.kv_usage = m.Gauge("specee_kv_cache_usage_perc", "KV budget blocks in use (lanes and prefix cache)",
                                tag_keys=tags)
        self.preemptions = m.Gauge("specee_num_preemptions_total", "rows preempted for KV memory", tag_keys=tags)
        self.prefix_hits = m.Counter("specee_prefix_cache_hit_tokens_total", "prompt tokens found in the prefix cache",
                                     tag_keys=tags)
        self.prompt_tokens = m.Counter("specee_prompt_tokens_total", "prompt tokens", tag_keys=tags)
        self.generation_tokens = m.Counter("specee_generation_tokens_total", "generated tokens", tag_keys=tags)
        self.success = m.Counter("specee_request_success_total", "prompts finished",
                                 tag_keys=(*tags, "finished_reason"))
        self.ttft = m.Histogram("specee_time_to_first_token_seconds", "time to first token",
                                boundaries=LATENCY_BUCKETS, tag_keys=tags)
        self.itl = m.Histogram("specee_inter_token_latency_seconds", "mean time per output token after the first",
                               boundaries=ITL_BUCKETS, tag_keys=tags)
        self.e2e = m.Histogram("specee_e2e_request_latency_seconds", "end-to-end latency of a prompt",
                               boundaries=LATENCY_BUCKETS, tag_keys=tags)
        self.exit_layer = m.Histogram("specee_exit_layer", "decoder layers run per generated token",
                                      boundaries=[l + 0.5 for l in range(1, num_layers)], tag_keys=tags)
        self.accepted = m.Histogram("specee_spec_decode_tokens_per_step", "tokens per verify step, per prompt",
                                    boundaries=[1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 8], tag_keys=tags)
        for metric in (self.running, self.waiting, self.occupancy, self.rate, self.kv_usage, self.preemptions,
                       self.prefix_hits, self.prompt_tokens,
                       self.generation_tokens, self.ttft, self.itl, self.e2e, self.exit_layer, self.accepted):
            metric.set_default_tags(dict(self._tags))  # serve adds its tags into the dict it is given
        self.success.set_default_tags(dict(self._tags))
        self._lock = threading.Lock()
        self._tokens_since = 0
        self._since = time.monotonic()

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
        self.preemptions.set(report["preemptions"])

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
