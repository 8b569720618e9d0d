"""Read a GGUF checkpoint into torch tensors named the way Hugging Face models of its family name them
(llama, qwen2, qwen3, gemma3, phi3: layout.py maps the names)."""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import ModelConfig
from ..errors import CheckpointNotFoundError, ModelLoadError, ShapeMismatchError, UnsupportedQuantizationError
from ..native.build import bound
from .layout import checkpoint_shapes, hf_name, split_fused, unshift_gemma_norms
from .sources import MappedFile, TensorSource, contiguous_range


DEQUANTIZE_ELEMENTS = 1 << 22  # weights dequantized at a time (16 MB of float32)


@dataclass
class GGUFCheckpoint:
    """A GGUF checkpoint: config, every GGUF key/value, and its tensors by HF name, either as sources
    read on demand from the mapped file (`open_gguf`) or dequantized (`read_gguf`)."""

    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, Any]
    q41: dict[str, Any] = field(default_factory=dict)  # HF name -> quant.Q41Blocks of Q4_0/Q4_1 tensors (keep_q41)
    q80: dict[str, Any] = field(default_factory=dict)  # HF name -> quant.Q80Blocks of Q8_0 tensors (keep_q41)
    sources: dict[str, TensorSource] = field(default_factory=dict)  # HF name -> its source (open_gguf)
    file: MappedFile | None = None  # the mapping the sources read (open_gguf); close() when done

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def llama_cpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to q/k rows: per head, rotate-half order -> interleaved pairs.

    Row r = half*(d/2) + j of a head moves to row 2*j + half. Works on weights [n_heads*d, in] and biases [n_heads*d].
    """
    rest = w.shape[1:]
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, d // 2, *rest).transpose(1, 2).reshape(w.shape)  # [nh, d/2, 2, ...] -> [nh*d, ...]


def llama_cpp_unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of `llama_cpp_permute`: interleaved-pair rows back to HF rotate-half order."""
    rest = w.shape[1:]
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, d // 2, 2, *rest).transpose(1, 2).reshape(w.shape)  # [nh, 2, d/2, ...] -> [nh*d, ...]


