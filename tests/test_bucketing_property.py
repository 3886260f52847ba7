"""Property test of the bucketing passes on random graphs, run on 2 gloo ranks.

hypothesis draws programs of all_gathers, reduce_scatters, all_reduces (two groups, two
dtypes) and additions wired with random dependencies, and random byte caps per bucket
index. On each rank every pass, and all three in a row, must keep a topological order,
never put a node in a bucket with a node it depends on, respect every bucket's cap and
return bit-identical values. BK-3, BK-4, BK-7, BK-8, BK-10, BK-11.
"""

from __future__ import annotations

import bucketing_rank
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refimpl.multiprocess import run_on_ranks

step = st.tuples(
    st.sampled_from(["ag", "ag", "rs", "ar", "add"]),
    st.tuples(st.integers(0, 50), st.integers(0, 50)),
    st.integers(1, 6),
    st.sampled_from(["world", "other"]),
    st.sampled_from(["f32", "f64"]),
)


@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(step, min_size=3, max_size=14), n_inputs=st.integers(1, 4),
       caps=st.lists(st.integers(8, 400), min_size=1, max_size=4))
def test_bk4_random_graphs_keep_order_caps_and_values(steps, n_inputs, caps):
    """BK-3, BK-4, BK-7: order kept, no dependent in its own bucket, caps kept, same values."""
    for rank, report in enumerate(run_on_ranks(bucketing_rank.property_check, 2, steps,
                                               n_inputs, caps)):
        assert report["problems"] == [], f"rank {rank}: {report['problems']}"


def test_the_property_test_exercises_merging():
    """The random programs do merge: a fixed program with many candidates buckets them."""
    steps = [("ag", (0, 0), 2, "world", "f32")] * 3 + [("rs", (1, 0), 2, "other", "f64")] * 3
    report = run_on_ranks(bucketing_rank.property_check, 2, steps, 2, [1000])[0]
    assert report["problems"] == []
    assert report["merged"] == 6
