"""`auto` keeps a checkpoint near its own size (precision.memory_candidates): a mode whose weights would
take more than 1.3x the file's tensor bytes + 0.5 GiB is not measured or served, a mode asked for by name
is, and the startup's reason names what was left out. The file's bytes are read back from the GGUF's own
tensor table (the gguf library) as the oracle."""

from __future__ import annotations

import torch
from gguf import GGUFReader

from lmserve.model.assembly import CheckpointModes
from lmserve.model.loader import read_checkpoint
from lmserve.model.tuning import precision as P
from lmserve.model.tuning.precision import Mode

BF16, F32 = torch.bfloat16, torch.float32
GB = 10**9
AUTO = [Mode(F32), Mode(BF16), Mode(BF16, "int8"), Mode(BF16, "int4"), Mode(BF16, "kquant")]


def names(modes):
    return [m.name for m in modes]


def test_an_8b_k_quant_file_keeps_the_modes_near_its_size():
    stored = (int(4.46 * GB), 7_380_000_000)  # Llama-3.1-8B in Q4_K_M: 4.46 GB, 7.38 G weights
    kept, note = P.memory_candidates(AUTO, stored)
    assert names(kept) == ["bfloat16+int4", "bfloat16+kquant"]  # 4.6 and 4.46 GB, under 6.33
    assert "float32 (29.52 GB)" in note and "bfloat16 (14.76 GB)" in note and "bfloat16+int8 (7.84 GB)" in note


def test_a_small_model_keeps_every_mode():
    """The slack leaves a 135M model (97 MB in Q4_1) every mode, float32 (538 MB) included."""
    kept, note = P.memory_candidates(AUTO[:4], (96_576_768, 134_515_008))
    assert kept == AUTO[:4] and note == ""


def test_the_smallest_mode_stays_when_none_fits():
    kept, note = P.memory_candidates([Mode(F32), Mode(BF16)], (100 * GB // 100, 10 * GB))
    assert kept == [Mode(BF16)] and "float32" in note


def test_served_bytes_follow_each_layout():
    stored = (500, 1000)
    assert P.served_bytes(Mode(F32), stored) == 4000 and P.served_bytes(Mode(BF16), stored) == 2000
    assert P.served_bytes(Mode(BF16, "int8"), stored) == 1000 * 34 / 32
    assert P.served_bytes(Mode(BF16, "int4"), stored) == 1000 * 20 / 32
    assert P.served_bytes(Mode(BF16, "kquant"), stored) == 500


def test_the_stored_size_is_the_files_tensor_bytes(smollm2_gguf_path):
    table = GGUFReader(smollm2_gguf_path).tensors
    with read_checkpoint(smollm2_gguf_path) as ckpt:
        nbytes, weights = CheckpointModes(ckpt.config, ckpt.sources).stored_size()
    assert nbytes == sum(int(t.n_bytes) for t in table)
    assert weights == sum(int(t.n_elements) for t in table)
