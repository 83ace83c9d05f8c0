"""benchmarks/bench_floors.py: the default target's counts and the floor of a pass, alone (the
rates themselves are the machine's; nothing here times anything)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_floors as bf  # noqa: E402

SMOLLM2 = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152}
# 64 byte products and 16 multiply-adds a ns; 10 GB/s
MACHINE = bf.Machine(byte_products_per_ns=64.0, fmas_per_ns=16.0, read_gb_per_s=10.0)


def test_smollm2_counts_106m_layer_and_28m_head_products_a_token():
    s = bf.shapes_of(SMOLLM2)
    per_layer = 576 * (576 + 2 * 192) + 576 * 576 + 2 * 576 * 1536 + 1536 * 576
    assert s.layer_macs == 30 * per_layer == 106_168_320
    assert s.head_macs == 576 * 49152
    assert s.weight_bytes == pytest.approx(s.layer_macs * 20 / 32 + s.head_macs * 34 / 32)


def test_head_dim_defaults_to_the_width_over_the_heads():
    no_head_dim = {k: v for k, v in SMOLLM2.items() if k != "head_dim"}
    assert bf.shapes_of(no_head_dim) == bf.shapes_of(SMOLLM2)


def test_one_row_is_bound_by_the_reads_and_many_by_the_products():
    s = bf.Shapes(layer_macs=64_000_000, head_macs=16_000_000)  # 57 MB of weights: 5.7 ms to read
    reads = s.weight_bytes / 10.0 / 1e6
    assert bf.floor_ms(MACHINE, s, 1, 1, 14) == pytest.approx(reads)  # 2 + 1 ms of arithmetic
    # 16 rows: 16 x 2 ms of 14-bit products and 16 x 1 ms of head, past the reads
    assert bf.floor_ms(MACHINE, s, 16, 16, 14) == pytest.approx(48.0)
    assert bf.floor_ms(MACHINE, s, 16, 0, 8) == pytest.approx(16.0)  # 8-bit: one product a weight


def test_only_the_rows_that_take_the_head_pay_for_it():
    s = bf.Shapes(layer_macs=64_000_000, head_macs=16_000_000)
    assert bf.floor_ms(MACHINE, s, 20, 4, 8) - bf.floor_ms(MACHINE, s, 20, 0, 8) == pytest.approx(4.0)
