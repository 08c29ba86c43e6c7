"""Offline batch inference without HTTP: what vLLM's `LLM` class and `run-batch` are to its
users, over the same engine as `stepserve serve`.

`OfflineEngine` starts the engine the server runs (worker process, scheduler, output
processor; built by the same factory from the same flags) and answers OpenAI request bodies
through the HTTP routes' own validation, tokenization and response code (`respond_whole`).
It submits every request at once, so the scheduler plans over the whole batch; the run is
the engine's only client, so no waiting limit applies. `LLM` is its synchronous face for
scripts and notebooks: the engine runs on an event loop in a thread of its own.

Batch files are JSON Lines, one request a line, answered in the same order. A line is either
a line of OpenAI's Batch API (`custom_id`, `method` POST, `url` /v1/completions or
/v1/chat/completions, `body`), answered as that API answers (`id`, `custom_id`, `response`
with `status_code`, `request_id` and `body`, and `error`), or a bare request body (a chat
request when it has `messages`), answered by the bare response body or by `{"error": ...}`.
A line that fails (not JSON, a field refused, a prompt too long) fails alone, with the status
and error body the server would have sent.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import threading
import uuid
from collections.abc import Coroutine, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from tqdm import tqdm

from service.cli.args import parse_serve_args
from service.cli.checks import CheckedFlags, FlagError, check_serve_flags
from service.cli.serve import Refusal, engine_factory
from service.cli.serve_args import build_parser
from service.http.errors import APIError, bad_request, request_error
from service.http.openai_routes import json_object, respond_whole
from service.http.state import AppConfig, LoadedEngine, ServiceState, Status

log = logging.getLogger("stepserve.offline")
T = TypeVar("T")

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@dataclass(frozen=True)
class BatchItem:
    """One line of a batch file, read: the request body and where it goes, or why not."""

    body: Any
    chat: bool
    batch_line: bool = False  # an OpenAI Batch API line: answered in that API's shape
    custom_id: str | None = None
    error: APIError | None = None  # the line itself is wrong; nothing is submitted


@dataclass(frozen=True)
class Answer:
    """A request's outcome: the HTTP status the server would have sent, and the body."""

    status: int
    body: dict[str, Any]


def read_line(line: str) -> BatchItem:
    """A batch file's line as a request, read as the server reads a request body (NaN and
    Infinity reach validation and are refused there by field name)."""
    try:
        data = json_object(line.encode())
    except APIError as exc:
        return BatchItem(None, False, error=exc)
    if not {"custom_id", "url", "method"} & data.keys():
        return BatchItem(data, chat="messages" in data)
    custom_id = data.get("custom_id")
    custom_id = custom_id if isinstance(custom_id, str) else None
    url, method = data.get("url"), data.get("method", "POST")

    def refused(message: str, param: str) -> BatchItem:
        return BatchItem(None, False, True, custom_id, bad_request(message, param))

    if custom_id is None:
        return refused("a batch line needs a custom_id string", "custom_id")
    if method != "POST":
        return refused(f"method must be POST, got {method!r}", "method")
    if url not in (COMPLETIONS, CHAT):
        return refused(f"url must be {COMPLETIONS} or {CHAT}, got {url!r}", "url")
    if not isinstance(data.get("body"), dict):
        return refused("a batch line needs a body object", "body")
    return BatchItem(data["body"], url == CHAT, True, custom_id)


def result_line(item: BatchItem, answer: Answer) -> dict[str, Any]:
    """What the output file holds for `item`: OpenAI's batch output line, or the bare body."""
    if not item.batch_line:
        return answer.body
    request_id = answer.body.get("id") if answer.status == 200 else None
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": item.custom_id,
        "response": {
            "status_code": answer.status,
            "request_id": request_id or f"req_{uuid.uuid4().hex}",
            "body": answer.body,
        },
        "error": None,
    }


class OfflineEngine:
    """The server's engine started in this process's event loop, answering request bodies."""

    def __init__(
        self, args: argparse.Namespace, checked: CheckedFlags, own_process: bool = True
    ) -> None:
        """`own_process`: the process is the run's alone (`stepserve generate`), so its
        collector may be tuned as the server's is."""
        self.args, self.checked, self.own_process = args, checked, own_process
        self.refusal = Refusal()  # a flag the worker refused at start-up
        self.state = ServiceState(
            AppConfig(
                tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None
            )
        )

    @property
    def loaded(self) -> LoadedEngine:
        return self.state.require_ready()

    async def start(self) -> None:
        """Start the worker and the engine loop; raises `StartupRefused` for a flag the worker
        refuses (its `FlagError` left in `refusal`)."""
        self.state.loaded = await engine_factory(self.args, self.refusal, self.own_process)()
        self.state.loaded.engine.start()
        self.state.status = Status.READY

    async def answer(self, item: BatchItem) -> Answer:
        """One request answered whole; a refusal or failure as the server's error body."""
        if item.error is not None:
            return Answer(item.error.status, item.error.body())
        try:
            body = await respond_whole(
                self.state,
                self.loaded,
                self.checked.generation_defaults,
                item.body,
                chat=item.chat,
            )
        except Exception as exc:
            error = request_error(exc)
            if error is None:
                log.exception("request failed")
                error = APIError(500, f"internal error: {exc}")
            return Answer(error.status, error.body())
        return Answer(200, body)

    async def run(self, items: Sequence[BatchItem], progress: bool = True) -> list[Answer]:
        """Every item answered, in order; all submitted at once."""
        with tqdm(
            total=len(items),
            unit="req",
            disable=None if progress else True,
            desc="stepserve generate",
        ) as bar:

            async def one(item: BatchItem) -> Answer:
                answer = await self.answer(item)
                bar.update()
                return answer

            return list(await asyncio.gather(*(one(item) for item in items)))

    @property
    def failed(self) -> str | None:
        """Why the engine stopped, if it did (its remaining requests answered 503 or 500)."""
        loaded = self.state.loaded
        if loaded is None or not loaded.engine.dead.is_set():
            return None
        return loaded.engine.error or "the engine stopped"

    async def close(self) -> None:
        """Stop the engine loop and the worker process."""
        self.state.status = Status.DRAINING
        if self.state.loaded is not None:
            await self.state.loaded.engine.shutdown()
        self.state.executor.shutdown(wait=False, cancel_futures=True)


