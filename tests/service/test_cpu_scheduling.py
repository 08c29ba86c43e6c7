"""The server process's CPU scheduling policy (`--engine-cpu-scheduling`, service.cli.cpu_scheduling):
SCHED_BATCH on every engine thread by default, SCHED_OTHER in the worker process."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from service.cli.cpu_scheduling import apply_engine_cpu_scheduling
from service.cli.serve_args import build_parser

REPO = Path(__file__).resolve().parents[2]
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SCHED_BATCH is Linux's")


def _thread_policies(pid: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            out.append(os.sched_getscheduler(int(tid)))
    return out


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:  # field 4: the parent's pid
                out.append(int(entry))
    return out


def _run(code: str) -> str:
    """`code` in a fresh interpreter (the policy must not leak into the test process)."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@linux_only
def test_batch_reaches_every_thread_and_normal_restores_it() -> None:
    out = _run("""
        import os, threading
        from service.cli.cpu_scheduling import apply_engine_cpu_scheduling
        stop = threading.Event()
        threading.Thread(target=stop.wait, daemon=True).start()  # a thread started before
        def policies():
            return sorted({os.sched_getscheduler(int(t)) for t in os.listdir("/proc/self/task")})
        print(apply_engine_cpu_scheduling("batch"))
        print(policies() == [os.SCHED_BATCH])
        later = []
        t = threading.Thread(target=lambda: later.append(os.sched_getscheduler(0)))  # a thread started after
        t.start(); t.join()
        print(later == [os.SCHED_BATCH])
        print(apply_engine_cpu_scheduling("normal"))
        print(policies() == [os.SCHED_OTHER])
    """)
    assert out.splitlines() == ["engine scheduling policy batch (SCHED_BATCH)", "True", "True",
                                "engine scheduling policy normal (SCHED_OTHER)", "True"]


@linux_only
def test_a_worker_process_sets_itself_back_to_sched_other() -> None:
    out = _run("""
        import os
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))  # as inherited from the engine
        from worker.process.main import _normal_scheduling
        _normal_scheduling()
        print(os.sched_getscheduler(0) == os.SCHED_OTHER)
    """)
    assert out == "True"


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="batch"):
        apply_engine_cpu_scheduling("fifo")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--engine-cpu-scheduling", "fifo"])
    assert build_parser().parse_args([]).engine_cpu_scheduling == "batch"


