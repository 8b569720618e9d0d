"""A Hugging Face checkpoint directory: config.json and safetensors shards, each tensor a source.

The shards are mapped, not loaded: a tensor is copied out of its shard when a loader reads it, and
its pages are handed back after (sources.py), so a bfloat16 checkpoint quantized at load never sits
in memory whole. The safetensors layout is small enough to read here (an 8-byte header length, a
JSON directory, then the tensors back to back), which is what makes handing pages back possible.
A legacy `pytorch_model.bin` is read whole with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..config import ModelConfig
from ..errors import CheckpointNotFoundError, ModelLoadError, ShapeMismatchError
from .layout import checkpoint_shapes
from .sources import MappedFile, TensorSource, contiguous_range

# safetensors dtype -> (numpy dtype with the same bytes, torch dtype)
_DTYPES = {"F32": (np.float32, torch.float32), "F16": (np.float16, torch.float16),
           "BF16": (np.uint16, torch.bfloat16), "F64": (np.float64, torch.float64),
           "I64": (np.int64, torch.int64), "I32": (np.int32, torch.int32), "I8": (np.int8, torch.int8),
           "U8": (np.uint8, torch.uint8), "BOOL": (np.bool_, torch.bool)}


@dataclass
class HFCheckpoint:
    config: ModelConfig
    sources: dict[str, TensorSource]
    files: list[MappedFile] = field(default_factory=list)

    def close(self) -> None:
        for f in self.files:
            f.close()


def shard_files(path: Path) -> list[Path]:
    """The safetensors files of a directory: those its index names (each must exist), else every one."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / s for s in shards]
        for f in files:
            if not f.is_file():
                raise CheckpointNotFoundError(f"shard {f.name} named in {index.name} is missing from {path}")
        return files
    return sorted(path.glob("*.safetensors"))


def _shard_sources(file: MappedFile, path: Path) -> dict[str, TensorSource]:
    buf = file.buf
    try:
        (n,) = struct.unpack_from("<Q", buf, 0)
        header = json.loads(bytes(buf[8:8 + n]))
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path.name} is not a readable safetensors file: {e}") from None
    base = 8 + n
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in _DTYPES:
            raise ModelLoadError(f"tensor {name!r} in {path.name} is stored as {entry['dtype']}, which is not supported")
        np_dtype, torch_dtype = _DTYPES[entry["dtype"]]
        shape = tuple(int(d) for d in entry["shape"])
        begin, end = (base + int(o) for o in entry["data_offsets"])
        if end > len(buf) or end - begin != int(np.prod(shape, dtype=np.int64)) * np.dtype(np_dtype).itemsize:
            raise ModelLoadError(f"tensor {name!r} in {path.name} runs past the file or disagrees with its shape")
        out[name] = _source(file, name, shape, entry["dtype"], np_dtype, torch_dtype, begin, end)
    return out


def _source(file: MappedFile, name: str, shape: tuple[int, ...], stored: str, np_dtype, torch_dtype,
            begin: int, end: int) -> TensorSource:
    count = int(np.prod(shape, dtype=np.int64))
    itemsize = np.dtype(np_dtype).itemsize

    def copy(offset: int, n: int) -> torch.Tensor:
        arr = np.array(np.frombuffer(file.buf, np_dtype, n, offset))  # a copy: the mapping is read-only
        t = torch.from_numpy(arr)
        return t.view(torch_dtype) if torch_dtype == torch.bfloat16 else t

    def read() -> torch.Tensor:
        return copy(begin, count).reshape(shape)

    def rows(index: torch.Tensor) -> torch.Tensor:
        if len(shape) != 2:
            return read()[index]
        row = shape[1] * itemsize
        span = contiguous_range(index)
        if span is not None:  # a slice of rows: one copy
            return copy(begin + span[0] * row, (span[1] - span[0]) * shape[1]).reshape(-1, shape[1])
        picked = [copy(begin + int(r) * row, shape[1]) for r in index.reshape(-1)]
        return torch.stack(picked).reshape(*index.shape, shape[1])

    return TensorSource(name, shape, stored, end - begin, read, rows, _release=lambda: file.release(begin, end - begin))


def open_hf_dir(path: str | Path) -> HFCheckpoint:
    """config.json + safetensors (single file or sharded index), or a weights-only torch file; the
    tensors as sources. Close the checkpoint when they have been read."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointNotFoundError(f"{path} has no config.json")
    cfg = ModelConfig.from_hf(path / "config.json", name=path.name)
    files = shard_files(path)
    if files:
        ckpt = HFCheckpoint(cfg, {})
        try:
            for f in files:
                mapped = MappedFile(f)
                ckpt.files.append(mapped)
                ckpt.sources.update(_shard_sources(mapped, f))
        except BaseException:
            ckpt.close()
            raise
    elif (path / "pytorch_model.bin").is_file():
        tensors = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
        ckpt = HFCheckpoint(cfg, {n: TensorSource.of(n, t) for n, t in tensors.items()})
    else:
        raise CheckpointNotFoundError(f"{path} has no *.safetensors weights")
    if cfg.tie_word_embeddings:
        ckpt.sources.pop("lm_head.weight", None)
    for name, shape in checkpoint_shapes(cfg).items():  # named before a fused tensor is split
        if name in ckpt.sources and tuple(ckpt.sources[name].shape) != shape:
            ckpt.close()
            raise ShapeMismatchError(name, shape, tuple(ckpt.sources[name].shape))
    return ckpt


__all__ = ["HFCheckpoint", "open_hf_dir", "shard_files"]
