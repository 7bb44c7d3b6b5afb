from typing import Any

import pytest
import torch

from tiered_kv import FORMAT_VERSION, KVLayout


def test_shape_and_bytes():
    layout = KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, tokens_per_block=16, dtype=torch.bfloat16)
    assert layout.block_shape == (4, 2, 8, 16, 128)
    assert layout.bytes_per_block == 4 * 2 * 8 * 16 * 128 * 2
    assert layout.chunk_bytes == 8 * 16 * 128 * 2
    assert layout.partial_bytes(4) == layout.bytes_per_block // 4


def test_mla_kv_factor_one():
    layout = KVLayout(2, 1, 64, 32, torch.float8_e4m3fn, kv_factor=1)
    assert layout.block_shape == (2, 1, 1, 32, 64)
    assert layout.bytes_per_block == 2 * 32 * 64


def test_fingerprint_is_stable_across_runs():
    # A change of this value means every persisted block becomes unreadable: bump FORMAT_VERSION on purpose only.
    layout = KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, tokens_per_block=16, dtype=torch.float16)
    assert FORMAT_VERSION == 1
    assert layout.fingerprint == KVLayout(2, 4, 64, 16, torch.float16).fingerprint
    assert layout.fingerprint == "d4d193ae85af8a3a1727f4f02d7ce1d4"


@pytest.mark.parametrize(
    "change",
    [
        {"num_layers": 3},
        {"num_kv_heads": 8},
        {"head_dim": 128},
        {"tokens_per_block": 32},
        {"dtype": torch.bfloat16},
        {"kv_factor": 1},
    ],
)
def test_fingerprint_covers_every_field(change):
    base: dict[str, Any] = {
        "num_layers": 2, "num_kv_heads": 4, "head_dim": 64, "tokens_per_block": 16, "dtype": torch.float16
    }
    assert KVLayout(**base).fingerprint != KVLayout(**{**base, **change}).fingerprint


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_layers": 0},
        {"num_kv_heads": -1},
        {"head_dim": 1.5},
        {"tokens_per_block": True},
        {"kv_factor": 3},
        {"dtype": torch.complex64},
        {"dtype": torch.int64},
    ],
)
def test_invalid_fields(kwargs):
    base = {"num_layers": 2, "num_kv_heads": 4, "head_dim": 64, "tokens_per_block": 16}
    with pytest.raises(ValueError):
        KVLayout(**{**base, **kwargs})
