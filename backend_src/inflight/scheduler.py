"""Iteration-level scheduling: which requests run in the next step, and with how many tokens.

`continuous` (default) re-forms the batch every step under a token budget, vLLM-v1 style: one
number per request, `num_computed`, makes prefill, chunked prefill, resumption after preemption and
decode the same loop — a request simply gets `min(num_tokens - num_computed, budget left)` tokens.
Running requests go first, in (priority, arrival) order; then waiting ones are admitted while seats,
budget and KV blocks allow. When blocks run out, the lowest-priority newest running request is
preempted (its blocks freed, recomputed later). `dynamic` and `static` are the request-level
policies that continuous batching replaces, kept so benchmarks can compare scheduling alone.
"""
from __future__ import annotations

import itertools
import time
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from .batch_table import BatchTable
from .config import EngineConfig
from .kv_cache import KVCacheManager, hash_block
from .request import Request, Status

_PRIORITY_SHIFT = 40    # running order key: priority << shift | arrival_seq


@dataclass(slots=True)
class SchedulerOutput:
    rows: np.ndarray            # batch-table rows, in batch order
    num_scheduled: np.ndarray   # tokens of each row computed this step
    start: np.ndarray           # each row's num_computed before the step (its first position)
    sample_mask: np.ndarray     # rows whose step ends at their last token: they sample one
    num_padding_tokens: int = 0  # static/dynamic: padding computed and thrown away
    sample_rows: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.sample_rows = self.rows[self.sample_mask]

    @property
    def num_tokens(self) -> int:
        return int(self.num_scheduled.sum())

    def __len__(self) -> int:
        return len(self.rows)


