"""What the buffer remembers per epoch once a prompt's ledger row has left memory for the ledger
log: enough to refuse a prompt added twice, and to check the log on resume, in O(1) per epoch.

- Epochs are added in order (the data cursor's): prompts go to the newest epoch or a later one,
  so only the newest epoch can get a prompt again, and only its finished prompt_ids are kept
  (O(dataset), once) to refuse a second add. An older epoch's prompts are all in flight or done.
- An epoch is open while it is the newest or has rows in flight; its finished rows are counted by
  status. Once closed, its counts fold into `earlier_counts`: the summary stays as small as the
  in-flight window however long the run, and a resume still checks every row of the log.
"""

from __future__ import annotations

from collections import Counter

from rlactors.buffer.records import LedgerEntry


class EpochBook:
    def __init__(self):
        self.newest_epoch = -1
        self.finished_in_newest: set[str] = set()  # prompt_ids trained or dropped in the newest epoch
        self.open_counts: dict[int, Counter[str]] = {}  # open epoch -> finished rows by status
        self.earlier_counts: Counter[str] = Counter()  # finished rows of closed epochs, by status
        self.num_in_flight: Counter[int] = Counter()  # epoch -> rows not yet finished

    def check_add(self, epoch: int, prompt_id: str) -> None:
        """Raise ValueError unless `prompt_id` may be added to `epoch` (rows in flight are the
        caller's to check)."""
        if epoch < self.newest_epoch:
            raise ValueError(f"epoch {epoch} is over: prompts of epoch {self.newest_epoch} were added already "
                             "(epochs are added in order)")
        if epoch == self.newest_epoch and prompt_id in self.finished_in_newest:
            raise ValueError(f"prompt_id {prompt_id!r} added twice in epoch {epoch}")

    def is_finished(self, epoch: int, prompt_id: str) -> bool:
        """For a prompt not in flight: was it trained or dropped? In an epoch before the newest,
        every prompt not in flight is done (or was never added: either way none can come back)."""
        return epoch < self.newest_epoch or (epoch == self.newest_epoch and prompt_id in self.finished_in_newest)

    def added(self, epoch: int, count: int) -> None:
        if epoch > self.newest_epoch:
            self.newest_epoch, self.finished_in_newest = epoch, set()
            for earlier in [e for e in self.open_counts if not self.num_in_flight[e]]:
                self._close(earlier)
        self.open_counts.setdefault(epoch, Counter())
        self.num_in_flight[epoch] += count

    def finished(self, entry: LedgerEntry) -> None:
        epoch = entry.epoch
        self.open_counts[epoch][entry.status] += 1
        self.num_in_flight[epoch] -= 1
        if epoch == self.newest_epoch:
            self.finished_in_newest.add(entry.prompt_id)
        elif not self.num_in_flight[epoch]:
            self._close(epoch)

    def _close(self, epoch: int) -> None:
        self.earlier_counts.update(self.open_counts.pop(epoch))
        del self.num_in_flight[epoch]

    def state(self) -> dict:
        return {"newest_epoch": self.newest_epoch, "earlier_counts": dict(self.earlier_counts),
                "open_counts": {str(epoch): dict(counts) for epoch, counts in self.open_counts.items()}}

    def load(self, state: dict, in_flight: list[LedgerEntry], found: Counter, finished_in_newest: set[str],
             where: str) -> None:
        """Restore from `state`, checking the ledger log (`found`: its rows by (epoch, status);
        `finished_in_newest`: its prompt_ids of the newest epoch) against it; raises ValueError
        naming the log `where` on a mismatch."""
        self.newest_epoch = state["newest_epoch"]
        self.open_counts = {int(epoch): Counter(counts) for epoch, counts in state["open_counts"].items()}
        self.earlier_counts = Counter(state["earlier_counts"])
        self.finished_in_newest = finished_in_newest
        self.num_in_flight = Counter(entry.epoch for entry in in_flight)
        # Rows of closed epochs are checked together, those of open epochs one epoch at a time.
        logged, expected = Counter(), Counter()
        for (epoch, status), count in found.items():
            logged[(epoch if epoch in self.open_counts else "closed epochs", status)] += count
        expected.update({("closed epochs", status): n for status, n in self.earlier_counts.items()})
        for epoch, counts in self.open_counts.items():
            expected.update({(epoch, status): n for status, n in counts.items()})
        logged, expected = (Counter({key: n for key, n in c.items() if n}) for c in (logged, expected))
        if logged != expected:
            wrong = sorted((key for key in logged.keys() | expected.keys() if logged[key] != expected[key]), key=str)[:5]
            raise ValueError(f"ledger log {where} does not match the checkpoint: rows by (epoch, status) {wrong} "
                             f"are {[logged[k] for k in wrong]} in the log, {[expected[k] for k in wrong]} in the checkpoint")
        twice = [e.prompt_id for e in in_flight if e.epoch == self.newest_epoch and e.prompt_id in finished_in_newest]
        if twice:
            raise ValueError(f"ledger log {where}: prompt_ids {twice[:5]} of epoch {self.newest_epoch} are in flight "
                             "in the checkpoint and finished in the log")