# ---- GGUF container (v2/v3, little-endian); tensor payloads are decoded by gguf.quants ----------
_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry in the GGUF directory: `ne` is GGML order (innermost first)."""

    name: str
    ne: tuple[int, ...]
    type_id: int
    offset: int  # absolute, into the file

    @property
    def torch_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.ne))


class _Cursor:
    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str):
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.scalar("<Q")
        self.pos += n
        return self.buf[self.pos - n:self.pos].decode("utf-8", errors="replace")

    def value(self, vtype: int):
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, n = self.scalar("<I"), self.scalar("<Q")
            if etype in _SCALARS:  # one unpack for the whole array
                fmt = f"<{n}{_SCALARS[etype][1]}"
                out = list(struct.unpack_from(fmt, self.buf, self.pos))
                self.pos += struct.calcsize(fmt)
                return out
            return [self.value(etype) for _ in range(n)]
        if vtype not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {vtype}")
        return self.scalar(_SCALARS[vtype])


def read_directory(buf) -> tuple[dict[str, Any], list[TensorInfo]]:
    """Parse a GGUF header from a bytes-like buffer: all key/values as Python values, and the tensor directory."""
    cur = _Cursor(buf)
    if bytes(buf[:4]) != _MAGIC:
        raise ValueError("not a GGUF file (bad magic)")
    cur.pos = 4
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 and 3 are; big-endian files are not)")
    n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
    meta: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv}
    for _ in range(n_kv):
        key = cur.string()
        meta[key] = cur.value(cur.scalar("<I"))
    raw = []
    for _ in range(n_tensors):
        name = cur.string()
        ne = tuple(cur.scalar("<Q") for _ in range(cur.scalar("<I")))
        raw.append((name, ne, cur.scalar("<I"), cur.scalar("<Q")))
    align = int(meta.get("general.alignment", 32))
    if align <= 0 or align & (align - 1):
        raise ValueError(f"invalid general.alignment {align}")
    data_start = -(-cur.pos // align) * align
    return meta, [TensorInfo(name, ne, type_id, data_start + off) for name, ne, type_id, off in raw]


class _NativeDequantizer:
    """The native library's GGUF dequantizer (native/csrc/gguf_dequant.cpp: the gguf package's float32
    values bitwise, ~20x its numpy speed and on every thread), used when the model loader has loaded
    the library; never built from here."""

    def __init__(self, lib):
        self._fn = lib.lm_gguf_dequantize
        self._fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p,
                             ctypes.c_int, ctypes.c_int]
        self._fn.restype = ctypes.c_int
        self._takes = lib.lm_gguf_dequantizes
        self._takes.argtypes = [ctypes.c_int]

    def takes(self, type_id: int, dtype: torch.dtype) -> bool:
        return dtype in (torch.float32, torch.bfloat16) and bool(self._takes(type_id))

    def __call__(self, data: np.ndarray, info: TensorInfo, out: torch.Tensor) -> None:
        if self._fn(data.ctypes.data, data.shape[0], info.ne[0], info.type_id, out.data_ptr(),
                    int(out.dtype == torch.bfloat16), torch.get_num_threads()):
            raise UnsupportedQuantizationError(f"tensor {info.name!r}: the native dequantizer refused its type")


def _dequantize(buf, info: TensorInfo, dtype: torch.dtype) -> torch.Tensor:
    """One GGUF tensor -> a torch tensor in torch (reversed-ne) shape, built without keeping extra copies."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    try:
        qtype = GGMLQuantizationType(info.type_id)
        block, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise UnsupportedQuantizationError(f"tensor {info.name!r} has unknown GGML type id {info.type_id}") from None
    if info.ne[0] % block:
        raise ModelLoadError(f"tensor {info.name!r}: row length {info.ne[0]} is not a multiple of {qtype.name}'s block {block}")
    row_bytes = info.ne[0] // block * type_size
    n_rows = int(np.prod(info.ne[1:], dtype=np.int64))
    if info.offset + row_bytes * n_rows > len(buf):
        raise ModelLoadError(f"tensor {info.name!r} runs past the end of the file (truncated download?)")
    data = np.frombuffer(buf, np.uint8, row_bytes * n_rows, info.offset).reshape(n_rows, row_bytes)
    out = torch.empty(n_rows, info.ne[0], dtype=dtype)
    native = bound(_NativeDequantizer)
    if native is not None and native.takes(info.type_id, dtype):
        native(data, info, out)
        return out.reshape(info.torch_shape)
    # a slice of rows at a time into one tensor of `dtype`: the dequantizer's temporaries (and a float32
    # copy, for another dtype) stay a slice's size
    step = max(1, DEQUANTIZE_ELEMENTS // info.ne[0])
    for r0 in range(0, n_rows, step):
        try:
            arr = quants.dequantize(data[r0:r0 + step], qtype)
        except NotImplementedError:
            raise UnsupportedQuantizationError(
                f"tensor {info.name!r} is stored as {qtype.name}, which cannot be dequantized"
            ) from None
        # writable for torch (an F32 tensor's values are a view of the read-only mapping: copied here)
        out[r0:r0 + step] = torch.from_numpy(np.require(arr, np.float32, "W").reshape(-1, info.ne[0]))
    return out.reshape(info.torch_shape)


def open_gguf(path: str | Path) -> GGUFCheckpoint:
    """A GGUF file mapped, its directory and metadata checked, every tensor a source read
    on demand (nothing is dequantized yet). Close the checkpoint when its tensors have been read.

    Raises CheckpointNotFoundError (no file), UnsupportedArchitectureError (an architecture or option
    the decoder does not implement),
    ShapeMismatchError (a tensor disagrees with the metadata), ModelLoadError (not GGUF, truncated, a
    required key or tensor absent). A tensor type gguf cannot dequantize raises
    UnsupportedQuantizationError when that tensor is read.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointNotFoundError(f"GGUF file not found: {path}")
    try:
        file = MappedFile(path)
    except ValueError as e:  # empty file
        raise ModelLoadError(f"{path} is not a GGUF file: {e}") from e
    try:
        return _read_mapped(path, file)
    except BaseException:
        file.close()
        raise


def read_gguf(path: str | Path, dtype: torch.dtype = torch.float32, keep_q41: bool = False) -> GGUFCheckpoint:
    """Read and dequantize a GGUF file (keep_q41: also keep Q4_0/Q4_1/Q8_0/Q5_0 tensors' own
    blocks). Raises as open_gguf does, and UnsupportedQuantizationError for a tensor type gguf
    cannot dequantize."""
    ckpt = open_gguf(path)
    try:
        for name, src in ckpt.sources.items():  # one tensor at a time: peak memory is one float32 copy
            ckpt.tensors[name] = src.read(dtype)
            kept = {"Q4_0": ckpt.q41, "Q4_1": ckpt.q41, "Q8_0": ckpt.q80, "Q5_0": ckpt.q80}.get(src.stored_as) if keep_q41 else None
            if kept is not None:
                kept[name] = src.blocks()
            src.release()
    finally:
        ckpt.close()
    ckpt.sources, ckpt.file = {}, None
    return ckpt


def _read_mapped(path: Path, file: MappedFile) -> GGUFCheckpoint:
    buf = file.buf
    try:
        metadata, infos = read_directory(buf)
    except (ValueError, struct.error, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {e}") from e

    by_name = {t.name: t for t in infos}
    extra = {"_tied": "output.weight" not in by_name}
    if "rope_factors_long.weight" in by_name and "rope_factors_short.weight" in by_name:  # phi3 LongRoPE
        extra["_rope_factors"] = {k: _dequantize(buf, by_name[f"rope_factors_{k}.weight"], torch.float32).tolist()
                                  for k in ("long", "short")}
    elif "rope_freqs.weight" in by_name:  # Llama 3's scaling as per-dimension factors
        extra["_rope_factors"] = _dequantize(buf, by_name["rope_freqs.weight"], torch.float32).tolist()
    try:
        config = ModelConfig.from_gguf({**metadata, **extra}, name=metadata.get("general.name") or path.stem)
    except KeyError as e:
        raise ModelLoadError(f"{path.name} lacks GGUF metadata key {e}") from None
    arch = config.model_type

    shapes = checkpoint_shapes(config)
    wanted = {hf_name(n, arch): n for n in by_name if hf_name(n, arch) in shapes}
    missing = sorted(set(shapes) - set(wanted))
    if missing:
        raise ModelLoadError(f"{path.name} lacks {len(missing)} tensor(s), e.g. {missing[:3]}")

    sources: dict[str, TensorSource] = {}
    for name, expected in shapes.items():
        info = by_name[wanted[name]]
        if info.torch_shape != expected:
            raise ShapeMismatchError(info.name, expected, info.torch_shape)
        _check_extent(buf, info)
        heads = None
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = config.num_heads if ".q_proj." in name else config.num_kv_heads
        sources[name] = _source(file, info, name, heads)
    sources = unshift_gemma_norms(config, split_fused(config, sources))
    return GGUFCheckpoint(config=config, tensors={}, metadata=metadata, sources=sources, file=file)


def _type_name(info: TensorInfo) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(info.type_id).name
    except ValueError:
        return f"type {info.type_id}"


def _byte_size(info: TensorInfo) -> tuple[int, int]:
    """(bytes per row, rows) of a tensor as stored; UnsupportedQuantizationError for an unknown type."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(info.type_id)]
    except (ValueError, KeyError):
        raise UnsupportedQuantizationError(f"tensor {info.name!r} has unknown GGML type id {info.type_id}") from None
    if info.ne[0] % block:
        raise ModelLoadError(f"tensor {info.name!r}: row length {info.ne[0]} is not a multiple of "
                             f"{_type_name(info)}'s block {block}")
    return info.ne[0] // block * type_size, int(np.prod(info.ne[1:], dtype=np.int64))


def _check_extent(buf, info: TensorInfo) -> None:
    row_bytes, n_rows = _byte_size(info)
    if info.offset + row_bytes * n_rows > len(buf):
        raise ModelLoadError(f"tensor {info.name!r} runs past the end of the file (truncated download?)")


def _source(file: MappedFile, info: TensorInfo, name: str, unpermute_heads: int | None) -> TensorSource:
    """The source of one GGUF tensor: dequantized (and for llama's q/k, unpermuted) when read."""
    row_bytes, n_rows = _byte_size(info)

    def read(dtype: torch.dtype = torch.float32) -> torch.Tensor:
        w = _dequantize(file.buf, info, dtype)
        return w if unpermute_heads is None else llama_cpp_unpermute(w, unpermute_heads).contiguous()

    def rows(index: torch.Tensor) -> torch.Tensor:
        if unpermute_heads is not None or len(info.ne) != 2:
            return read()[index]
        span = contiguous_range(index)
        if span is not None:  # a slice of rows: one read
            return _dequantize(file.buf, _rows(info, span[0], span[1] - span[0], row_bytes), torch.float32)
        picked = [_dequantize(file.buf, _rows(info, int(r), 1, row_bytes), torch.float32) for r in index.reshape(-1)]
        return torch.cat(picked).reshape(*index.shape, info.ne[0])

    def blocks():
        found = _quant_blocks(file.buf, info) if len(info.ne) == 2 else None
        if found is not None and unpermute_heads is not None:  # the blocks' rows in the unpermuted order
            found = found.rows(llama_cpp_unpermute(torch.arange(info.ne[1]), unpermute_heads))
        return found

    return TensorSource(name, info.torch_shape, _type_name(info), row_bytes * n_rows, read, rows, blocks,
                        lambda: file.release(info.offset, row_bytes * n_rows), meta={"gguf_name": info.name},
                        _read_as=read)


def _rows(info: TensorInfo, r: int, n: int, row_bytes: int) -> TensorInfo:
    """Rows r .. r + n - 1 of a 2-D tensor as a tensor of their own."""
    return TensorInfo(info.name, (info.ne[0], n), info.type_id, info.offset + r * row_bytes)


def _quant_blocks(buf, info: TensorInfo):
    """A Q4_0/Q4_1 (formats.Q41Blocks) or Q8_0/Q5_0 (formats.Q80Blocks) tensor's own codes and steps, a
    Q5_1 tensor's weights rounded to Q8_0 (Q80Blocks, not exact), a Q4_K/Q5_K/Q6_K tensor's bytes as
    stored (formats.KQuantBlocks), or None for other types.

    Q5_1 (w = d q + m, 5-bit codes) is what llama.cpp's K-quant mixes write for Q5_K's rows that 256 does
    not divide (SmolLM2's 576, Gemma 3 270M's 640). Its minimum has no place in 8-bit codes, so its
    weights, as a float read gives them, take Q8_0's recipe: on weights centred near zero that step,
    max|w| / 127, is about a quarter of Q5_1's (max - min) / 31, and each weight moves at most half of it."""
    from dataclasses import replace

    from gguf import GGMLQuantizationType as T

    from ..linear.formats import KQUANT_BLOCK_BYTES, QK_K, KQuantBlocks, Q41Blocks, Q80Blocks, quantize_q80

    if info.type_id == T.Q5_1 and len(info.ne) == 2:
        return replace(quantize_q80(_dequantize(buf, info, torch.float32)), exact=False)
    if info.type_id in KQUANT_BLOCK_BYTES:
        row_bytes = info.ne[0] // QK_K * KQUANT_BLOCK_BYTES[info.type_id]
        raw = np.frombuffer(buf, np.uint8, row_bytes * info.ne[1], info.offset).reshape(info.ne[1], row_bytes)
        return KQuantBlocks.from_raw(raw, info.type_id)
    read = {T.Q4_1: (20, Q41Blocks.from_raw), T.Q4_0: (18, Q41Blocks.from_raw_q40), T.Q8_0: (34, Q80Blocks.from_raw),
            T.Q5_0: (22, Q80Blocks.from_raw_q50)}
    if info.type_id not in read:
        return None
    block_bytes, parse = read[info.type_id]
    n_rows, row_bytes = info.ne[1], info.ne[0] // 32 * block_bytes
    return parse(np.frombuffer(buf, np.uint8, row_bytes * n_rows, info.offset).reshape(n_rows, row_bytes))
