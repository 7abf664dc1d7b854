"""The run-level ledger log: finished ledger rows (trained / dropped) and the buffer's events,
appended once each, so that the buffer's memory and its checkpoints hold only the in-flight window.

    output_dir/ledger/<log_id>/
        00000000-3f2a9c1e.ledger.parquet   finished ledger rows (`LEDGER_SCHEMA`)
        00000000-3f2a9c1e.events.parquet   events (`EVENTS_SCHEMA`)
        00000001-0b77d4a2.ledger.parquet   ...

Segments: the buffer collects finished rows and events in memory and appends them as one numbered
segment (a pair of parquet files) at every checkpoint cut, and whenever `flush_rows` are waiting.
Each file is written under a temporary name, fsynced and renamed, the events file last: a segment
whose events file exists is whole.

Transactions: a checkpoint records the log's cut, {log_id, num_segments, last_segment}. Resuming
from it deletes every later segment (appended by the run after that checkpoint; the resumed run
produces those rows again), so a kill between an append and the next checkpoint never counts a
prompt twice. `last_segment` carries a random tag: if the log was rewritten since (a resume from an
older checkpoint that went on past this one's cut), loading this checkpoint is an error, never a
silent mix. A fresh buffer starts a new log_id: a new run in the same output dir never appends to
an earlier run's log, whose checkpoints stay loadable.

Without a folder (a buffer used on its own, the tests) the segments stay in memory; a checkpoint of
such a buffer can only be loaded back into a buffer sharing the same `LedgerLog` object.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from rlactors.buffer.storage import EVENTS_SCHEMA, LEDGER_SCHEMA, load_buffer_scalars, to_table
from rlactors.runtime.durable import fsync_path

LEDGER_FOLDER = "ledger"  # under the run's output dir
DEFAULT_FLUSH_ROWS = 10_000
_KINDS = {"ledger": LEDGER_SCHEMA, "events": EVENTS_SCHEMA}


def _segment_index(name: str) -> int:
    return int(name.partition("-")[0])


def _segments(folder: Path) -> dict[int, str]:
    """Whole segments in `folder` (those whose events file exists): index -> name."""
    if not folder.is_dir():
        return {}
    return {_segment_index(p.name): p.name.removesuffix(".events.parquet") for p in folder.glob("*-*.events.parquet")}


def _check_cut(segments: dict[int, str], cut: dict, where: str) -> None:
    """Raise naming `where` unless segments 0..num_segments-1 are all there and the last is the cut's."""
    num = cut["num_segments"]
    missing = [i for i in range(num) if i not in segments]
    if missing:
        raise ValueError(f"ledger log {where}: segments {missing[:5]} of the {num} this checkpoint counts are missing")
    if num and segments[num - 1] != cut["last_segment"]:
        raise ValueError(
            f"ledger log {where}: segment {num - 1} is {segments[num - 1]!r}, the checkpoint wrote {cut['last_segment']!r}: "
            "the log was rewritten by a run resumed from an earlier checkpoint, so this one no longer matches it")


