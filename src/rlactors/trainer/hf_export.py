"""The trained model as a Hugging Face folder: loadable by `AutoModelForCausalLM.from_pretrained`
and servable by `vllm serve`.

    out/config.json                      the source model's config, `dtype` set to the export's
    out/generation_config.json           the source's, when it has one
    out/model-00001.safetensors, ...     the weights, one shard per bucket of ~`shard_bytes`
    out/model.safetensors.index.json     which shard holds each weight
    out/tokenizer.json, ...              the source's tokenizer

Two sources feed the same writer (`write_hf_folder`), one bucket of whole CPU tensors at a time,
so no process ever holds more than one bucket of gathered weights:
- a live trainer (`TrainerWorker.save_hf`): its FSDP shards gathered tensor by tensor;
- a saved checkpoint (`export_checkpoint`, `python -m rlactors export`): its DCP files, read a
  bucket at a time in a plain process (no Ray, no process group, no device).
A LoRA actor's folder holds the merged model, and the adapter alone as a peft folder in
`out/adapter` (a checkpoint holds the adapter only: the base comes from the run's model folder).

The folder appears complete or not at all: it is written under `.<name>.tmp`, fsynced and renamed
into place; an older folder of the same name is replaced only once the new one is whole.
"""

from __future__ import annotations

import itertools
import json
import shutil
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from rlactors.runtime.durable import fsync_path, fsync_tree

SHARD_BYTES = 2 << 30  # per safetensors file, and what one bucket of gathered weights may hold
INDEX_FILE = "model.safetensors.index.json"
TIED_HEAD = "lm_head.weight"


