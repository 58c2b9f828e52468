"""``/metrics``: the server's counters in Prometheus' text format (``prometheus-client``).

Each app has its own registry (not the process-wide default), so several apps in one process (tests, an
embedding program) count for themselves.  Two sources feed it:

* :class:`RequestCounter`, an ASGI middleware outside everything else, counts every HTTP request by route
  and status, refusals of the HTTP policy included;
* the engine worker reports each answer it finished (:meth:`ServerMetrics.answered`): prompt and
  generated tokens, drafted and accepted tokens and target passes, τ (tokens per target pass), decode
  speed and time to first token.  Queue depth and whether the engine is busy are read when scraped.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.routing import Match

from edge_spec.runtime.engine import GenerationStats
from edge_spec.server.openai_format import edge_spec_stats
from edge_spec.server.queue import EngineWorker, Job

CONTENT_TYPE = CONTENT_TYPE_LATEST
TAU_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)
SPEED_BUCKETS = (1, 2, 5, 10, 20, 30, 50, 75, 100, 150, 200, 300, 500, 1000)
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    """The metrics of one app, in their own registry."""

    def __init__(self, worker: EngineWorker) -> None:
        self.registry = registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "edge_spec_http_requests",
            "HTTP requests answered, by route and status",
            ["route", "status"],
            registry=registry,
        )
        waiting = Gauge("edge_spec_queue_waiting", "Requests waiting behind the one being answered", registry=registry)
        waiting.set_function(lambda: worker.waiting)
        busy = Gauge("edge_spec_engine_busy", "1 while the engine is answering a request", registry=registry)
        busy.set_function(lambda: 1 if worker.busy else 0)
        self.answers = Counter(
            "edge_spec_answers", "Answers the engine finished, by stop reason", ["stop_reason"], registry=registry
        )
        self.prompt_tokens = Counter("edge_spec_prompt_tokens", "Prompt tokens read", registry=registry)
        self.generated_tokens = Counter("edge_spec_generated_tokens", "Tokens generated", registry=registry)
        self.drafted = Counter(
            "edge_spec_drafted_tokens", "Tokens drafted for verification (speculative modes)", registry=registry
        )
        self.accepted = Counter("edge_spec_accepted_tokens", "Drafted tokens the target accepted", registry=registry)
        self.target_passes = Counter("edge_spec_target_passes", "Target passes that verified drafts", registry=registry)
        self.tau = Histogram(
            "edge_spec_tokens_per_target_pass",
            "τ of each answer: tokens per target pass (speculative modes)",
            buckets=TAU_BUCKETS,
            registry=registry,
        )
        self.speed = Histogram(
            "edge_spec_decode_tokens_per_second",
            "Decode speed of each answer (tokens after the first per decode second)",
            buckets=SPEED_BUCKETS,
            registry=registry,
        )
        self.ttft = Histogram(
            "edge_spec_time_to_first_token_seconds",
            "From a request's arrival in the queue to its first text",
            buckets=TTFT_BUCKETS,
            registry=registry,
        )

    def answered(self, job: Job, stats: GenerationStats) -> None:
        """Record one finished answer (called on the engine worker's thread)."""
        x = edge_spec_stats(stats, job.queue_seconds)
        self.answers.labels(stats.stop_reason or "unknown").inc()
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generated_tokens.inc(stats.new_tokens)
        if x["target_calls"]:
            self.drafted.inc(x["drafted"])
            self.accepted.inc(x["accepted"])
            self.target_passes.inc(x["target_calls"])
            self.tau.observe(stats.spec.tau)
        if stats.new_tokens > 1 and stats.decode_seconds > 0:
            self.speed.observe(stats.tokens_per_second)
        if job.time_to_first_text is not None:
            self.ttft.observe(job.time_to_first_text)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestCounter:
    """ASGI middleware counting HTTP requests by route template (``"other"`` for paths no route has, so that
    scanners cannot grow the label set) and response status (499: the client left before any answer)."""

    def __init__(self, app, metrics: ServerMetrics, routes) -> None:
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = None

        async def watch(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception:
            status = status or 500
            raise
        finally:
            self.metrics.requests.labels(self._route(scope), str(status or 499)).inc()

    def _route(self, scope) -> str:
        for route in self.routes:
            match, _ = route.matches(scope)
            if match is not Match.NONE:
                return route.path
        return "other"
