"""The Serve app's HTTP pieces around a request: its body read within a limit, Serve's request id, a client that hung
up (the request task cancelled) told from a failure, an event stream that ends quietly on a hang-up, and an engine
error as the client sees it."""
import asyncio
import logging

from fastapi import Request
from fastapi.responses import StreamingResponse
from ray import serve

from pipeline.openai_protocol import APIError

log = logging.getLogger("ray.serve.specee")
MAX_BODY_BYTES = 4 << 20  # far beyond any prompt that fits the context; bounds tokenizer work


class EventStream(StreamingResponse):
    """Server-sent events whose client may hang up. Under Serve, receive() reports the hang-up as a
    TaskCancelledError rather than an http.disconnect message; taken as the disconnect it is, the
    stream ends quietly (its generator logs the hang-up at info) instead of as a failed request."""

    async def listen_for_disconnect(self, receive) -> None:
        try:
            await super().listen_for_disconnect(receive)
        except Exception as e:  # noqa: BLE001 -- only a hang-up is swallowed
            if not hung_up(e):
                raise


def rss_mb() -> float:
    """This process's resident memory in MB (Linux /proc; 0 elsewhere)."""
    from specee_core.machine import resident_memory

    return round(resident_memory()[0] / 2**20, 1)


def hung_up(e: BaseException) -> bool:
    """Whether e is how a request ends when its client goes away: the request task cancelled."""
    from ray.exceptions import TaskCancelledError

    return isinstance(e, (asyncio.CancelledError, TaskCancelledError))


def request_id(request: Request | None = None) -> str:
    """Serve's id of the request being handled (also sent back as X-Request-Id)."""
    try:
        return serve.context._get_serve_request_context().request_id or "-"
    except Exception:  # noqa: BLE001 -- outside a request (tests calling handlers directly)
        return request.headers.get("x-request-id", "-") if request is not None else "-"


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The raw request body, refusing bodies over `limit` bytes without reading them whole."""
    declared = request.headers.get("content-length", "")
    # ASCII digits ("²" passes isdigit alone), and few enough for int() (it refuses over 4,300 digits)
    if declared.isascii() and declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
        raise APIError(f"request body is {declared} bytes; the limit is {limit}", status=413, code="body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(f"request body is over the limit of {limit} bytes", status=413, code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def engine_error(e: Exception) -> APIError:
    """An exception from SpecEEEngine.generate as the client sees it."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ValueError):  # PromptError included; inputs are checked before, so this is rare
        return APIError(str(e))
    log.error("engine call failed: %r", e, exc_info=e)
    return APIError(f"generation failed: {type(e).__name__}", status=500, type="server_error")
