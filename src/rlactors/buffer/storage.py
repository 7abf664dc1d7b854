"""The replay buffer's checkpoint files: its state dict as parquet tables (ledger.parquet holds the
in-flight ledger rows and carries the scalars, among them the cut of the run's ledger log, where the
finished rows and the events are: `rlactors.buffer.ledger_log`). Plain functions, called inside
the buffer actor (`ReplayBuffer.save`/`load`)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from rlactors.types import Group, PromptRequest, Sample, json_text

_INTS = pa.list_(pa.int64())
_REQUEST_FIELDS = [
    ("prompt_id", pa.string()), ("group_id", pa.string()), ("prompt_token_ids", _INTS),
    ("data_source", pa.string()), ("ground_truth", pa.string()), ("extra_info", pa.string()),
]
_SAMPLE = pa.struct([
    ("prompt_id", pa.string()), ("sample_index", pa.int64()), ("prompt_token_ids", _INTS),
    ("response_token_ids", _INTS), ("response_logprobs", pa.list_(pa.float64())),
    ("token_policy_versions", _INTS), ("finish_reason", pa.string()), ("error", pa.string()),
    ("text", pa.string()), ("score", pa.float64()), ("score_details", pa.string()), ("score_error", pa.string()),
    ("loss_mask", _INTS), ("num_turns", pa.int64()), ("num_tool_calls", pa.int64()), ("episode_reward", pa.float64()),
        ("environment_error", pa.string()), ("routed_experts", pa.binary()), ("routed_experts_shape", _INTS),
])
REQUESTS_SCHEMA = pa.schema([("epoch", pa.int64()), *_REQUEST_FIELDS])
GROUPS_SCHEMA = pa.schema([("batch_id", pa.int64()), ("epoch", pa.int64()), *_REQUEST_FIELDS,
                           ("samples", pa.list_(_SAMPLE)), ("baseline", _SAMPLE)])
LEDGER_SCHEMA = pa.schema([
    ("epoch", pa.int64()), ("prompt_id", pa.string()), ("status", pa.string()), ("group_id", pa.string()),
    ("num_attempts", pa.int64()), ("num_evictions", pa.int64()), ("reason", pa.string()),
    ("batch_id", pa.int64()), ("policy_version", pa.int64()), ("staleness", pa.int64()),
])
EVENTS_SCHEMA = pa.schema([
    ("kind", pa.string()), ("epoch", pa.int64()), ("prompt_id", pa.string()), ("group_id", pa.string()),
    ("policy_version", pa.int64()), ("staleness", pa.int64()), ("reason", pa.string()),
])
_META_KEY = b"rlactors.buffer"
# Every Sample field must be a column: pyarrow drops a struct key it has no column for, and a field
# added to Sample but not here would come back from a checkpoint as its default without a word.
if {f.name for f in dataclasses.fields(Sample)} != {_SAMPLE.field(i).name for i in range(_SAMPLE.num_fields)}:
    raise RuntimeError("the buffer checkpoint's sample columns differ from the fields of rlactors.types.Sample")


def _request_row(request: PromptRequest, where: str) -> dict:
    return dict(prompt_id=request.prompt_id, group_id=request.group_id, prompt_token_ids=request.prompt_token_ids,
                data_source=request.data_source, ground_truth=request.ground_truth,
                extra_info=json_text(request.extra_info, f"{where} extra_info"))


def _group_row(group: Group, epoch: int, batch_id: int) -> dict:
    where = f"prompt_id {group.prompt_id!r} group_id {group.group_id!r}"
    def row(s: Sample) -> dict:
        return dict(s.__dict__, score_details=json_text(s.score_details, f"{where} sample {s.sample_index} score_details"))

    return dict(batch_id=batch_id, epoch=epoch, **_request_row(group.request, where),
                samples=[row(s) for s in group.samples], baseline=None if group.baseline is None else row(group.baseline))


def _request_from(row: dict) -> PromptRequest:
    fields = {name: row[name] for name, _ in _REQUEST_FIELDS}
    return PromptRequest(**fields | {"extra_info": json.loads(row["extra_info"])})


def _group_from(row: dict) -> Group:
    # A column a checkpoint of an older version lacks is absent from its rows: the Sample default.
    def sample(s: dict) -> Sample:
        return Sample(**s | {"score_details": json.loads(s["score_details"])})

    baseline = row.get("baseline")
    return Group(_request_from(row), [sample(s) for s in row["samples"]], None if baseline is None else sample(baseline))


def to_table(rows: list[dict], schema: pa.Schema, what: str) -> pa.Table:
    try:
        return pa.Table.from_pylist(rows, schema=schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):
        for row in rows:  # find the row to name
            try:
                pa.Table.from_pylist([row], schema=schema)
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as error:
                raise ValueError(f"{what}: prompt_id {row.get('prompt_id')!r}: {error}") from None
        raise


def save_buffer_state(state: dict, path: str | Path) -> None:
    """Write `ReplayBuffer.state_dict()` as a folder of parquet files, replacing `path` atomically
    (a crash mid-write leaves the previous folder in place)."""
    path = Path(path)
    scratch = path.with_name(path.name + ".writing")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    requests = [dict(epoch=epoch, **_request_row(r, f"prompt_id {r.prompt_id!r}")) for epoch, r in state["requests"]]
    groups = [_group_row(group, epoch, -1) for epoch, group in state["queue"]]
    for batch in state["unacked"]:
        groups += [_group_row(g, e, batch["batch_id"]) for g, e in zip(batch["groups"], batch["epochs"], strict=True)]
    scalars = {k: v for k, v in state.items() if k not in ("entries", "requests", "queue")}
    scalars["unacked"] = [{k: v for k, v in b.items() if k not in ("groups", "epochs")} for b in state["unacked"]]
    ledger = to_table(state["entries"], LEDGER_SCHEMA, "ledger")
    pq.write_table(ledger.replace_schema_metadata({_META_KEY: json.dumps(scalars)}), scratch / "ledger.parquet")
    pq.write_table(to_table(requests, REQUESTS_SCHEMA, "requests"), scratch / "requests.parquet")
    pq.write_table(to_table(groups, GROUPS_SCHEMA, "groups"), scratch / "groups.parquet")
    previous = path.with_name(path.name + ".previous")
    if path.exists():
        os.replace(path, previous)
    os.replace(scratch, path)
    shutil.rmtree(previous, ignore_errors=True)


def _written_folder(path: str | Path) -> Path:
    path = Path(path)
    if not (path / "ledger.parquet").exists() and path.with_name(path.name + ".previous").exists():
        return path.with_name(path.name + ".previous")  # a crash hit between the two renames
    return path


def load_buffer_scalars(path: str | Path) -> tuple[dict, list[dict]]:
    """The scalars and the in-flight ledger rows of a folder written by `save_buffer_state`."""
    ledger = pq.read_table(_written_folder(path) / "ledger.parquet")
    return json.loads(ledger.schema.metadata[_META_KEY]), ledger.to_pylist()


def load_buffer_state(path: str | Path) -> dict:
    """Read a folder written by `save_buffer_state` back into a state dict."""
    path = _written_folder(path)
    state, entries = load_buffer_scalars(path)
    state["entries"] = entries
    state["requests"] = [(row["epoch"], _request_from(row)) for row in pq.read_table(path / "requests.parquet").to_pylist()]
    batches = {b["batch_id"]: b | {"groups": [], "epochs": []} for b in state["unacked"]}
    state["queue"] = []
    for row in pq.read_table(path / "groups.parquet").to_pylist():
        if row["batch_id"] < 0:
            state["queue"].append((row["epoch"], _group_from(row)))
        else:
            batches[row["batch_id"]]["groups"].append(_group_from(row))
            batches[row["batch_id"]]["epochs"].append(row["epoch"])
    state["unacked"] = list(batches.values())
    return state
