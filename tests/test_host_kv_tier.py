"""The host KV tier (worker/host_kv_tier.py): its books, the KV cache manager saving evicted blocks there and
restoring prefix hits from it, the engine's tokens with a restored prefix and across preemptions (the tiny model's
real KV bytes, copied by the model runner), the sim runner's copy time, and bad sizes refused at start."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from prometheus_client import generate_latest

from kvroute.hashing import block_hashes
from kvroute.sampling import SamplingParams
from worker.clock import VirtualClock
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.host_kv_tier import CopyCostMeter, HostKVTier, check_host_memory
from worker.kv_cache_manager import KVCacheManager
from worker.metrics import WorkerMetrics
from worker.sim_runner import SimRunner

BS = 4


def hashes(tokens: list[int]) -> list:
    return block_hashes(tokens, model_id="t", block_size=BS)


class ValueCopier:
    """The copier contract on plain values: what a device block holds is what the test wrote there."""

    def __init__(self) -> None:
        self.device: dict[int, object] = {}
        self.host: dict[int, object] = {}
        self.saved: list[int] = []
        self.restored: list[int] = []

    def copy_to_host(self, device_blocks: Sequence[int], host_slots: Sequence[int]) -> None:
        for block, slot in zip(device_blocks, host_slots, strict=True):
            self.host[slot] = self.device[block]
        self.saved.extend(device_blocks)

    def copy_from_host(self, host_slots: Sequence[int], device_blocks: Sequence[int]) -> None:
        for slot, block in zip(host_slots, device_blocks, strict=True):
            self.device[block] = self.host[slot]
        self.restored.extend(device_blocks)

    def copy_pays(self) -> bool:
        return self.pays

    pays = True


def compute(mgr: KVCacheManager, copier: ValueCopier, req_id: str, tokens: list[int]) -> tuple[int, int]:
    """Admit a request, 'compute' its blocks (write each block's hash as its content), check that every block
    of its hit holds the right content, cache and free it. Returns (hit tokens, of which from the host)."""
    hs = hashes(tokens)
    hit = mgr.find_prefix_hit(hs, len(tokens))
    mgr.record_prefix_query(hit, len(tokens))
    assert mgr.allocate_slots(req_id, len(tokens), hit.blocks, hit.restore) is not None
    table = mgr.block_table(req_id)
    num_hit = hit.num_tokens // BS
    for i, block_id in enumerate(table[:num_hit]):
        assert copier.device[block_id] == hs[i], f"block {i} of the hit holds another block's KV"
    for i, block_id in enumerate(table[num_hit:], num_hit):
        copier.device[block_id] = hs[i] if i < len(hs) else "partial"
    mgr.cache_blocks(req_id, hs, tokens)
    mgr.check_invariants()
    mgr.free(req_id)
    mgr.check_invariants()
    return hit.num_tokens, len(hit.restore) * BS


def test_the_host_tiers_books_lru_pins_and_one_slot_per_hash():
    tier = HostKVTier(2)
    a, b, c = hashes(list(range(12)))
    evicted: list = []
    assert tier.reserve(a, evicted) == 0 and tier.reserve(b, evicted) == 1
    assert tier.reserve(a, evicted) is None  # held already: no copy, and a becomes the most recent
    assert tier.reserve(c, evicted) == 1 and b not in tier  # the least recent (b) made room
    assert evicted == [b] and tier.stats.evicted == 1
    assert tier.snapshot_page(0, 2) == [a, c] and tier.snapshot_page(1, 5) == [c]
    tier.pin([a, c])
    assert tier.reserve(b, evicted) is None and b not in tier  # every slot pinned: nothing is saved, nothing lost
    assert evicted == [b]
    tier.unpin([a, c])
    assert tier.prefix([a, b, c]) == [a]
    tier.check_invariants()
    tier.clear()
    assert len(tier) == 0
    tier.check_invariants()
    with pytest.raises(ValueError, match="at least one block"):
        HostKVTier(0)


def test_evicted_blocks_go_to_the_host_and_come_back_as_a_prefix_hit():
    copier = ValueCopier()
    mgr = KVCacheManager(4, BS, host_tier=HostKVTier(16), copier=copier)
    a = list(range(100, 113))  # 3 full blocks and one token
    assert compute(mgr, copier, "a1", a) == (0, 0)
    compute(mgr, copier, "b", list(range(200, 216)))  # 4 blocks: a's 3 cached blocks are evicted, to the host
    assert len(copier.saved) == 3
    hit, from_host = compute(mgr, copier, "a2", a)
    assert (hit, from_host) == (12, 12)  # every block of a's prompt, copied back
    assert mgr.stats.host_prefix_hits == 12 and mgr.stats.prefix_hits == 12
    assert mgr.host_tier is not None and mgr.host_tier.stats.restored == 3
    assert compute(mgr, copier, "a3", a) == (12, 0)  # now on the device again (registered as it ran)


def test_a_hit_continues_from_the_device_into_the_host_and_survives_its_own_evictions():
    """The restored blocks are pinned while the allocation that makes room for them evicts into a full host
    tier; the hit's device part and its host part join into one prefix."""
    copier = ValueCopier()
    mgr = KVCacheManager(6, BS, host_tier=HostKVTier(3), copier=copier)
    shared = list(range(8))  # 2 blocks
    compute(mgr, copier, "a", shared + list(range(300, 308)) + [1])  # 4 full blocks + 1 token
    compute(mgr, copier, "b", list(range(400, 412)) + [1])  # 3 full + 1: evicts a's tail (2 blocks) to host
    compute(mgr, copier, "c", shared + list(range(500, 504)) + [1])  # hits a's root on the device
    hit, from_host = compute(mgr, copier, "a2", shared + list(range(300, 308)) + [1])
    assert hit == 16 and 0 < from_host < 16
    mgr.check_invariants()


def test_a_full_host_tier_drops_its_least_recent_block_and_nothing_leaks():
    copier = ValueCopier()
    mgr = KVCacheManager(3, BS, host_tier=HostKVTier(2), copier=copier)
    for i in range(6):
        compute(mgr, copier, f"r{i}", list(range(1000 * i, 1000 * i + 8)) + [7])
    assert mgr.host_tier is not None
    assert len(mgr.host_tier) == 2 and mgr.host_tier.stats.evicted > 0
    assert compute(mgr, copier, "old", list(range(0, 8)) + [7]) == (0, 0)  # r0's blocks are gone from both
    assert compute(mgr, copier, "new", list(range(5000, 5008)) + [7]) == (8, 8)  # the most recent is there
    mgr.check_invariants()


def test_a_manager_without_prefix_caching_or_without_a_copier_is_refused():
    with pytest.raises(ValueError, match="needs prefix caching"):
        KVCacheManager(4, BS, enable_prefix_caching=False, host_tier=HostKVTier(4), copier=ValueCopier())
    with pytest.raises(ValueError, match="needs a copier"):
        KVCacheManager(4, BS, host_tier=HostKVTier(4))


# -- the engine, with the tiny model's real KV bytes ------------------------------------------------------


def tiny(num_kv_blocks: int, host_kv_blocks: int = 0, **kw) -> LLMEngine:
    """The tiny random model, its copies always taken: its prefill of a block can cost no more than the copy on
    some CPUs (CopyCostMeter would then save nothing), and these tests check the bytes that come back."""
    engine = LLMEngine(EngineConfig(model="tiny", num_kv_blocks=num_kv_blocks, host_kv_blocks=host_kv_blocks, **kw))
    engine.runner.copy_pays = lambda: True  # type: ignore[method-assign,union-attr]
    return engine


GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def prompt(seed: int, length: int = 70) -> list[int]:
    return [(seed * 7919 + i * 104729) % 500 + 10 for i in range(length)]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_a_prefix_restored_from_the_host_gives_the_tokens_of_one_prefilled(kv_cache_dtype):
    engine = tiny(num_kv_blocks=12, host_kv_blocks=64, kv_cache_dtype=kv_cache_dtype)
    first = engine.generate([prompt(1)], GREEDY)[0].token_ids
    for seed in (2, 3, 4):  # each 5 blocks: prompt 1's blocks leave the device
        engine.generate([prompt(seed)], GREEDY)
    again = engine.generate([prompt(1)], GREEDY)[0]
    engine.check_invariants()
    stats = engine.kv_manager.stats
    assert stats.host_prefix_hits == 64  # 4 full blocks of 16 (the 5th holds the last prompt token)
    assert again.token_ids == first
    assert (
        again.token_ids
        == tiny(num_kv_blocks=64, kv_cache_dtype=kv_cache_dtype).generate([prompt(1)], GREEDY)[0].token_ids
    )
    scraped = generate_latest(WorkerMetrics("tiny", engine.stats).registry).decode()
    assert 'kvroute:host_prefix_cache_hits_total{model_name="tiny"} 64.0' in scraped
    assert 'kvroute:host_kv_blocks_restored_total{model_name="tiny"} 4.0' in scraped
    assert 'vllm:prefix_cache_hits_total{model_name="tiny"} 64.0' in scraped


def test_preempted_sequences_come_back_through_the_host_with_the_tokens_of_a_run_without_preemption():
    prompts = [prompt(seed, 40) for seed in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = [r.token_ids for r in tiny(num_kv_blocks=256).generate(prompts, params)]
    without = tiny(num_kv_blocks=16, decode_reserve_tokens=0)
    assert [r.token_ids for r in without.generate(prompts, params)] == expected
    assert without.scheduler.num_preemptions_recomputed > 0
    engine = tiny(num_kv_blocks=16, host_kv_blocks=128, decode_reserve_tokens=0)
    results = engine.generate(prompts, params)
    engine.check_invariants()
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.num_preemptions_recomputed == 0  # every preempted sequence came back by copy
    assert engine.kv_manager.host_tier is not None and engine.kv_manager.host_tier.stats.restored > 0
    assert [r.token_ids for r in results] == expected


def test_cancelled_requests_leave_both_tiers_consistent():
    engine = tiny(num_kv_blocks=10, host_kv_blocks=8)
    for i in range(4):
        engine.add_request(f"r{i}", prompt(i, 60), GREEDY)
    engine.step()
    engine.abort_request("r1")
    engine.step()
    engine.abort_request("r2")
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_invariants()
    assert engine.kv_manager.pool.num_used_blocks == 0


def test_the_sim_runner_spends_the_copies_time_on_its_clock():
    clock = VirtualClock()
    config = EngineConfig(model="sim", num_kv_blocks=8, host_kv_blocks=32, sim_host_copy_us_per_block=500.0)
    runner = SimRunner(config, clock=clock, outputs=lambda seq: 5, outputs_run=lambda seq, n: [5] * n)
    engine = LLMEngine(config, clock=clock, sim_runner=runner)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.generate([prompt(1, 65)], params)
    for seed in (2, 3):
        engine.generate([prompt(seed, 65)], params)
    before = clock.now()
    engine.generate([prompt(1, 65)], params)
    assert engine.kv_manager.stats.host_prefix_hits == 64
    cost = config.sim_prefill_us_per_token * 1e-6  # the one token left to compute
    restore = 4 * 500e-6
    assert clock.now() - before >= cost + restore - 1e-9


def test_bad_host_tier_sizes_are_refused_with_what_to_ask_for(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       8000000 kB\nMemAvailable:   1048576 kB\n")
    with pytest.raises(ValueError, match=r"needs 2\.0 GiB of host memory; this machine has 1\.0 GiB available: ask"):
        check_host_memory(1024, 2 * 2**20, meminfo)
    check_host_memory(256, 2 * 2**20, meminfo)
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(host_kv_blocks=4, host_kv_memory_gb=1.0).validate()
    with pytest.raises(ValueError, match="needs prefix caching"):
        EngineConfig(host_kv_blocks=4, enable_prefix_caching=False).validate()
    with pytest.raises(ValueError, match="ask for at most"):
        tiny(num_kv_blocks=8, host_kv_blocks=2**40)


def test_the_tier_takes_nothing_while_a_copy_costs_more_than_the_recompute():
    meter = CopyCostMeter(block_size=16)
    assert meter.copy_pays()  # nothing measured yet: every machine measured copies far cheaper
    meter.observe_prefill(1000, 0.5)  # 0.5 ms a token: 8 ms a block
    meter.observe_copy(10, 0.01)  # 1 ms a block
    assert meter.copy_pays()
    for _ in range(30):
        meter.observe_copy(1, 0.02)  # a slow link: 20 ms a block
    assert not meter.copy_pays() and meter.copy_seconds_per_block is not None
    assert 0.019 < meter.copy_seconds_per_block < 0.02

    copier = ValueCopier()
    copier.pays = False
    mgr = KVCacheManager(4, BS, host_tier=HostKVTier(16), copier=copier)
    a = list(range(100, 113))
    compute(mgr, copier, "a1", a)
    compute(mgr, copier, "b", list(range(200, 216)))  # a's blocks are evicted, and recomputed later
    assert copier.saved == [] and compute(mgr, copier, "a2", a) == (0, 0)
    mgr.check_invariants()

    sim = SimRunner(EngineConfig(model="sim", num_kv_blocks=8, block_size=16, sim_host_copy_us_per_block=67.0))
    assert sim.copy_pays()  # 67 us against 16 x 32 us
    slow = EngineConfig(model="sim", num_kv_blocks=8, block_size=16, sim_host_copy_us_per_block=600.0)
    assert not SimRunner(slow).copy_pays()
