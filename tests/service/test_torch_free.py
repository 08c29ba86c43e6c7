"""The server's front process never imports torch or transformers: checked in a fresh
interpreter that imports `service.cli.serve`, loads the default tokenizer, renders a chat
template, builds the app with an engine whose worker (its own process) runs `InstantRunner`,
and answers a chat completion through it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_SERVE_A_CHAT = """
import asyncio, sys
import service.cli.serve
from aiohttp.test_utils import TestClient, TestServer
from common.tokenizer import apply_chat_template, load_tokenizer
from scheduler.scheduler import Scheduler
from service.cli.serve import build_parser, scheduler_config, worker_config
from service.engine.loop import AsyncEngine
from service.engine.metrics import ServiceMetrics
from service.http.app import create_app
from service.http.state import STATE, AppConfig, LoadedEngine
from worker.process.client import WorkerClient

tokenizer = load_tokenizer()
chat = [{"role": "user", "content": "Hi there"}]
prompt = apply_chat_template(tokenizer, chat)
args = build_parser().parse_args(["--kv-cache-memory", "16777216B", "--max-model-len", "256"])

async def build():
    worker = WorkerClient(worker_config(args), "worker.execution.instant_runner:InstantRunner")
    info = await worker.start()
    engine = AsyncEngine(Scheduler(scheduler_config(args, info)), worker, tokenizer,
                         eos_token_ids=info.eos_token_ids, metrics=ServiceMetrics(info.model_name))
    return LoadedEngine(engine, info.model_name, info.max_model_len, info.vocab_size,
                        info.model_path)

async def main():
    app = create_app(AppConfig(), build)
    client = TestClient(TestServer(app))
    await client.start_server()
    try:
        state = app[STATE]
        waits = [asyncio.ensure_future(e.wait()) for e in (state.ready, state.fatal)]
        await asyncio.wait(waits, timeout=240, return_when=asyncio.FIRST_COMPLETED)
        assert state.ready.is_set(), state.error
        resp = await client.post("/v1/chat/completions", json={"messages": chat, "max_tokens": 3})
        body = await resp.json()
        assert resp.status == 200, body
        assert body["usage"]["prompt_tokens"] == len(prompt), body
        print("completion tokens", body["usage"]["completion_tokens"])
    finally:
        await client.close()

asyncio.run(main())
print("forbidden:", sorted({m.split(".")[0] for m in sys.modules} & {"torch", "transformers"}))
"""


def test_front_process_serves_a_chat_without_torch_or_transformers() -> None:
    res = subprocess.run([sys.executable, "-c", _SERVE_A_CHAT], cwd=REPO, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr[-4000:]
    assert "completion tokens 3" in res.stdout, res.stdout
    assert "forbidden: []" in res.stdout, res.stdout