class RequestError(Exception):
    """A request `LLM.generate` or `LLM.chat` sent was refused or failed."""

    def __init__(self, answer: Answer) -> None:
        error = answer.body.get("error", {})
        super().__init__(f"{answer.status}: {error.get('message', answer.body)}")
        self.status = answer.status
        self.body = answer.body


class LLM:
    """The engine in this process, for scripts and notebooks:

        with LLM("--max-num-seqs", "64") as llm:
            for response in llm.generate(["The capital of France is"], max_tokens=16):
                print(response["choices"][0]["text"])

    `flags` are `stepserve serve`'s model, cache and scheduler flags (`stepserve generate
    --help` lists them); `model` is a GGUF file or a model directory (default: the bundled
    SmolLM2-135M-Instruct). Requests take the OpenAI API's fields and answer with its
    response bodies. The calling process's garbage collector is left as it is, and its CPU
    policy unless `--engine-cpu-scheduling` is given. Close it (or use `with`) to stop its
    worker."""

    def __init__(self, *flags: str, model: str | None = None, progress: bool = False) -> None:
        argv = [*flags, *(["--model", model] if model else [])]
        parser = build_parser(offline=True)
        parser.set_defaults(engine_cpu_scheduling=None)  # the caller's policy, unless given
        try:
            args = parse_serve_args(parser, argv)
        except SystemExit:  # argparse printed what it refused
            raise ValueError(f"flags refused: {' '.join(argv)}") from None
        if args.input is not None or args.output is not None:
            raise ValueError("--input and --output are `stepserve generate`'s; use LLM.run")
        checked = check_serve_flags(args)  # FlagError, naming the flag
        self.progress = progress
        self._engine = OfflineEngine(args, checked, own_process=False)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="stepserve-offline", daemon=True
        )
        self._thread.start()
        self._closed = False
        try:
            self._call(self._engine.start())
        except BaseException:
            self.close()
            if self._engine.refusal.error is not None:
                raise self._engine.refusal.error from None
            raise

    @property
    def model_name(self) -> str:
        return self._engine.loaded.model_name

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def run(self, bodies: Iterable[dict[str, Any]], *, chat: bool | None = None) -> list[Answer]:
        """Each request body answered whole, in order (a chat request when `chat`, or when
        None, when it has `messages`); a refused request is an `Answer` with its error."""
        if self._closed:
            raise RuntimeError("this LLM is closed")
        items = [BatchItem(b, "messages" in b if chat is None else chat) for b in bodies]
        return self._call(self._engine.run(items, self.progress))

    def generate(self, prompts: str | Sequence[str], **fields: Any) -> list[dict[str, Any]]:
        """A completion response body per prompt; `fields` are the request's other fields
        (max_tokens, temperature, logprobs, response_format, ...). Raises `RequestError`
        if any request is refused."""
        prompts = [prompts] if isinstance(prompts, str) else prompts
        return _bodies(self.run([{"prompt": p, **fields} for p in prompts], chat=False))

    def chat(
        self,
        conversations: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        **fields: Any,
    ) -> list[dict[str, Any]]:
        """A chat response body per conversation (one conversation: a list of messages);
        `fields` as in `generate`. Raises `RequestError` if any request is refused."""
        one = bool(conversations) and isinstance(conversations[0], dict)
        batch = cast(Sequence[Sequence[dict[str, Any]]], [conversations] if one else conversations)
        return _bodies(self.run([{"messages": list(c), **fields} for c in batch], chat=True))

    def close(self) -> None:
        """Stop the worker and the loop thread; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._call(self._engine.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _bodies(answers: list[Answer]) -> list[dict[str, Any]]:
    for answer in answers:
        if answer.status != 200:
            raise RequestError(answer)
    return [a.body for a in answers]


__all__ = [
    "LLM",
    "Answer",
    "BatchItem",
    "FlagError",
    "OfflineEngine",
    "RequestError",
    "read_line",
    "result_line",
]
