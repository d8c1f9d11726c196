"""Seats for the requests that wait for a new grammar to compile: they count against
max_queue_size, as those in the engine's queue do. A request that finds every seat taken is
refused, unless one of a lower priority class holds a seat and its compile has not begun: then the
newest of the lowest such class gives its seat up, as the engine's full queue does (SGLang's rule)."""
from __future__ import annotations

import threading

from ..config import parse_priority
from .job import Job


class SeatsTaken(Exception):
    """Every seat is held, by requests of this one's class or above, or compiling already."""


class GrammarSeats:
    def __init__(self, limit: int | None):
        self.limit = limit                          # None: no bound
        self._lock = threading.Lock()               # taken on Triton's threads, the compile pool's, shutdown's
        self._held: dict[str, Job] = {}             # by job id, in arrival order
        self._compiling: set[str] = set()           # their compile has begun: they keep their seats

    def take(self, job: Job) -> Job | None:
        """A seat for the job; the job that gave its seat up for it, if one did. SeatsTaken if none."""
        with self._lock:
            given_up = None
            if self.limit is not None and len(self._held) >= self.limit:
                self._free_answered()
            if self.limit is not None and len(self._held) >= self.limit:
                given_up = self._lowest_waiting_below(parse_priority(job.request.priority))
                if given_up is None:
                    raise SeatsTaken
                del self._held[given_up.job_id]
            self._held[job.job_id] = job
            return given_up

    def start(self, job: Job) -> bool:
        """At its compile's start: False where the job gave up its seat meanwhile (it is answered)."""
        with self._lock:
            if job.job_id not in self._held:
                return False
            self._compiling.add(job.job_id)
            return True

    def leave(self, job: Job) -> None:
        """Its compile ended, was cancelled, or never ran: the seat is free."""
        with self._lock:
            self._held.pop(job.job_id, None)
            self._compiling.discard(job.job_id)

    def _free_answered(self) -> None:
        """The seats of jobs answered before their compile began (their client left): it never will,
        as a request the engine aborts frees its place in the queue at once."""
        for job in [job for job in self._held.values() if job.done and job.job_id not in self._compiling]:
            del self._held[job.job_id]

    def _lowest_waiting_below(self, priority: int) -> Job | None:
        """The newest job of the lowest class below `priority` whose compile has not begun."""
        found, found_priority = None, priority
        for job in reversed(self._held.values()):
            if job.job_id in self._compiling:
                continue
            held = parse_priority(job.request.priority)
            if held > found_priority:
                found, found_priority = job, held
        return found
