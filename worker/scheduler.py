"""The scheduler decides, each step, which tokens of which sequences the model computes (DESIGN §3).

One step:
  1. every running sequence gets its next tokens, oldest first: one for a decode, a chunk (up to the token
     budget) for a prefill in progress. A sequence that cannot get a block preempts the newest running
     sequence (its blocks are freed and it goes back to the front of the waiting queue, to be recomputed),
     or itself when it is the newest;
  2. if nothing was preempted, waiting sequences are admitted in FIFO order while the budget, `max_num_seqs`
     and the free blocks above the headroom allow; each starts from its longest cached prefix. The first
     admission counts one prefix-cache query and sets the sequence's `num_cached_tokens` (less than its
     prompt); a re-admission after preemption reuses what it finds over prompt + output but counts nothing
     and keeps that figure.
Headroom (while anything runs; an idle engine admits whatever fits): the watermark's share of the pool, plus,
with `decode_reserve_tokens` R > 0, the blocks each running sequence still needs to finish its prompt and decode
min(its remaining max_tokens, R) more tokens, and as much for the candidate itself. So a burst waits in the
queue, where its prefix stays cached and no one's work is thrown away, instead of being admitted on the
prompt's blocks alone and preempting (recomputing) the newest sequences as the batch grows. Sequences that
decode past R, or an estimate that other sequences' cached blocks were free, can still preempt: the reserve
makes it rare, not impossible (docs/worker.md, "Headroom": its figures).
Priority (`scheduling_policy` "priority", vLLM's `--scheduling-policy priority`; "fcfs" is all of the above):
sequences carry vLLM's `priority` (lower is more urgent), and the waiting queue is kept in (priority, arrival)
order, a preempted sequence going back to its place in it. A running sequence that cannot get a block preempts
the least urgent running sequence, the newest among equals (vLLM's choice), or itself when that is it. A waiting
sequence that cannot be admitted for blocks, headroom or `max_num_seqs` preempts running sequences of strictly
less urgent priority, least urgent and newest first, when freeing the fewest of them lets it in now (counted
exactly as the admission counts: blocks only they hold, their growth out of the headroom, their tokens back to
the budget); it never preempts an equal or more urgent one, and never preempts for a token budget that the next
step refills. Admission stops at a sequence preempted in the same step. `priority_loads()` reports what such an
admission could reclaim (gateway flow control reads it).
After the model has run, `update` advances the sequences, offers their newly filled blocks to the prefix
cache (prompt and generated tokens alike, so a multi-turn chat reuses the answer), and frees the blocks of
finished sequences at once.

Plain decode steps (`decode_steps_ahead`): steps in which every running sequence decodes one token and
nothing else happens (no block allocated or filled, no sequence finishing, nothing admitted) change nothing
but those sequences' tokens, so `advance_decodes` may take several of them at once; the fleet simulator
(sim/) does, to cross long decodes in one call. They are exactly the steps `schedule` + `update` would run.
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections import Counter, deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from worker.config import EngineConfig
from worker.kv_cache_manager import KVCacheManager, PrefixHit
from worker.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    """`num_new_tokens` tokens of `seq` starting at position `start`, attending through `block_table`."""

    seq: Sequence
    start: int
    num_new_tokens: int
    kv: KVCacheManager = field(repr=False)

    @functools.cached_property
    def block_table(self) -> list[int]:
        """The sequence's blocks, read when the model runs (built on first read: a sim runner never reads it)."""
        return self.kv.block_table(self.seq.request_id)

    @property
    def samples(self) -> bool:
        """True when this step computes the sequence's last token, so the model's output there is sampled."""
        return self.start + self.num_new_tokens == self.seq.num_tokens


MAX_PRIORITY_LOADS = 8  # priority values a worker reports (Scheduler.priority_loads)


