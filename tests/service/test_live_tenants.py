"""The OpenAI `user` field reaches the fair scheduler through the HTTP API of a live
`stepserve serve --scheduling-policy fair` (the real `openai` client; an InstantRunner
worker keeps the server cheap). Each tenant's service is prompt tokens + 2 x output
tokens (the default prices), and its VTC counter is that divided by its share weight."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

pytestmark = pytest.mark.slow

INSTANT_ARGS = ("--worker-runner", "worker.execution.instant_runner:InstantRunner", "--kv-cache-memory", "512MiB")


def test_user_field_is_the_fair_schedulers_tenant(tmp_path: Path, start_server: Any) -> None:
    server = start_server(tmp_path, *INSTANT_ARGS, "--scheduling-policy", "fair",
                          "--tenant-weights", "alice=2", "--victim-policy", "fewest_output")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    expected: dict[str, float] = {}
    # Sequential requests: nobody is backlogged when one arrives, so no counter is lifted.
    for user, prompt, n in (("alice", "one two three", 5), ("bob", "four five", 3), (None, "six", 4),
                            ("alice", "seven eight nine ten", 2)):
        extra = {"user": user} if user else {}
        resp = client.completions.create(model=model, prompt=prompt, max_tokens=n,
                                         extra_body={"ignore_eos": True}, **extra)
        assert resp.usage is not None and resp.usage.completion_tokens == n
        tenant = user or "default"
        expected[tenant] = expected.get(tenant, 0.0) + resp.usage.prompt_tokens + 2 * n
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=3, user="bob", extra_body={"ignore_eos": True})
    assert chat.usage is not None
    expected["bob"] += chat.usage.prompt_tokens + 2 * 3
    status, kv = server.get_json("/debug/kv")
    assert status == 200
    tenants = kv["tenants"]
    assert {t: v["served"] for t, v in tenants.items()} == expected
    assert tenants["alice"]["counter"] == expected["alice"] / 2
    assert tenants["bob"]["counter"] == expected["bob"]
    assert tenants["default"]["counter"] == expected["default"]
