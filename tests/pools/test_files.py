"""save/load round trips; anything damaged or foreign raises PoolFileError naming the file."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specfree.pools import PoolFileError, SuffixArrayPool, TriePool


def make_trie() -> TriePool:
    pool = TriePool(max_nodes=500, branch_length=4, max_query_length=3, decay=0.25)
    pool.update([1, 2, 3, 1, 2, 4, 200_000, 7])
    pool.begin_request([5, 1, 2, 3])
    return pool


def make_sa() -> SuffixArrayPool:
    docs = [np.arange(50) % 7, np.array([3, 1, 4, 1, 5, 9, 2, 6])]
    return SuffixArrayPool.build(docs, max_query_length=5, min_query_length=1, max_occurrences=33)


def test_trie_round_trip(tmp_path):
    pool = make_trie()
    pool.save(tmp_path / "t.trie")
    back = TriePool.load(tmp_path / "t.trie")
    assert back.to_dict() == pool.to_dict()
    assert (back.max_nodes, back.branch_length, back.max_query_length, back.decay) == (500, 4, 3, 0.25)
    assert back.lookup([9, 1, 2], 6, 3) == pool.lookup([9, 1, 2], 6, 3)
    back.end_request()  # the saved prompt counts still belong to "the current request"
    pool.end_request()
    assert back.to_dict() == pool.to_dict()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.lists(st.integers(0, 6), max_size=15), st.booleans()), max_size=5),
       st.integers(1, 40))
def test_trie_round_trip_random(tmp_path, texts, cap):
    pool = TriePool(max_nodes=cap, branch_length=3)
    for toks, is_input in texts:
        pool.update(toks, source="input" if is_input else "output")
    pool.save(tmp_path / "r.trie")
    assert TriePool.load(tmp_path / "r.trie").to_dict() == pool.to_dict()


@pytest.mark.parametrize("mmap", [True, False])
def test_suffix_array_round_trip(tmp_path, mmap):
    pool = make_sa()
    pool.save(tmp_path / "d.sa")
    back = SuffixArrayPool.load(tmp_path / "d.sa", mmap=mmap)
    assert np.array_equal(back.text, pool.text) and np.array_equal(back.sa, pool.sa)
    assert (back.max_query_length, back.min_query_length, back.max_occurrences) == (5, 1, 33)
    assert len(back) == len(pool) == 58
    for ctx in ([1, 2], [4, 1], [6, 0], [9]):
        assert back.lookup(ctx, 7, 4) == pool.lookup(ctx, 7, 4)


SAVED = {"trie": (make_trie, TriePool.load), "sa": (make_sa, SuffixArrayPool.load)}


@pytest.fixture(params=sorted(SAVED))
def saved(request, tmp_path):
    make, load = SAVED[request.param]
    path = tmp_path / f"pool.{request.param}"
    make().save(path)
    return path, path.read_bytes(), load


def test_truncated_files_raise(saved):
    path, data, load = saved
    for cut in sorted({0, 1, 8, 16, 20, 40, 127, 128, len(data) // 2, len(data) - 1}):
        path.write_bytes(data[:cut])
        with pytest.raises(PoolFileError, match=str(path)):
            load(path)


def test_trailing_bytes_raise(saved):
    path, data, load = saved
    path.write_bytes(data + b"\0")
    with pytest.raises(PoolFileError, match=f"{path}.*trailing bytes"):
        load(path)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_any_flipped_byte_raises(saved, data):
    path, raw, load = saved
    at = data.draw(st.integers(0, len(raw) - 1))
    flip = data.draw(st.integers(1, 255))
    path.write_bytes(raw[:at] + bytes([raw[at] ^ flip]) + raw[at + 1 :])
    with pytest.raises(PoolFileError, match=str(path)):
        load(path)


@pytest.mark.parametrize("content", [
    b"", b"hello world\n" * 20, bytes(range(256)) * 4,
    b"SPECFREE-TRIE\x00\x00\x00", b"SPECFREE-SA\x00\x00\x00\x00\x00" + b"\xff" * 100,
])
def test_garbage_raises(tmp_path, content):
    path = tmp_path / "junk.bin"
    path.write_bytes(content)
    for load in (TriePool.load, SuffixArrayPool.load):
        with pytest.raises(PoolFileError, match=str(path)):
            load(path)


def test_foreign_files_raise(tmp_path):
    npy, trie, sa = tmp_path / "a.npy", tmp_path / "b.trie", tmp_path / "c.sa"
    np.save(npy, np.arange(100))
    make_trie().save(trie)
    make_sa().save(sa)
    for path, load in ((npy, TriePool.load), (npy, SuffixArrayPool.load),
                       (sa, TriePool.load), (trie, SuffixArrayPool.load)):
        with pytest.raises(PoolFileError, match=f"{path}.*not a specfree"):
            load(path)


def test_missing_file_raises(tmp_path):
    for load in (TriePool.load, SuffixArrayPool.load):
        with pytest.raises(PoolFileError, match=f"{tmp_path / 'nope'}.*cannot read"):
            load(tmp_path / "nope")


def test_future_version_raises(tmp_path):
    import struct
    import zlib

    path = tmp_path / "v.trie"
    make_trie().save(path)
    raw = bytearray(path.read_bytes())
    header = bytearray(raw[16 : 16 + struct.calcsize("<IQQIIdII")])
    header[0:4] = struct.pack("<I", 99)
    header[-4:] = struct.pack("<I", zlib.crc32(bytes(header[:-4])))
    raw[16 : 16 + len(header)] = header
    path.write_bytes(bytes(raw))
    with pytest.raises(PoolFileError, match=f"{path}.*version 99"):
        TriePool.load(path)


def test_unverified_load_still_rejects_positions_outside_the_text(tmp_path):
    path = tmp_path / "d.sa"
    make_sa().save(path)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x40  # the high byte of the last suffix-array entry (little-endian int32)
    path.write_bytes(bytes(raw))
    with pytest.raises(PoolFileError, match=f"{path}.*outside the text"):
        SuffixArrayPool.load(path, verify=False)
