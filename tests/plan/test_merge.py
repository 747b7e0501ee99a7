"""merge_ranges merges exactly the rows contiguous on both sides (and equal in key), in one vectorised pass."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_transfer.plan.merge import merge_ranges


def cols(*rows: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    a = np.array(rows, dtype=np.int64).reshape(-1, 3)
    return a[:, 0].copy(), a[:, 1].copy(), a[:, 2].copy()


def test_rows_contiguous_on_both_sides_merge_even_out_of_order():
    loc, rem, ln = merge_ranges(*cols((200, 1200, 100), (100, 1100, 100), (0, 1000, 100)))
    assert loc.tolist() == [0] and rem.tolist() == [1000] and ln.tolist() == [300]


def test_rows_contiguous_on_one_side_only_stay_apart():
    loc, rem, ln = merge_ranges(*cols((0, 1000, 100), (100, 5000, 100), (300, 5100, 50)))
    assert loc.tolist() == [0, 100, 300] and rem.tolist() == [1000, 5000, 5100] and ln.tolist() == [100, 100, 50]


def test_keys_block_merges():
    loc, rem, ln = merge_ranges(*cols((0, 0, 10), (10, 10, 10), (20, 20, 10)), key=np.array([1, 1, 2]))
    assert loc.tolist() == [0, 20] and ln.tolist() == [20, 10]


def test_empty_input():
    e = np.empty(0, dtype=np.int64)
    loc, rem, ln = merge_ranges(e, e, e)
    assert loc.shape == rem.shape == ln.shape == (0,)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 5), st.booleans(), st.booleans()), min_size=1, max_size=30), st.randoms())
def test_merge_preserves_every_byte_mapping(spec, rnd):
    """Byte i of the merged plan maps to the same remote byte as before; merged rows are maximal."""
    loc, rem, ln, pos, rpos = [], [], [], 0, 0
    for length, gap_l, gap_r in spec:
        pos += 3 * gap_l
        rpos += 7 * gap_r
        loc.append(pos)
        rem.append(rpos)
        ln.append(length)
        pos += length
        rpos += length
    order = list(range(len(loc)))
    rnd.shuffle(order)
    arrays = [np.array([x[i] for i in order], dtype=np.int64) for x in (loc, rem, ln)]
    m_loc, m_rem, m_ln = merge_ranges(*arrays)
    before = {a + k: b + k for a, b, n in zip(loc, rem, ln, strict=True) for k in range(n)}
    after = {a + k: b + k for a, b, n in zip(m_loc.tolist(), m_rem.tolist(), m_ln.tolist(), strict=True)
             for k in range(n)}
    assert before == after
    assert np.all(np.diff(m_loc) > 0)
    ends_l, ends_r = m_loc[:-1] + m_ln[:-1], m_rem[:-1] + m_ln[:-1]
    assert not np.any((ends_l == m_loc[1:]) & (ends_r == m_rem[1:]))