def source_dtype(model_path: str | Path) -> torch.dtype:
    """The dtype the source model's config.json declares (float32 when it declares none)."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{Path(model_path) / 'config.json'}: dtype {name!r} is not a torch dtype")
    return dtype


def write_hf_folder(buckets: Iterable[list[tuple[str, torch.Tensor]]], out: str | Path, model_path: str | Path,
                    architecture: str | None = None, dtype: torch.dtype | None = None,
                    config_updates: dict | None = None) -> Path:
    """Write `buckets` of (Hugging Face name, tensor) as a Hugging Face folder at `out`, with the
    config (and `config_updates` to it, e.g. a classifier's `num_labels`), generation config and
    tokenizer of `model_path`. A tied head (`lm_head.weight` while
    the config ties it) is left out: transformers and vLLM re-tie it to the embedding."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, GenerationConfig

    from rlactors.models import load_tokenizer

    out = Path(out)
    temp = out.with_name(f".{out.name}.tmp")
    if temp.exists():
        shutil.rmtree(temp)  # left by an interrupted export
    temp.mkdir(parents=True)
    config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    dtype = dtype or source_dtype(model_path)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    weight_map: dict[str, str] = {}
    total_bytes = 0
    number = 0
    for bucket in buckets:
        tensors = {name: tensor.to(dtype).contiguous() for name, tensor in bucket if not (tied and name == TIED_HEAD)}
        if not tensors:
            continue  # a bucket of the tied head alone
        number += 1
        shard = f"model-{number:05d}.safetensors"
        save_file(tensors, str(temp / shard), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, shard)
        total_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
    if not weight_map:
        raise ValueError(f"exporting to {out}: no weights were given")
    (temp / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total_bytes},
                                               "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    for shard in set(weight_map.values()):
        # safetensors writes owner-only files; a model folder is read by other users and services
        # (`vllm serve`): the shards get the permissions of any new file here, the index's.
        shutil.copymode(temp / INDEX_FILE, temp / shard)
    if architecture:
        config.architectures = [architecture]
    for name, value in (config_updates or {}).items():
        setattr(config, name, value)
    config.dtype = dtype
    config.save_pretrained(temp)
    try:
        GenerationConfig.from_pretrained(model_path, local_files_only=True).save_pretrained(temp)
    except OSError:
        pass  # the source has no generation config: nor does the export
    load_tokenizer(model_path).save_pretrained(temp)
    _move_into_place(temp, out)
    return out


def _move_into_place(temp: Path, out: Path) -> None:
    fsync_tree(temp)
    old = out.with_name(f".{out.name}.old")
    if old.exists() and not out.exists():
        old.rename(out)  # a kill between the two renames below: the older folder is the whole one
    if old.exists():
        shutil.rmtree(old)
    if out.exists():
        out.rename(old)  # the complete older folder goes only once the new one is whole
    temp.rename(out)
    fsync_path(out.parent)
    if old.exists():
        shutil.rmtree(old)


# --------------------------------------------------------------------------------------------
# From a saved checkpoint


def trainer_checkpoint_dir(path: str | Path) -> Path:
    """The actor's DCP folder of a checkpoint given as a run's output dir, its checkpoint root,
    one run checkpoint (`step_N`, which holds `actor/`) or the actor's folder itself."""
    from rlactors.trainer import checkpoint

    path = Path(path).absolute()
    for candidate in (path, path / "actor"):
        if (candidate / ".metadata").is_file():
            return candidate
    # A run's step_N holds the actor's own checkpoint root (actor/latest -> actor/step_N).
    for root in (path, path / "checkpoints", path / "actor"):
        if (root / checkpoint.LATEST).is_file():
            return trainer_checkpoint_dir(checkpoint.resolve_checkpoint(root))
    raise FileNotFoundError(f"{path}: not a checkpoint (no DCP .metadata in it or in {path / 'actor'}, and no "
                            f"'{checkpoint.LATEST}' file in it or in {path / 'checkpoints'})")


def checkpoint_buckets(trainer_dir: str | Path, bucket_bytes: int = SHARD_BYTES
                       ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The model weights of a trainer checkpoint (written by `TrainerWorker.save_checkpoint`) in
    buckets of about `bucket_bytes`, each read from the DCP files when it is needed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(trainer_dir))
    metadata = reader.read_metadata().state_dict_metadata
    names = [key for key, item in metadata.items() if key.startswith("model.") and isinstance(item, TensorStorageMetadata)]
    if not names:
        raise ValueError(f"{trainer_dir}: the checkpoint holds no model weights")
    bucket: dict[str, torch.Tensor] = {}
    size_bytes = 0
    for key in names:
        item = metadata[key]
        bucket[key] = torch.empty(item.size, dtype=item.properties.dtype)
        size_bytes += bucket[key].numel() * bucket[key].element_size()
        if size_bytes >= bucket_bytes or key == names[-1]:
            with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": no_dist says so
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(bucket, storage_reader=reader, no_dist=True)
            yield [(name.removeprefix("model."), tensor) for name, tensor in bucket.items()]
            bucket, size_bytes = {}, 0


def export_checkpoint(path: str | Path, out: str | Path, model_path: str | Path | None = None,
                      dtype: torch.dtype | None = None, shard_bytes: int = SHARD_BYTES) -> Path:
    """Write the actor model of the checkpoint at `path` as a Hugging Face folder at `out`. The
    config and tokenizer come from `model_path`, by default the run's model (its config.yaml)."""
    from rlactors.models.moe import folder_checkpoint_layout

    trainer_dir = trainer_checkpoint_dir(path)
    if model_path is None:
        model_path = run_model_path(trainer_dir)
    split = folder_checkpoint_layout(model_path)  # the trainer saved fused experts; the folder holds one per expert
    buckets = checkpoint_buckets(trainer_dir, shard_bytes)
    first = next(buckets)
    if any(".lora_" in name for name, _ in first):  # a LoRA actor's checkpoint holds its adapter alone
        adapter = dict(first) | {name: tensor for bucket in buckets for name, tensor in bucket}
        return export_lora(adapter, out, model_path, run_settings(trainer_dir).model.lora, dtype, split)
    buckets = ([pair for name, tensor in bucket for pair in split(name, tensor)]
               for bucket in itertools.chain([first], buckets))
    return write_hf_folder(buckets, out, model_path, dtype=dtype)


def export_lora(adapter: dict[str, torch.Tensor], out: str | Path, model_path: str | Path, lora_config,
                dtype: torch.dtype | None, split) -> Path:
    """The base model of `model_path` with the `adapter` (the trainer's names) merged in, as a Hugging
    Face folder at `out`, and the adapter alone as a peft folder in `out/adapter` (as a LoRA run's
    live export writes them)."""
    from rlactors.models import load_model
    from rlactors.models.lora import (
        ADAPTER_FOLDER,
        adapter_state_items,
        add_adapters,
        merged_state_items,
        save_adapter,
    )

    model = add_adapters(load_model(model_path), lora_config)
    missing = set(adapter) - set(model.state_dict())
    if missing:
        raise ValueError(f"the checkpoint's adapter does not fit model.lora={lora_config}: no {sorted(missing)[0]!r}")
    model.load_state_dict(adapter, strict=False)
    merged = [pair for name, tensor in merged_state_items(model, model.state_dict().items())
              for pair in split(name, tensor)]
    folder = write_hf_folder([merged], out, model_path, dtype=dtype)
    save_adapter(folder / ADAPTER_FOLDER, dict(adapter_state_items(model, adapter.items())), lora_config,
                 str(model_path))
    return folder


def run_settings(trainer_dir: Path):
    """The `Config` of the run that wrote `trainer_dir` (output_dir/checkpoints/step_N/actor/step_N,
    or a trainer's own output_dir/checkpoints/step_N/actor), from its config.yaml."""
    from rlactors.config import load_config

    run_config = next((folder / "config.yaml" for folder in trainer_dir.parents[2:4]
                       if (folder / "config.yaml").is_file()), None)
    if run_config is None:
        raise FileNotFoundError(f"{trainer_dir}: no run config.yaml three or four folders up to name the model; "
                                "give the model folder (--model)")
    return load_config(run_config)


def run_model_path(trainer_dir: Path) -> Path:
    """The model folder the run that wrote `trainer_dir` trained (`run_settings`)."""
    model_path = Path(run_settings(trainer_dir).model.path)
    if not (model_path / "config.json").is_file():
        raise FileNotFoundError(f"{trainer_dir}: the run's model.path {model_path} holds no config.json (a relative "
                                "path is read from the current folder); give the model folder (--model)")
    return model_path