@dataclass
class PriorityLoad:
    """One priority's share of a worker under the priority policy (Scheduler.priority_loads)."""

    running_blocks: int = 0
    waiting: int = 0


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq]
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)

    @property
    def sampling(self) -> list[ScheduledSeq]:
        return [s for s in self.seqs if s.samples]


class Scheduler:
    """`event_token_ids` False: blocks are offered to the prefix cache without their tokens, so its `stored`
    events name none (LLMEngine)."""

    def __init__(self, config: EngineConfig, kv_manager: KVCacheManager, event_token_ids: bool = True) -> None:
        self.kv = kv_manager
        self.event_token_ids = event_token_ids
        self.block_size = kv_manager.block_size
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.watermark_blocks = int(config.watermark * kv_manager.num_blocks)
        self.decode_reserve_tokens = config.decode_reserve_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: fcfs preempts the newest first
        self.requests: dict[str, Sequence] = {}
        self.num_preemptions = 0
        # Preempted sequences that resumed recomputing a full block: its KV had left the device (and the host
        # tier, where there is one); the others resumed on their cached blocks or copies of them.
        self.num_preemptions_recomputed = 0
        self.by_priority = config.scheduling_policy == "priority"
        self._preempted: set[Sequence] = set()  # waiting again after a preemption: re-admitted, not new
        self._arrivals = itertools.count()
        self._arrival: dict[Sequence, int] = {}  # each live sequence's arrival number

    def add(self, seq: Sequence) -> None:
        self.requests[seq.request_id] = seq
        self._arrival[seq] = next(self._arrivals)
        self._enqueue(seq)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def abort(self, request_id: str) -> Sequence | None:
        """Drop a request wherever it is; its blocks are freed now. Unknown id: None."""
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._finish(seq, "abort")
        return seq

    def _rank(self, seq: Sequence) -> tuple[int, int]:
        """(priority, arrival): the lower, the sooner a sequence is admitted and the later it is preempted."""
        return seq.priority, self._arrival[seq]

    def _enqueue(self, seq: Sequence, preempted: bool = False) -> None:
        """Into the waiting queue: at its (priority, arrival) place, or (fcfs) last, first after a preemption."""
        if self.by_priority:
            bisect.insort(self.waiting, seq, key=self._rank)
        elif preempted:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def priority_loads(self) -> dict[int, PriorityLoad]:
        """Under the priority policy, per priority value p among the live sequences: the blocks that preempting
        every running sequence of priority p or less urgent would free beyond what preempting only the less
        urgent ones frees (each block counted once, at the most urgent priority holding it: so the blocks an
        admission at priority q can reclaim are the sum over p > q), and the sequences waiting at p. Most urgent
        first, at most MAX_PRIORITY_LOADS values: past them the most urgent are merged into one under the
        smallest value (which under-counts what a request can reclaim and over-counts what waits ahead of it,
        never the reverse). Empty under fcfs, where nothing is preempted for admission and nothing jumps the
        queue."""
        if not self.by_priority:
            return {}
        loads: dict[int, PriorityLoad] = {}
        urgency: dict[int, int] = {}  # block id -> the most urgent priority holding it
        for seq in self.running:
            for block in self.kv.req_blocks.get(seq.request_id, ()):
                urgency[block.block_id] = min(urgency.get(block.block_id, seq.priority), seq.priority)
            loads.setdefault(seq.priority, PriorityLoad())
        for priority in urgency.values():
            loads[priority].running_blocks += 1
        for seq in self.waiting:
            loads.setdefault(seq.priority, PriorityLoad()).waiting += 1
        ordered = sorted(loads.items())
        merged = ordered[: max(len(ordered) - MAX_PRIORITY_LOADS + 1, 0)]
        if len(merged) > 1:
            first = PriorityLoad(sum(p.running_blocks for _, p in merged), sum(p.waiting for _, p in merged))
            ordered[: len(merged)] = [(merged[0][0], first)]
        return dict(ordered)

    # -- scheduling ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        chosen: dict[Sequence, int] = {}
        preempted: list[Sequence] = []
        # Decodes first, so a long prefill never stalls the running streams; then prefills in progress.
        decodes = [s for s in self.running if s.num_uncomputed_tokens == 1]
        prefills = [s for s in self.running if s.num_uncomputed_tokens > 1]
        for seq in decodes + prefills:
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted by an earlier sequence this step
                continue
            num_new = min(seq.num_uncomputed_tokens, budget)
            if self._reserve(seq, num_new, chosen, preempted):
                chosen[seq] = num_new
            # Recounted rather than decremented: a preempted sequence gives its tokens back to the budget.
            budget = self.max_num_batched_tokens - sum(chosen.values())
        if not preempted:
            self._admit(budget, chosen, preempted)
        scheduled = [ScheduledSeq(seq, seq.num_computed_tokens, n, self.kv) for seq, n in chosen.items()]
        return SchedulerOutput(scheduled, preempted)

    def _reserve(self, seq: Sequence, num_new: int, chosen: dict[Sequence, int], preempted: list[Sequence]) -> bool:
        """Make `seq` hold blocks for its next `num_new` tokens, preempting if needed (the newest running sequence;
        under the priority policy the least urgent, newest among equals). False if `seq` itself was preempted."""
        while self.kv.allocate_slots(seq.request_id, seq.num_computed_tokens + num_new) is None:
            victim = max(self.running, key=self._rank) if self.by_priority else self.running[-1]
            self.running.remove(victim)
            chosen.pop(victim, None)
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: free the blocks now, and queue the sequence (prompt + output so far) first."""
        self.kv.free(seq.request_id)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self._enqueue(seq, preempted=True)
        self._preempted.add(seq)
        self.num_preemptions += 1

    def _growth_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """The blocks `seq` would still take, beyond those for `num_tokens`, to finish its prompt and decode
        its reserve (0 without one)."""
        if self.decode_reserve_tokens == 0:
            return 0
        decode = min(seq.params.max_tokens - seq.num_output_tokens, self.decode_reserve_tokens)
        return max(0, self.kv.num_blocks_for(seq.num_tokens + decode) - self.kv.num_blocks_for(num_tokens))

    def _headroom(self) -> int:
        """The free blocks an admission must leave while anything runs (module docstring)."""
        held = self.kv.req_blocks
        growth = sum(self._growth_blocks(s, len(held.get(s.request_id, ())) * self.block_size) for s in self.running)
        return self.watermark_blocks + growth

    def _admission(self, seq: Sequence, budget: int, headroom: int) -> tuple[PrefixHit, int, int] | None:
        """The prefix hit, the tokens `seq` would be admitted with now and the blocks it reserves to grow, or
        None if it must wait (`headroom`: what the running sequences need kept free)."""
        if budget <= 0 or len(self.running) >= self.max_num_seqs:
            return None
        hit = self.kv.find_prefix_hit(seq.block_hashes(), seq.num_tokens)
        num_new = min(seq.num_tokens - hit.num_tokens, budget)
        needed = self.kv.num_free_blocks_needed(seq.request_id, hit.num_tokens + num_new, hit.blocks)
        growth = self._growth_blocks(seq, hit.num_tokens + num_new)
        if self.running and self.kv.num_free_blocks - needed - growth < headroom:
            return None
        return hit, num_new, growth

    def _victims(self, seq: Sequence, budget: int, chosen: dict[Sequence, int]) -> list[Sequence] | None:
        """Under the priority policy, the fewest running sequences of less urgent priority than `seq`, least
        urgent and newest first, whose preemption lets `_admission` admit `seq` now (`budget`: the step's tokens
        left; `chosen`: the tokens given this step, which a victim gives back); None when none does. Changes
        nothing: it counts what `_preempt` would free as the admission will count it."""
        candidates = [s for s in self.running if s.priority > seq.priority] if self.by_priority else []
        if not candidates or budget <= 0:
            return None
        candidates.sort(key=self._rank, reverse=True)
        hit = self.kv.find_prefix_hit(seq.block_hashes(), seq.num_tokens)
        hit_ids = {b.block_id for b in hit.blocks}
        held = self.kv.req_blocks
        released: Counter[int] = Counter()  # block id -> references the victims so far hold on it
        freed = freed_hits = 0  # blocks the victims so far free; of those, blocks of seq's prefix hit
        headroom = self._headroom()
        for count, victim in enumerate(candidates, 1):
            blocks = held.get(victim.request_id, [])
            for block in blocks:
                released[block.block_id] += 1
                if released[block.block_id] == block.ref_cnt:
                    freed += 1
                    freed_hits += block.block_id in hit_ids
            budget += chosen.get(victim, 0)
            headroom -= self._growth_blocks(victim, len(blocks) * self.block_size)
            running = len(self.running) - count
            if budget <= 0 or running >= self.max_num_seqs:
                continue
            num_new = min(seq.num_tokens - hit.num_tokens, budget)
            needed = self.kv.num_free_blocks_needed(seq.request_id, hit.num_tokens + num_new, hit.blocks) + freed_hits
            growth = self._growth_blocks(seq, hit.num_tokens + num_new)
            if running == 0 or self.kv.num_free_blocks + freed - needed - growth >= headroom:
                return candidates[:count]
        return None

    def _admit(self, budget: int, chosen: dict[Sequence, int], preempted: list[Sequence]) -> None:
        if not self.waiting:
            return
        headroom = self._headroom()
        while self.waiting:
            seq = self.waiting[0]
            if seq in preempted:  # (priority) it just gave its room to a more urgent one: not back this step
                break
            admission = self._admission(seq, budget, headroom)
            victims = None if admission is not None else self._victims(seq, budget, chosen)
            if victims:
                for victim in victims:
                    self.running.remove(victim)
                    chosen.pop(victim, None)
                    self._preempt(victim)
                    preempted.append(victim)
                budget = self.max_num_batched_tokens - sum(chosen.values())
                headroom = self._headroom()
                admission = self._admission(seq, budget, headroom)
                assert admission is not None, "the victims were chosen to make room for it"
            if admission is None:
                break
            hit, num_new, growth = admission
            headroom += growth  # what it holds now leaves the free count; what it will grow by is kept free
            allocated = self.kv.allocate_slots(seq.request_id, hit.num_tokens + num_new, hit.blocks, hit.restore)
            assert allocated is not None, "admission checked the free blocks"
            self.waiting.popleft()
            if seq in self._preempted:
                self._preempted.discard(seq)
                if hit.num_tokens < (seq.num_tokens - 1) // self.block_size * self.block_size:
                    self.num_preemptions_recomputed += 1
            else:
                self.kv.record_prefix_query(hit, seq.num_tokens)
                seq.num_cached_tokens = hit.num_tokens
            seq.num_computed_tokens = hit.num_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chosen[seq] = num_new
            budget -= num_new

    # -- plain decode steps ----------------------------------------------------------------------

    def decode_steps_ahead(self) -> int:
        """How many of the next steps are plain decode steps (module docstring); 0 when the next one is not."""
        if not self.running or len(self.running) > self.max_num_batched_tokens:
            return 0
        bs = self.block_size
        ahead = self.max_num_batched_tokens
        for seq in reversed(self.running):  # newest first: a prefill in progress is the newest, and settles it
            if seq.num_uncomputed_tokens != 1 or seq.stopping_token_ids:
                return 0
            computed = seq.num_computed_tokens
            held = len(self.kv.req_blocks[seq.request_id]) * bs
            # step i computes position computed + i: held already, and not the last slot of a block (filling
            # it caches the block); the sequence must not reach max_tokens in these steps either
            ahead = min(
                ahead, held - computed, bs - 1 - computed % bs, seq.params.max_tokens - seq.num_output_tokens - 1
            )
            if ahead <= 0:
                return 0
        # last: the admission check costs more than the loop above, which mostly settles it
        budget = self.max_num_batched_tokens - len(self.running)
        if self.waiting:
            head = self.waiting[0]
            if self._admission(head, budget, self._headroom()) or self._victims(head, budget, self._decoding()):
                return 0
        return ahead

    def _decoding(self) -> dict[Sequence, int]:
        """The tokens a plain decode step gives the running sequences: one each."""
        return dict.fromkeys(self.running, 1)

    def advance_decodes(self, num_steps: int, sample: Callable[[Sequence, int], list[int]]) -> list[Sequence]:
        """Run `num_steps` plain decode steps at once (at most `decode_steps_ahead()`): `sample(seq, n)` is the
        n tokens a running sequence samples in them, one per step (logprob 0). Returns the running sequences,
        as `update` would."""
        if not 0 < num_steps <= self.decode_steps_ahead():
            raise ValueError(f"{num_steps} plain decode steps asked, {self.decode_steps_ahead()} ahead")
        for seq in self.running:
            seq.token_ids.extend(sample(seq, num_steps))
            seq.output_logprobs.extend([0.0] * num_steps)
            seq.num_computed_tokens += num_steps
        return list(self.running)

    # -- after the model ran ---------------------------------------------------------------------

    def update(self, output: SchedulerOutput, token_ids: Seq[int], logprobs: Seq[float]) -> list[Sequence]:
        """Advance the scheduled sequences; `token_ids[i]` / `logprobs[i]` belong to `output.sampling[i]`.
        Returns the sequences that received a token (finished ones included, their blocks already freed)."""
        sampled = iter(zip(token_ids, logprobs, strict=True))
        advanced = []
        for item in output.seqs:
            seq = item.seq
            samples = item.samples
            seq.num_computed_tokens += item.num_new_tokens
            if samples:
                token_id, logprob = next(sampled)
                seq.append_token(token_id, logprob)
                advanced.append(seq)
            # Blocks full of computed K/V become findable, prompt and generated tokens alike.
            num_full = seq.num_computed_tokens // self.block_size
            if num_full > self.kv.num_hashed[seq.request_id]:
                tokens = seq.token_ids if self.event_token_ids else ()
                self.kv.cache_blocks(seq.request_id, seq.block_hashes()[:num_full], tokens, seq.cache_salt)
            if samples:
                reason = seq.check_stop()
                if reason is not None:
                    self.running.remove(seq)
                    self._finish(seq, reason)
        return advanced

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.kv.free(seq.request_id)
        self._preempted.discard(seq)
        del self._arrival[seq]
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self.requests[seq.request_id]

    # -- integrity -------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Block-pool books plus: blocks are held exactly by the running sequences, each holding enough for
        its computed tokens; every live request is in exactly one queue; under the priority policy the waiting
        queue is in (priority, arrival) order."""
        self.kv.check_invariants()
        running_ids = {s.request_id for s in self.running}
        assert set(self.kv.req_blocks) <= running_ids, "a non-running request holds blocks"
        for seq in self.running:
            assert seq.status is SequenceStatus.RUNNING
            held = len(self.kv.req_blocks.get(seq.request_id, []))
            assert held >= self.kv.num_blocks_for(seq.num_computed_tokens), f"{seq.request_id} lost blocks"
        for seq in self.waiting:
            assert seq.status is SequenceStatus.WAITING and seq.num_computed_tokens == 0
        queued = [s.request_id for s in self.running] + [s.request_id for s in self.waiting]
        assert len(queued) == len(set(queued)), "a request is queued twice"
        assert set(queued) == set(self.requests), "the request map and the queues disagree"
        assert set(self._arrival) == set(self.requests.values()), "the arrival books and the queues disagree"
        if self.by_priority:
            ranks = [self._rank(s) for s in self.waiting]
            assert ranks == sorted(ranks), "the waiting queue is out of (priority, arrival) order"
