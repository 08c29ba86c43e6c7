"""One streamed request to an OpenAI-compatible server, timed chunk by chunk.

`send_request` posts a `WorkloadRequest` to `/v1/completions` or `/v1/chat/completions`
with ``stream: true`` and ``stream_options.include_usage``, reads the SSE ``data:`` lines
and returns a `RequestRecord`: TTFT at the first non-empty content chunk, one
inter-token latency per later content chunk, end-to-end latency at the end of the
stream, token counts from the usage chunk, the streamed text. Every failure (HTTP status,
error event, connection error, timeout) becomes a failed record with its message (and the
text that arrived before it); none is raised.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from loadgen.report import RequestRecord
from loadgen.workloads import WorkloadRequest


@dataclass(frozen=True)
class Target:
    """Where and how to send requests."""

    url: str  # full URL of the endpoint, e.g. http://127.0.0.1:8000/v1/completions
    model: str
    api_key: str | None = None
    ignore_eos: bool = False  # ask for exactly max_tokens (ignore_eos + min_tokens)
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)  # merged into every request

    @property
    def chat(self) -> bool:
        """Whether the endpoint is the chat completions API."""
        return self.url.rstrip("/").endswith("chat/completions")


def build_payload(target: Target, req: WorkloadRequest) -> dict[str, Any]:
    """The JSON body for `req`: text prompt when there is one, else the token ids."""
    body: dict[str, Any] = {
        "model": target.model,
        "max_tokens": req.output_len,
        "temperature": target.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.chat:
        if req.prompt_text is None:
            raise ValueError(
                f"{req.request_id}: the chat endpoint needs text prompts (use a tokenizer)"
            )
        body["messages"] = [{"role": "user", "content": req.prompt_text}]
    else:
        body["prompt"] = req.prompt_text if req.prompt_text is not None else req.prompt_token_ids
    if target.ignore_eos:
        body["ignore_eos"] = True
        body["min_tokens"] = req.output_len
    if req.priority:
        body["priority"] = req.priority
    if req.user is not None:
        body["user"] = req.user
    body.update(target.extra_body)
    return body


def _headers(target: Target) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if target.api_key:
        headers["Authorization"] = f"Bearer {target.api_key}"
    return headers


def _content(event: dict[str, Any], chat: bool) -> str:
    """The generated text in one stream event ("" for usage-only or role-only events)."""
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if chat:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def _error_text(resp: aiohttp.ClientResponse) -> str:
    """`HTTP <status>: <message>` from an error response (OpenAI error JSON or raw text)."""
    raw = await resp.text()
    try:
        err = json.loads(raw).get("error", raw)
        message = err.get("message", str(err)) if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        message = raw
    return f"HTTP {resp.status}: {message.strip()[:500]}"


class _StreamTimer:
    """Accumulates one response stream's timing and usage."""

    def __init__(self, record: RequestRecord, sent: float) -> None:
        self.record, self.sent = record, sent
        self.last: float | None = None
        self.chunks = 0
        self.usage: dict[str, Any] | None = None
        self.text: list[str] = []

    def on_event(self, event: dict[str, Any], chat: bool, now: float) -> None:
        if "error" in event:
            err = event["error"]
            raise RuntimeError(err.get("message", str(err)) if isinstance(err, dict) else str(err))
        if event.get("usage"):
            self.usage = event["usage"]
        text = _content(event, chat)
        if not text:
            return
        self.text.append(text)
        if self.last is None:
            self.record.ttft = now - self.sent
        else:
            self.record.itls.append(now - self.last)
        self.last, self.chunks = now, self.chunks + 1

    def finish(self, now: float, prompt_len: int) -> None:
        rec = self.record
        rec.e2el = now - self.sent
        usage = self.usage or {}
        rec.prompt_tokens = int(usage.get("prompt_tokens", prompt_len))
        rec.output_tokens = int(usage.get("completion_tokens", self.chunks))
        rec.success = True


async def send_request(
    session: aiohttp.ClientSession, target: Target, req: WorkloadRequest, run_start: float
) -> RequestRecord:
    """Send `req`, stream its answer, and return what happened (never raises on failure)."""
    record = RequestRecord(
        request_id=req.request_id, success=False, priority=req.priority,
        arrival_time=req.arrival_time, group=req.group, user=req.user,
        prompt_tokens=req.prompt_len,
    )
    sent = time.perf_counter()
    record.start_time = sent - run_start
    timer = _StreamTimer(record, sent)
    try:
        body = build_payload(target, req)
        async with session.post(target.url, json=body, headers=_headers(target)) as resp:
            if resp.status != 200:
                record.error = await _error_text(resp)
                return record
            async for raw in resp.content:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                timer.on_event(json.loads(data), target.chat, time.perf_counter())
        timer.finish(time.perf_counter(), req.prompt_len)
    except Exception as exc:  # any failure is reported in the record, never dropped
        record.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        record.e2el = time.perf_counter() - sent
        record.success = False
    record.generated_text = "".join(timer.text)
    return record