class Scheduler:
    def __init__(self, config: EngineConfig, max_model_len: int, kv: KVCacheManager,
                 eos_token_ids: tuple[int, ...]):
        if config.policy == "continuous" and not config.enable_chunked_prefill \
                and config.max_num_batched_tokens < max_model_len:
            # a prompt, or a preempted request's recompute, must then fit one step's budget
            raise ValueError(f"'max_num_batched_tokens' ({config.max_num_batched_tokens}) is below max_model_len "
                             f"({max_model_len}) with 'enable_chunked_prefill' false: a longer prompt, or a "
                             "preempted request grown longer, could never be scheduled; raise it to max_model_len, "
                             "lower max_model_len, or enable chunked prefill")
        self.config = config
        self.policy = config.policy
        self.block_size = config.block_size
        self.kv = kv
        self.table = BatchTable(config.max_num_seqs, max_model_len, config.block_size, eos_token_ids)
        self.waiting: list[deque[Request]] = [deque(), deque(), deque()]   # one per priority class
        self.running = np.empty(0, dtype=np.int64)       # rows, sorted by (priority, arrival)
        self._running_keys = np.empty(0, dtype=np.int64)
        self.held_rows: list[int] = []      # static policy: finished rows kept as padding
        self.finished: dict[str, str] = {}  # reported with the next step's output
        self.admitted: dict[str, int] = {}  # request id -> prompt tokens its first admission found cached (likewise)
        self.num_preemptions = 0
        self.prefix_query_tokens = 0        # prompt tokens looked up in the prefix cache
        self.prefix_hit_tokens = 0          # of which found cached
        self.resumed_hit_tokens = 0         # tokens resumed requests found cached (their own blocks, mostly)
        self.num_prefill_tokens = 0         # prompt positions computed (cache hits excluded)
        self.num_prompt_tokens = 0          # the prompts of requests admitted (once each, cache hits included)

    # ---- queues -------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self.waiting)

    @property
    def num_queued(self) -> int:
        """Waiting requests never scheduled: preempted ones, already streaming, sit at the head of
        their class (preempt puts them there) and are not counted."""
        return sum(len(q) - sum(1 for _ in itertools.takewhile(lambda r: r.first_scheduled_time is not None, q))
                   for q in self.waiting)

    def num_waiting_for_a_seat(self, arriving: int = 0) -> int:
        """Queued requests beyond the seats free for them (preempted ones, at the head, take theirs
        first), with `arriving` more queued: one the next step seats is not waiting for a seat,
        though a finished request's seat is given only then."""
        free = max(self.table.num_free_rows - (self.num_waiting - self.num_queued), 0)
        return max(self.num_queued + arriving - free, 0)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return self.num_waiting > 0 or self.num_running > 0 or bool(self.held_rows)

    def add(self, req: Request) -> None:
        self.waiting[req.priority].append(req)

    def _waiting_in_order(self) -> Iterator[Request]:
        for queue in self.waiting:
            yield from queue

    def _peek_waiting(self, passed: Iterable[int] = itertools.repeat(0)) -> Request | None:
        """The first waiting request in (priority, arrival) order after the first passed[p] of
        each class p (those let others go first this step; always a prefix of their class: what
        admission passes comes before what it looks at next, and preemption puts requests back
        only at the head of a lower class)."""
        for queue, skip in zip(self.waiting, passed):
            if len(queue) > skip:
                return queue[skip]
        return None

    def _adapter_waits(self, req: Request) -> bool:
        """Whether running the request would make more than max_loras distinct LoRA adapters run
        at once (the device holds that many). As in vLLM, it then waits, and the requests behind
        it may go first."""
        if req.lora_id < 0:
            return False
        running = self._running_adapters()
        return req.lora_id not in running and len(running) >= self.config.max_loras

    def _running_adapters(self) -> np.ndarray:
        """The distinct LoRA adapter ids of the running batch."""
        adapters = np.unique(self.table.lora_id[self.running])
        return adapters[adapters >= 0]

    def lora_requests(self, num_adapters: int) -> tuple[np.ndarray, np.ndarray]:
        """Per LoRA adapter id, its requests running and waiting (what vLLM's lora_requests_info
        reports)."""
        running = self.table.lora_id[self.running]
        waiting = np.fromiter((r.lora_id for queue in self.waiting for r in queue), dtype=np.int64)
        return tuple(np.bincount(ids[ids >= 0], minlength=num_adapters) for ids in (running, waiting))

    def _insert_running(self, req: Request) -> None:
        key = (req.priority << _PRIORITY_SHIFT) | req.arrival_seq
        pos = int(np.searchsorted(self._running_keys, key))
        self.running = np.insert(self.running, pos, req.row)
        self._running_keys = np.insert(self._running_keys, pos, key)

    def _drop_running(self, rows: list[int]) -> None:
        keep = ~np.isin(self.running, rows)
        self.running = self.running[keep]
        self._running_keys = self._running_keys[keep]
        if not len(self.running) and self.held_rows:    # a static group ends with its last request
            self._release_held()

    # ---- schedule -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self.policy == "continuous":
            return self._schedule_continuous()
        return self._schedule_group()

    def _schedule_continuous(self) -> SchedulerOutput:
        table = self.table
        budget = self.config.max_num_batched_tokens
        rows = self.running
        start = table.num_computed[rows]
        remaining = table.num_tokens[rows] - start
        n = remaining
        if int(n.sum()) > budget:                       # running requests in order until it is spent
            ends = np.cumsum(n)
            n = np.clip(budget - (ends - n), 0, n)
        # at least 0: after a step that raised between schedule() and update(), a row keeps blocks
        # allocated for tokens it has yet to compute (the step is computed again)
        need = np.maximum((start + n + (self.block_size - 1)) // self.block_size - table.num_blocks[rows], 0)
        total_need = int(need.sum())
        if total_need <= self.kv.num_free_blocks:
            if total_need:
                self._allocate(rows, need, total_need)
        else:
            rows, n = self._schedule_under_pressure(rows, n)
        new_rows, new_n, preempted = self._admit(budget - int(n.sum()), rows, n)
        if preempted or new_rows or len(n) != len(remaining) or not n.all():
            if preempted:
                keep = ~np.isin(rows, preempted)
                rows, n = rows[keep], n[keep]
            rows = np.concatenate([rows, np.asarray(new_rows, dtype=np.int64)])
            n = np.concatenate([n, np.asarray(new_n, dtype=n.dtype)])
            keep = n > 0
            rows, n = rows[keep], n[keep]
            start = table.num_computed[rows]
            remaining = table.num_tokens[rows] - start
        return SchedulerOutput(rows, n, start, n == remaining)

    def _allocate(self, rows: np.ndarray, need: np.ndarray, total: int) -> None:
        grow = need > 0
        self.table.append_blocks(rows[grow], need[grow], self.kv.allocate(total))

    def _schedule_under_pressure(self, rows: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Running pass when blocks are short: in order, each request takes the blocks it needs,
        preempting from the back of the running order (lowest priority, newest) — itself last."""
        table = self.table
        kept_rows, kept_n = [], []
        for row, count in zip(rows.tolist(), n.tolist()):
            req = table.requests[row]
            if count == 0 or req is None or req.status != Status.RUNNING:
                continue
            need = max(-(-(int(table.num_computed[row]) + count) // self.block_size) - int(table.num_blocks[row]), 0)
            while need > self.kv.num_free_blocks and req.status == Status.RUNNING:
                self.preempt(table.requests[int(self.running[-1])])
            if req.status == Status.RUNNING:
                table.append_blocks([row], [need], self.kv.allocate(need))
                kept_rows.append(row)
                kept_n.append(count)
        return np.asarray(kept_rows, dtype=np.int64), np.asarray(kept_n, dtype=n.dtype)

    def _victims_for(self, req: Request, hit: list[int]) -> list[Request]:
        """Running requests of strictly lower priority (lowest, then newest, first) whose
        preemption would let `req` in; empty if even all of them would not be enough."""
        victims, held = [], Counter()
        hit_blocks = set(hit)
        for row in self.running[::-1].tolist():
            victim = self.table.requests[row]
            if victim.priority <= req.priority:
                break
            victims.append(victim)
            held.update(self.table.blocks(row))
            # blocks the victims hold every reference to go back to the pool (a prefix two of them
            # share, too; one a request that stays also holds does not); those of req's cached
            # prefix are room req takes anyway, not room it gains
            freed_blocks = sum(1 for b, refs in held.items() if refs == self.kv.ref_counts[b] and b not in hit_blocks)
            if self._fits(req, hit, len(victims), freed_blocks):
                return victims
        return []

    def _fits(self, req: Request, hit: list[int], freed_seats: int, freed_blocks: int) -> bool:
        """Admission test (`hit`: its cached prefix). Besides a seat, the free pool must hold the
        request's whole remaining prompt plus one block of headroom per other running request. The
        headroom is the thrash guard: a just-admitted request cannot be the victim of the very next
        decode steps, and a preempted request comes back only once its whole recompute fits."""
        if self.table.num_free_rows + freed_seats == 0:
            return False
        need_total = -(-len(req.token_ids) // self.block_size) - len(hit)
        headroom = len(self.running) - freed_seats
        available = self.kv.num_free_blocks + freed_blocks - self.kv.count_free_among(hit)
        return available >= need_total + headroom

    def _prefix_hit(self, req: Request) -> tuple[list[int], int]:
        """Cached blocks for the longest prefix of the request's tokens, and the tokens they
        cover. The last token is always recomputed so the next token has logits. A request that
        asked for prompt log-probabilities computes its whole prompt (as in vLLM): a cached
        position would have no logits."""
        if not self._looks_up(req):
            return [], 0
        num_full = (len(req.token_ids) - 1) // self.block_size
        self._hash_blocks(req, req.token_ids, num_full)
        hit = self.kv.find_cached_prefix(req.block_hashes[:num_full])
        return hit, len(hit) * self.block_size

    def _looks_up(self, req: Request) -> bool:
        return self.kv.enable_prefix_caching and req.params.prompt_logprobs is None

    def _hash_blocks(self, req: Request, token_ids, num_full: int) -> None:
        bs = self.block_size
        for i in range(len(req.block_hashes), num_full):
            parent = req.block_hashes[i - 1] if i else None
            req.block_hashes.append(hash_block(parent, token_ids[i * bs:(i + 1) * bs], req.cache_key))

    def _admit(self, budget: int, rows: np.ndarray, counts: np.ndarray) -> tuple[list[int], list[int], list[int]]:
        """Admit waiting requests in (priority, arrival) order while budget, seats and blocks last.
        A request that does not fit may preempt running requests of lower priority; those are
        taken out of this step (`rows`/`counts`: the running pass) and their budget is returned."""
        new_rows, new_counts, preempted = [], [], []
        computing: set[bytes] = set()       # the hashes of the blocks this step's admissions compute
        passed = [0] * len(self.waiting)    # per class: requests whose adapter has no slot this step
        while budget > 0:
            req = self._peek_waiting(passed)
            if req is None:
                break
            if self._adapter_waits(req):
                passed[req.priority] += 1
                continue
            hit, num_computed = self._prefix_hit(req)
            if self._computed_this_step(req, hit, computing):
                break
            remaining = len(req.token_ids) - num_computed
            if not self._fits(req, hit, 0, 0):
                victims = self._victims_for(req, hit)
                returned = sum(int(counts[rows == victim.row].sum()) for victim in victims)
                if not victims or (remaining > budget + returned and not self.config.enable_chunked_prefill):
                    break       # preempting would not let it run this step
                for victim in victims:
                    preempted.append(victim.row)
                    self.preempt(victim)
                budget += returned
                continue
            count = min(remaining, budget)
            if count < remaining and not self.config.enable_chunked_prefill:
                break
            row = self._start_running(req, hit, num_computed)
            queue, index = self.waiting[req.priority], passed[req.priority]
            assert queue[index] is req
            del queue[index]                            # once it runs: a failure leaves it abortable
            need = -(-(num_computed + count) // self.block_size) - len(hit)
            self.table.append_blocks([row], [need], self.kv.allocate(need))
            computing.update(req.block_hashes[len(hit):(num_computed + count) // self.block_size])
            new_rows.append(row)
            new_counts.append(count)
            budget -= count
        return new_rows, new_counts, preempted

    def _computed_this_step(self, req: Request, hit: list[int], computing: set[bytes]) -> bool:
        """Whether the first block the request would compute is one a request admitted before it
        in this step computes: it then waits a step and finds it cached, instead of computing the
        shared prompt again (an n > 1 request's outputs, a burst with one system prompt). vLLM
        shares such blocks within the step; here a block becomes findable once it is computed."""
        first = len(hit)
        return (bool(computing) and self._looks_up(req) and first < (len(req.token_ids) - 1) // self.block_size
                and req.block_hashes[first] in computing)

    def _start_running(self, req: Request, hit: list[int], num_computed: int) -> int:
        row = self.table.add(req)
        self.kv.acquire(hit)
        self.table.append_blocks([row], [len(hit)], hit)
        self.table.num_computed[row] = num_computed
        req.status = Status.RUNNING
        if req.first_scheduled_time is not None:         # a resumption, which vLLM counts apart
            self.resumed_hit_tokens += num_computed
        else:
            req.first_scheduled_time = time.monotonic()
            self.admitted[req.request_id] = num_computed       # vLLM's num_cached_tokens: the first admission's
            self.num_prompt_tokens += req.num_prompt_tokens
            if self._looks_up(req):
                # new requests that looked up, as vLLM counts them (not those that skip the lookup)
                self.prefix_query_tokens += len(req.token_ids)
                self.prefix_hit_tokens += num_computed
        self._insert_running(req)
        return row

    # ---- static and dynamic batching ------------------------------------------------------
    def _schedule_group(self) -> SchedulerOutput:
        """Request-level batching. A group is formed only when the previous one is done; its
        prompts are padded to the longest; it runs to completion with no joins. `static` also
        keeps finished requests' seats as padding until the group's longest request finishes."""
        table = self.table
        if not len(self.running):
            self._form_group()
        rows = self.running
        start = table.num_computed[rows]
        n = table.num_tokens[rows] - start
        padding = len(self.held_rows)
        if n.size and n.max() > 1:          # the group's prefill step
            padding += int(n.max()) * len(n) - int(n.sum())
        return SchedulerOutput(rows, n, start, np.ones(len(rows), dtype=bool), padding)

    def _form_group(self) -> None:
        head = self._peek_waiting()
        if head is None:
            return
        if self.policy == "static":
            size = self.config.static_batch_size or self.config.max_num_seqs
            waited = time.monotonic() - head.arrival_time
            if self.num_waiting < size and waited < self.config.batch_wait_timeout_s:
                return
            members = list(self._waiting_in_order())[:size]
        else:
            window = self.config.dynamic_length_window
            head_len = len(head.token_ids)
            near = [r for r in self._waiting_in_order() if abs(len(r.token_ids) - head_len) <= window]
            # priority first (a low-priority request of the head's length took a seat before a
            # high-priority one a little longer), then the closest lengths
            near.sort(key=lambda r: (r.priority, abs(len(r.token_ids) - head_len)))
            members = near[:self.config.max_num_seqs]
        for req in members:
            # request-level batching reserves a request's whole KV up front, as contiguous
            # allocation does: no request of the group can run out of memory mid-way
            reserve = -(-min(req.num_prompt_tokens + req.params.max_tokens, self.table.max_model_len)
                        // self.block_size)
            if reserve > self.kv.num_free_blocks or not self.table.num_free_rows:
                break
            if self._adapter_waits(req):
                continue
            row = self._start_running(req, [], 0)
            self.waiting[req.priority].remove(req)      # once it runs: a failure leaves it abortable
            self.table.append_blocks([row], [reserve], self.kv.allocate(reserve))

    def _release_held(self) -> None:
        for row in self.held_rows:
            self.kv.free(self.table.blocks(row))
            self.table.remove(row)
        self.held_rows.clear()

    # ---- after the step ---------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: np.ndarray, grammar_done: np.ndarray | None = None) -> None:
        """Advance the scheduled rows, append each sampling row's token (`sampled`, in the order
        of out.sample_rows), and finish the requests that stop (also those whose grammar ended:
        `grammar_done`, in the same order)."""
        table = self.table
        rows = out.rows
        table.num_computed[rows] = out.start + out.num_scheduled
        prompt_end = table.num_prompt[rows]
        prefill = out.start < prompt_end
        if prefill.any():
            self.num_prefill_tokens += int((np.minimum(out.start + out.num_scheduled, prompt_end) - out.start)[prefill].sum())
            if self.kv.enable_prefix_caching and self.policy == "continuous":
                for row in rows[prefill].tolist():
                    self._cache_computed_blocks(row)
        sample_rows = out.sample_rows
        length = table.num_tokens[sample_rows]
        table.token_ids[sample_rows, length] = sampled
        length += 1
        table.num_tokens[sample_rows] = length
        stopped = (table.stop_ids[sample_rows] == sampled[:, None]).any(axis=1)
        if grammar_done is not None:
            stopped |= grammar_done
        done = stopped | (length >= table.max_total[sample_rows])
        if done.any():
            done_rows = sample_rows[done].tolist()
            for row, stop in zip(done_rows, stopped[done].tolist()):
                self._finish(table.requests[row], "stop" if stop else "length")
            self._drop_running(done_rows)

    def _cache_computed_blocks(self, row: int) -> None:
        """Make the row's fully computed blocks findable by later requests with the same prefix."""
        table = self.table
        req = table.requests[row]
        num_full = int(table.num_computed[row]) // self.block_size
        if num_full > len(req.block_hashes):
            self._hash_blocks(req, table.token_ids[row], num_full)
        for i in range(num_full):
            self.kv.cache_block(int(table.block_table[row, i]), req.block_hashes[i])

    def _release(self, req: Request) -> None:
        """Give back a running request's seat and blocks (keeping full blocks findable)."""
        row = req.row
        if self.kv.enable_prefix_caching and self.policy == "continuous":
            self._cache_computed_blocks(row)
        self.kv.free(self.table.blocks(row))
        self.table.remove(row)

    def _finish(self, req: Request, reason: str) -> None:
        if self.policy == "static" and req.status == Status.RUNNING:
            req.token_ids = self.table.token_ids[req.row, :self.table.num_tokens[req.row]].tolist()
            self.held_rows.append(req.row)
        elif req.status == Status.RUNNING:
            self._release(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        self.finished[req.request_id] = reason

    def preempt(self, req: Request) -> None:
        """Recompute preemption: free everything, back to the head of its priority class."""
        row = req.row
        self._release(req)
        self._drop_running([row])
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting[req.priority].appendleft(req)

    def abort(self, req: Request, reason: str = "abort") -> None:
        if req.status == Status.WAITING:
            self.waiting[req.priority].remove(req)
        elif req.status == Status.RUNNING:
            row = req.row
            self._finish(req, reason)
            self._drop_running([row])
            return
        self._finish(req, reason)

    def displaceable(self, priority: int, count: int) -> list[Request]:
        """What a full queue may give up for requests of class `priority`: up to `count` requests
        never started of the classes below it, the newest of the lowest class first (as SGLang's
        priority scheduling chooses)."""
        below = itertools.chain.from_iterable(reversed(queue) for queue in reversed(self.waiting[priority + 1:]))
        return list(itertools.islice((req for req in below if not req.started), count))

    def expire_waiting(self, max_wait_s: float) -> list[Request]:
        """Requests not started that waited longer than max_wait_s (queue timeout). An output of
        an n > 1 request still waiting for a seat while another streams is part of a running
        request: it waits on."""
        now = time.monotonic()
        expired = [r for r in self._waiting_in_order() if not r.started and now - r.arrival_time > max_wait_s]
        for req in expired:
            self.abort(req, "error")
        return expired

    def slot_usage(self) -> tuple[int, int]:
        """(token slots holding live tokens, token slots allocated) over the requests holding
        blocks: what a paged pool wastes is only the unfilled tail of each request's last block."""
        table = self.table
        rows = np.concatenate([self.running, np.asarray(self.held_rows, dtype=np.int64)])
        allocated = table.num_blocks[rows].astype(np.int64) * self.block_size
        return int(np.minimum(table.num_tokens[rows], allocated).sum()), int(allocated.sum())

    # ---- checks -------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        table = self.table
        owners = [table.blocks(int(row)) for row in self.running] + [table.blocks(r) for r in self.held_rows]
        self.kv.check_invariants(owners)
        assert len(self.running) + len(self.held_rows) + table.num_free_rows == len(table.requests)
        for row in self.running.tolist():
            req = table.requests[row]
            assert req.status == Status.RUNNING and req.row == row
            assert table.num_computed[row] <= table.num_tokens[row]
            assert table.num_blocks[row] * self.block_size >= table.num_computed[row]
        keys = self._running_keys
        assert np.all(keys[:-1] <= keys[1:]), "running order broken"
        assert len(self._running_adapters()) <= self.config.max_loras, "more LoRA adapters running than max_loras"
