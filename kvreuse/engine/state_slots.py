"""Which slot of the recurrent states each running sequence of a hybrid model uses (issue 66).

A recurrent layer's past is one state per sequence, kept between steps in a slot (models/lfm2.py's
``RecurrentStates``). A sequence takes a free slot the first step it runs and gives it back when it leaves the
running set (finished, aborted or preempted); the model zeroes a slot's state whenever a sequence's step starts at
position 0, so a sequence preempted and recomputed, or a slot given to another sequence, never reads an old state.
There are as many slots as sequences can run at once (the scheduler's max_num_seqs).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvreuse.request import Request


class StateSlots:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._held: dict[int, tuple[Request, int]] = {}  # id(request) -> (request, slot): the request kept alive

    def assign(self, step: Sequence[Request], running: Iterable[Request]) -> list[int]:
        """The slot of each of ``step``'s requests, in order; slots of requests no longer in ``running`` are freed
        first."""
        self.retain([*running, *step])
        slots = []
        for request in step:
            held = self._held.get(id(request))
            if held is None:
                if not self._free:
                    raise RuntimeError(f"no free recurrent-state slot ({self.num_slots} held): more sequences run "
                                       "than max_num_seqs")
                held = self._held[id(request)] = (request, self._free.pop())
            slots.append(held[1])
        return slots

    def retain(self, running: Iterable[Request]) -> None:
        """Free the slots of the requests not in ``running`` (ended or preempted since)."""
        alive = {id(request) for request in running}
        for key in [key for key in self._held if key not in alive]:
            self._free.append(self._held.pop(key)[1])

    @property
    def in_use(self) -> int:
        return len(self._held)