class LedgerLog:
    """Append-only log of finished ledger rows and events, in segments, truncated to a checkpoint's
    cut on resume. Rows are plain dicts with `LEDGER_SCHEMA` / `EVENTS_SCHEMA` columns."""

    def __init__(self, folder: str | Path | None = None, flush_rows: int = DEFAULT_FLUSH_ROWS):
        if flush_rows < 1:
            raise ValueError(f"flush_rows must be >= 1, got {flush_rows}")
        self.root = Path(folder) if folder is not None else None
        self.flush_rows = flush_rows
        self.log_id = uuid.uuid4().hex[:12]
        self.num_segments = 0
        self.last_segment = ""
        self.pending: dict[str, list[dict]] = {"ledger": [], "events": []}
        self.memory: list[tuple[str, dict[str, list[dict]]]] = []  # (name, rows by kind); no folder only

    @property
    def folder(self) -> Path | None:
        return self.root / self.log_id if self.root is not None else None

    def where(self) -> str:
        return str(self.folder) if self.folder is not None else f"in memory ({self.log_id})"

    # -- appending ----------------------------------------------------------------------------

    def add_entry(self, row: dict) -> None:
        self.pending["ledger"].append(row)

    def add_event(self, event: dict) -> None:
        self.pending["events"].append(event)

    def num_pending_rows(self) -> int:
        return len(self.pending["ledger"]) + len(self.pending["events"])

    def flush_if_full(self) -> None:
        if self.num_pending_rows() >= self.flush_rows:
            self.flush()

    def flush(self) -> None:
        """Append the waiting rows as the next segment. On an error (a full disk) they stay waiting."""
        if not self.num_pending_rows():
            return
        name = f"{self.num_segments:08d}-{uuid.uuid4().hex[:8]}"
        if self.folder is None:
            self.memory.append((name, {kind: list(rows) for kind, rows in self.pending.items()}))
        else:
            self._write_segment(name)
        self.num_segments, self.last_segment = self.num_segments + 1, name
        self.pending = {"ledger": [], "events": []}

    def _write_segment(self, name: str) -> None:
        folder = self.folder
        folder.mkdir(parents=True, exist_ok=True)
        self._delete_from(self.num_segments)  # leftovers of an attempt that failed half-way
        for kind in ("ledger", "events"):  # events last: its file marks the segment whole
            final = folder / f"{name}.{kind}.parquet"
            scratch = final.with_name(final.name + ".writing")
            pq.write_table(to_table(self.pending[kind], _KINDS[kind], f"ledger log {kind}"), scratch)
            fsync_path(scratch)
            os.replace(scratch, final)
        fsync_path(folder)

    def _delete_from(self, index: int) -> None:
        for path in self.folder.glob("*.parquet*") if self.folder.is_dir() else ():
            if _segment_index(path.name) >= index:
                path.unlink()

    # -- checkpoint cut -----------------------------------------------------------------------

    def cut(self) -> dict:
        """Append what is waiting and return the cut a checkpoint records."""
        self.flush()
        return {"log_id": self.log_id, "num_segments": self.num_segments, "last_segment": self.last_segment}

    def restore(self, cut: dict) -> None:
        """Continue the log of checkpoint `cut`: drop what was appended after it (and anything waiting)."""
        if self.folder is None:
            if cut["log_id"] != self.log_id:
                raise ValueError(f"checkpoint's ledger log {cut['log_id']!r} is not this buffer's in-memory log "
                                 f"{self.log_id!r}: give the buffer the run's ledger folder")
            _check_cut({_segment_index(name): name for name, _ in self.memory}, cut, self.where())
            del self.memory[cut["num_segments"]:]
        else:
            self.log_id = cut["log_id"]
            _check_cut(_segments(self.folder), cut, self.where())
            if self.folder.is_dir():
                self._delete_from(cut["num_segments"])
        self.num_segments, self.last_segment = cut["num_segments"], cut["last_segment"]
        self.pending = {"ledger": [], "events": []}

    def adopt(self, source_root: str | Path, cut: dict) -> None:
        """Before restoring `cut` of a checkpoint whose run kept its log under `source_root` (another
        run's output dir): copy that log's segments up to the cut into this log's folder, so the
        resumed run appends to its own copy and the other run's log stays as it was."""
        if self.root is None or Path(source_root).resolve() == self.root.resolve():
            return
        source, target = Path(source_root) / cut["log_id"], self.root / cut["log_id"]
        if not source.is_dir():
            return  # no log there: `restore` names what is missing
        segments = _segments(source)
        _check_cut(segments, cut, str(source))
        target.mkdir(parents=True, exist_ok=True)
        for index in range(cut["num_segments"]):
            for kind in ("ledger", "events"):  # events last: its file marks the segment whole
                name = f"{segments[index]}.{kind}.parquet"
                shutil.copyfile(source / name, target / (name + ".writing"))
                fsync_path(target / (name + ".writing"))
                os.replace(target / (name + ".writing"), target / name)
        fsync_path(target)

    # -- reading ------------------------------------------------------------------------------

    def cut_without_flush(self) -> dict:
        return {"log_id": self.log_id, "num_segments": self.num_segments, "last_segment": self.last_segment}

    def _appended(self, kind: str, columns: list[str] | None = None) -> list[list[dict]] | list[pa.Table]:
        if self.folder is None:
            return [rows[kind] for _, rows in self.memory]
        return read_segments(self.folder, self.cut_without_flush(), kind, columns)

    def rows(self, kind: str) -> list[dict]:
        """Every row of `kind` ("ledger" or "events") appended so far, then those waiting, in order."""
        appended = [row for part in self._appended(kind) for row in (part if isinstance(part, list) else part.to_pylist())]
        return [dict(row) for row in appended + self.pending[kind]]

    def finished_summary(self, epoch: int) -> tuple[Counter, set[str]]:
        """Over every appended and waiting ledger row: counts by (epoch, status), and the prompt_ids
        finished in `epoch`. Columnar on disk: a resume reads three columns of the whole log, once."""
        columns = ["epoch", "prompt_id", "status"]
        parts = [[[row[name] for row in part] for name in columns] if isinstance(part, list)
                 else [part.column(name).to_pylist() for name in columns]
                 for part in [*self._appended("ledger", columns), self.pending["ledger"]]]
        counts: Counter = Counter()
        prompt_ids: set[str] = set()
        for epochs, ids, statuses in parts:
            counts.update(zip(epochs, statuses, strict=True))
            prompt_ids.update(pid for e, pid in zip(epochs, ids, strict=True) if e == epoch)
        return counts, prompt_ids


def read_segments(folder: Path, cut: dict, kind: str, columns: list[str] | None = None) -> list[pa.Table]:
    """The `kind` tables of segments 0..num_segments-1 under `folder`, checked against `cut`."""
    segments = _segments(folder)
    _check_cut(segments, cut, str(folder))
    return [pq.read_table(folder / f"{segments[i]}.{kind}.parquet", columns=columns) for i in range(cut["num_segments"])]


def read_checkpoint_ledger(buffer_path: str | Path, ledger_dir: str | Path) -> list[dict]:
    """The full ledger as of a buffer checkpoint (`buffer_path`, written by `ReplayBuffer.save`): the
    finished rows in the run's ledger log up to the checkpoint's cut, then its in-flight rows."""
    scalars, in_flight = load_buffer_scalars(buffer_path)
    cut = scalars["log"]
    finished = read_segments(Path(ledger_dir) / cut["log_id"], cut, "ledger")
    return [row for table in finished for row in table.to_pylist()] + in_flight
