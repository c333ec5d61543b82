"""Value codecs (spar_comm/collectives/codecs.py) on NumPy, against the
independent roundings of reference.py: what each sends, how many bytes, and
the exactness that error feedback relies on: the value sent plus the value
kept is the value selected, bit for bit."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reference import ROUNDING
from spar_comm.collectives.codecs import (BLOCK, VALUES, BitmapIndices, Delta16Indices, Int32Indices, make_codec,
                                          make_index_codec)
from spar_comm.collectives.pairs import PairLayout

FLOATS = st.floats(allow_nan=False, allow_infinity=False, width=32)


def round_trip(name, values):
    codec = make_codec(name, values.dtype, np)
    raw = np.zeros(codec.nbytes(values.size), np.uint8)
    codec.encode(values, raw)
    return codec.decode(raw.reshape(1, -1), values.size)[0]


@settings(max_examples=80, deadline=None)
@given(values=st.lists(FLOATS, min_size=1, max_size=700), name=st.sampled_from(VALUES),
       dtype=st.sampled_from(["float32", "float64"]))
def test_each_codec_sends_what_the_reference_rounds_to_and_the_rest_is_exact(values, name, dtype):
    v = np.array(values, dtype)
    sent = round_trip(name, v)
    assert sent.dtype == v.dtype
    assert np.array_equal(sent, ROUNDING[name](v)), name
    kept = v - sent
    assert np.array_equal(sent + kept, v)  # Sterbenz: the difference is exact


def test_the_values_as_the_sum_holds_them_are_exact_and_take_their_width():
    v = np.random.default_rng(0).standard_normal(100).astype(np.float32)
    assert not make_codec(None, np.float32, np).lossy and not make_codec("float32", np.float32, np).lossy
    assert make_codec("float32", np.float64, np).lossy
    assert np.array_equal(round_trip(None, v), v) and make_codec(None, np.float64, np).nbytes(10) == 80


def test_large_values_saturate_instead_of_becoming_inf():
    v = np.array([1e6, -7e4, 3.0e38, -3.4e38], np.float32)
    assert np.array_equal(round_trip("float16", v), np.array([65504, -65504, 65504, -65504], np.float32))
    assert np.isfinite(round_trip("bfloat16", v)).all()
    largest = np.finfo(np.float32).max  # 127 steps of largest/127 round to Inf in float32 arithmetic
    assert np.array_equal(round_trip("int8", np.array([largest, -largest], np.float32)), [largest, -largest])


def test_int8_blocks_keep_each_value_within_half_a_step():
    v = np.random.default_rng(1).standard_normal(3 * BLOCK + 17).astype(np.float32) * 1e-3
    v[BLOCK : 2 * BLOCK] = 0  # an all-zero block stays zero
    sent = round_trip("int8", v)
    for start in range(0, v.size, BLOCK):
        block = v[start : start + BLOCK]
        step = np.abs(block).max() / 127
        assert np.all(np.abs(sent[start : start + BLOCK] - block) <= step / 2 * (1 + 1e-6))
    assert not sent[BLOCK : 2 * BLOCK].any()


@pytest.mark.parametrize("name, k, value_bytes", [
    (None, 1000, 4000), ("float16", 1000, 2000), ("bfloat16", 1000, 2000),
    ("int8", 1000, 4 * 4 + 1000), ("int8", 256, 4 + 256), ("int8", 1, 5),
])
def test_bytes_on_the_wire(name, k, value_bytes):
    codec = make_codec(name, np.float32, np)
    assert codec.nbytes(k) == value_bytes
    layout = PairLayout(k, np.float32, np, codec)
    assert layout.nbytes == -(-(-(-value_bytes // 8) * 8 + 4 * k) // 8) * 8  # both parts padded to 8 bytes


def test_a_record_written_and_read_back_holds_the_indices_and_the_decoded_values():
    rng = np.random.default_rng(2)
    for name in (None, *VALUES):
        layout = PairLayout(300, np.float32, np, make_codec(name, np.float32, np))
        buf = layout.empty(2)
        indices = [np.sort(rng.choice(10_000, 300, replace=False)).astype(np.int32) for _ in range(2)]
        values = [rng.standard_normal(300).astype(np.float32) for _ in range(2)]
        for r in range(2):
            layout.write(buf[r * layout.nbytes:], indices[r], values[r])
        got_values, got_indices = layout.read_all(buf, 2)
        for r in range(2):
            assert np.array_equal(got_indices[r], indices[r]), name
            assert np.array_equal(got_values[r], ROUNDING.get(name, lambda x: x)(values[r])), name


def test_an_unknown_codec_is_refused():
    with pytest.raises(ValueError, match="values must be one of float32, float16, bfloat16, int8, got 'int4'"):
        make_codec("int4", np.float32, np)


@pytest.mark.parametrize("changes, words", [
    (dict(values="int4"), "--values must be one of float32, float16, bfloat16, int8, auto, got 'int4'"),
    (dict(values="int8", algorithm="gtopk"), "--values applies to dense, hier_dense, topka, hitopk, hitopk_leader, not to --algorithm gtopk"),
    (dict(values="auto", algorithm="gtopk"), "--values applies to dense, hier_dense, topka, hitopk, hitopk_leader, not to --algorithm gtopk"),
])
def test_bad_value_codec_settings_are_named(changes, words):
    from spar_comm.training.config import TrainConfig

    assert words in "; ".join(TrainConfig(**changes).problems())
    assert TrainConfig(**{**changes, "values": "auto", "algorithm": "hitopk"}).problems() == []


@settings(max_examples=80, deadline=None)
@given(data=st.data(), span=st.integers(1, 300_000), codec=st.sampled_from([Int32Indices, Delta16Indices, BitmapIndices]))
def test_index_codecs_give_back_every_position(data, span, codec):
    k = data.draw(st.integers(1, min(span, 400)))
    seed = data.draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    records = [np.sort(rng.choice(span, k, replace=False)) for _ in range(3)]
    if data.draw(st.booleans()):  # the ends of the span: the longest gaps there are
        records[0] = np.unique(np.concatenate([[0, span - 1], records[0]]))[:k] if k >= 2 else np.array([span - 1])
        records[0] = np.sort(records[0])
    c = codec(k, span, np)
    raw = np.zeros((3, c.nbytes() + 3), np.uint8)
    for r, positions in enumerate(records):
        c.encode(positions, raw[r])
    got = c.decode(raw)
    assert got.shape == (3, k) and all(np.array_equal(got[r], records[r]) for r in range(3))


@pytest.mark.parametrize("k, span, chosen, nbytes", [
    (1000, 1 << 20, "delta16", 2 * (1000 + (1 << 20) // 65535)),  # density 0.001: 16-bit gaps
    (300, 1000, "bitmap", 125),                                    # density 0.3: a bit a position
    (2, 1 << 24, "int32", 8),                                      # two positions far apart: 4 bytes each
])
def test_auto_takes_the_smallest(k, span, chosen, nbytes):
    codec = make_index_codec("auto", k, span, np)
    assert codec.name == chosen and codec.nbytes() == nbytes
    with pytest.raises(ValueError, match="indices must be one of int32, auto"):
        make_index_codec("varint", k, span, np)


def test_float16_from_float32_bits_rounds_as_numpy_casts():
    """The integer float32 -> float16 path against NumPy's own cast: a million
    random finite bit patterns (subnormal halves, ties, saturation), and every
    finite half decoded back."""
    bits = np.random.default_rng(5).integers(0, 2**32, 1_000_000, dtype=np.uint64).astype(np.uint32)
    v = bits.view(np.float32)
    v = np.concatenate([v[np.isfinite(v)], np.float32([0.0, -0.0, 65504, 65519.99, 65520, 2**-24, 2**-25, 3 * 2**-26])])
    codec = make_codec("float16", np.float32, np)
    raw = np.zeros(codec.nbytes(v.size), np.uint8)
    codec.encode(v, raw)
    assert np.array_equal(raw.view(np.uint16), np.clip(v, -65504, 65504).astype(np.float16).view(np.uint16))
    halves = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    halves = halves[np.isfinite(halves.view(np.float16))]
    decoded = codec.decode(halves.view(np.uint8).reshape(1, -1), halves.size)[0]
    assert np.array_equal(decoded.view(np.uint32), halves.view(np.float16).astype(np.float32).view(np.uint32))