@linux_only
def test_live_server_runs_sched_batch_and_its_worker_sched_other(live_server: Any) -> None:
    server_pid = live_server.process.pid
    assert set(_thread_policies(server_pid)) == {os.SCHED_BATCH}
    workers = [pid for pid in _children(server_pid) if b"multiprocessing.spawn" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert workers, "no worker process under the server"
    for pid in workers:
        assert set(_thread_policies(pid)) == {os.SCHED_OTHER}
    assert "engine scheduling policy batch (SCHED_BATCH)" in live_server.log_path.read_text(errors="replace")


@linux_only
def test_idle_helper_policy_reaches_the_intra_op_helpers_only() -> None:
    out = _run("""
        import os, threading, torch
        torch.set_num_threads(2)
        from worker.process.cpu_scheduling import apply_helper_cpu_scheduling, intra_op_helpers
        print(apply_helper_cpu_scheduling("normal"))
        helpers = intra_op_helpers()
        print(len(helpers), threading.get_native_id() not in helpers)
        print(apply_helper_cpu_scheduling("idle"))
        policies = {int(t): os.sched_getscheduler(int(t)) for t in os.listdir("/proc/self/task")}
        print([policies[t] for t in helpers] == [os.SCHED_IDLE], os.sched_getscheduler(0) == os.SCHED_OTHER)
        print(sorted(policies.values()).count(os.SCHED_IDLE))
        a = torch.randn(256, 256)
        print(torch.allclose(a @ a, (a.double() @ a.double()).float(), atol=1e-3))  # the pool still computes
    """)
    assert out.splitlines() == ["worker helper threads: SCHED_OTHER", "1 True",
                                "worker helper threads: SCHED_IDLE on 1 (only for a machine without busy neighbours)",
                                "True True", "1", "True"]


@linux_only
def test_auto_helper_policy_leaves_sched_idle_while_starved_and_returns() -> None:
    """`auto`: SCHED_IDLE helpers; a CPU-bound process on every core starves the helper of a
    parallel region, and the watchdog puts it back under SCHED_OTHER; once the neighbours
    are gone and the hold (1 s) is over, it is SCHED_IDLE again."""
    out = _run("""
        import os, subprocess, sys, time, torch
        torch.set_num_threads(2)
        from worker.process.cpu_scheduling import apply_helper_cpu_scheduling, intra_op_helpers, watchdog_stats
        print(apply_helper_cpu_scheduling("auto").startswith("worker helper threads: SCHED_IDLE on 1, back to SCHED_OTHER"))
        (helper,) = intra_op_helpers()
        print(os.sched_getscheduler(helper) == os.SCHED_IDLE, watchdog_stats())
        x = torch.randn(4_000_000)
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
        try:
            deadline = time.monotonic() + 20
            while watchdog_stats()["demotions"] == 0 and time.monotonic() < deadline:
                (x * 1.5).sum()  # parallel regions the helper takes part in
            print(watchdog_stats()["demotions"] >= 1, os.sched_getscheduler(helper) == os.SCHED_OTHER)
        finally:
            for p in spinners:
                p.kill()
                p.wait()
        deadline = time.monotonic() + 20
        while watchdog_stats()["restores"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = watchdog_stats()
        print(stats["restores"] >= 1, stats["normal_now"], os.sched_getscheduler(helper) == os.SCHED_IDLE)
        print(torch.allclose((x * 1.5).sum(), x.double().sum().float() * 1.5, rtol=1e-3))
    """)
    assert out.splitlines() == ["True", "True {'demotions': 0, 'restores': 0, 'normal_now': 0}",
                                "True True", "True 0 True", "True"]


@linux_only
def test_auto_helper_policy_stays_normal_where_idle_cannot_be_left() -> None:
    """Unprivileged, with the default RLIMIT_NICE, a thread cannot leave SCHED_IDLE: `auto`
    then keeps the helpers SCHED_OTHER instead of risking a helper starved for good."""
    out = _run("""
        import os, torch
        torch.set_num_threads(2)
        from worker.process import cpu_scheduling as thread_policy
        real = os.sched_setscheduler
        def refuse(pid, policy, param):
            if policy == os.SCHED_OTHER and os.sched_getscheduler(pid) == os.SCHED_IDLE:
                raise PermissionError(1, "Operation not permitted")
            return real(pid, policy, param)
        os.sched_setscheduler = refuse
        print(thread_policy.can_leave_idle())
        print(thread_policy.apply_helper_cpu_scheduling("auto"))
        print([os.sched_getscheduler(t) for t in thread_policy.intra_op_helpers()] == [os.SCHED_OTHER])
    """)
    lines = out.splitlines()
    assert lines[0] == "False" and lines[2] == "True"
    assert lines[1].startswith("worker helper threads: SCHED_OTHER (auto needs")


def test_unknown_helper_policy_is_refused() -> None:
    from worker.config import WorkerConfig
    from worker.process.cpu_scheduling import apply_helper_cpu_scheduling

    with pytest.raises(ValueError, match="idle"):
        apply_helper_cpu_scheduling("batch")
    with pytest.raises(ValueError, match="helper_cpu_scheduling"):
        WorkerConfig(model="x", helper_cpu_scheduling="fifo")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--helper-cpu-scheduling", "fifo"])
    assert build_parser().parse_args([]).helper_cpu_scheduling == "normal"


@linux_only
@pytest.mark.slow
def test_live_worker_runs_its_helper_sched_idle_when_asked(start_server: Any, tmp_path: Path, tokenizer: Any) -> None:
    import openai
    from tiny_models import make_tiny_hf_model

    model = tmp_path / "tiny-llama"
    make_tiny_hf_model(vocab_size=len(tokenizer), max_position_embeddings=256).save_pretrained(model)
    tokenizer.save_pretrained(model)
    server = start_server(tmp_path, "--model", str(model), "--served-model-name", "tiny", "--num-threads", "2",
                          "--helper-cpu-scheduling", "idle")
    workers = [pid for pid in _children(server.process.pid)
               if b"multiprocessing.spawn" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(workers) == 1, "no worker process under the server"
    policies = _thread_policies(workers[0])
    assert policies.count(os.SCHED_IDLE) == 1 and os.sched_getscheduler(workers[0]) == os.SCHED_OTHER
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    done = client.completions.create(model="tiny", prompt="Hello there", max_tokens=8, temperature=0)
    assert done.usage is not None and done.usage.completion_tokens == 8
    assert "SCHED_IDLE on 1" in server.log_path.read_text(errors="replace")
