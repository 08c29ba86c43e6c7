"""Prefix caching: chained block hashes, shared blocks by reference count, LRU eviction."""

from __future__ import annotations

from sched_driver import MirrorWorker, drive, make_request

from scheduler import Scheduler, SchedulerConfig
from scheduler.block_pool import BlockPool


def _sched(blocks: int = 32, **kw: object) -> Scheduler:
    cfg = SchedulerConfig(
        max_num_batched_tokens=256, num_gpu_blocks=blocks, block_size=16, max_model_len=512,
        enable_prefix_caching=True, **kw,  # type: ignore[arg-type]
    )
    return Scheduler(cfg)


SYSTEM = list(range(500, 548))  # 3 full blocks


def test_later_request_reuses_cached_prefix() -> None:
    s = _sched()
    w = MirrorWorker(16, 32)
    s.add_request(make_request("a", 0, 4, prompt=SYSTEM + [1, 2, 3]))
    drive(s, w)
    s.add_request(make_request("b", 0, 4, prompt=SYSTEM + [7, 8]))
    plan = s.schedule(now=1)
    (new,) = plan.scheduled_new_reqs
    assert new.num_computed_tokens == 48 and plan.num_scheduled_tokens == {"b": 2}
    s.update_from_output(plan, w.execute(plan))  # the mirror checks the reused KV is a's prefix
    drive(s, w)
    assert s.stats().prefix_cache_hits == 48


def test_full_match_still_computes_last_token() -> None:
    s = _sched()
    w = MirrorWorker(16, 32)
    s.add_request(make_request("a", 0, 2, prompt=SYSTEM))
    drive(s, w)
    s.add_request(make_request("b", 0, 2, prompt=SYSTEM))
    plan = s.schedule(now=1)
    assert plan.scheduled_new_reqs[0].num_computed_tokens == 32  # 3rd block recomputed: 1 token needed
    assert plan.num_scheduled_tokens == {"b": 16}


def test_siblings_in_one_step_share_blocks_by_refcount() -> None:
    s = _sched()
    w = MirrorWorker(16, 32)
    for i in range(3):
        s.add_request(make_request(f"n-{i}", 0, 8, prompt=SYSTEM + [9]))
    plan = s.schedule(now=0)
    tables = [n.block_ids for n in plan.scheduled_new_reqs]
    assert tables[0][:3] == tables[1][:3] == tables[2][:3]
    assert [plan.num_scheduled_tokens[f"n-{i}"] for i in range(3)] == [49, 1, 1]
    assert s.kv.pool.ref_counts[tables[0][0]] == 3
    s.update_from_output(plan, w.execute(plan))
    s.abort("n-0")  # shared blocks stay held by the siblings
    s.check_integrity()
    assert s.kv.pool.ref_counts[tables[0][0]] == 2
    drive(s, w)
    assert s.num_free_blocks == 32
    assert len(s.kv.pool.cached) >= 3  # freed but still cached


def test_uncached_free_blocks_are_reused_before_cached_ones() -> None:
    pool = BlockPool(4, enable_caching=True)
    a = pool.allocate(2)
    pool.cache(a[0], (0, (1, 2)))
    pool.free(reversed(a))
    assert pool.allocate(1) == [a[1]]
    # a[1] had no content: reused first; then the never-used blocks; the cached block last
    rest = pool.allocate(3)
    assert rest[-1] == a[0]
    assert pool.lookup((0, (1, 2))) is None  # evicted on reuse


def test_lru_eviction_keeps_recent_prefixes() -> None:
    s = _sched(blocks=8)
    w = MirrorWorker(16, 8)
    for i, base in enumerate((1000, 2000, 3000)):
        s.add_request(make_request(f"r{i}", 0, 1, prompt=list(range(base, base + 33))))
        drive(s, w)
    # each request cached 2 full blocks; 8 blocks can hold all three prefixes plus tails
    s.add_request(make_request("big", 0, 1, prompt=list(range(9000, 9000 + 16 * 5 + 1))))
    drive(s, w)  # needs 6 blocks: evicts the oldest prefixes first
    s.add_request(make_request("again2", 0, 1, prompt=list(range(3000, 3033))))
    plan = s.schedule(now=9)
    assert plan.scheduled_new_reqs[0].num_computed_tokens == 32  # the newest prefix survived
    s.update_from_output(plan, w.execute(plan))
    drive(s, w)
    s.add_request(make_request("again0", 0, 1, prompt=list(range(1000, 1033))))
    plan = s.schedule(now=10)
    assert plan.scheduled_new_reqs[0].num_computed_tokens == 0  # the oldest was evicted


def test_generated_tokens_are_cached_for_followups() -> None:
    s = _sched()
    w = MirrorWorker(16, 32)
    a = make_request("a", 0, 40, prompt=SYSTEM[:20])
    s.add_request(a)
    drive(s, w)
    follow = a.all_token_ids + [5]  # a multi-turn follow-up repeats the whole conversation
    s.add_request(make_request("b", 0, 1, prompt=follow))
    plan = s.schedule(now=5)
    assert plan.scheduled_new_reqs[0].num_computed_tokens == 48  # 59 of 60 tokens were computed
    s.update_from_output(plan, w.execute(plan))
