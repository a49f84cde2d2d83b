"""``core/flat.py``: the bucket plan (the same on every rank for one layout), flattening
without a copy where it can and scattering back, pooled buffers, and the tensors a
collective refuses before any I/O."""

from __future__ import annotations

import pytest
import torch

from ferrosync.core.flat import (
    BufferPool,
    as_tensor_list,
    check_tensors,
    has_internal_overlap,
    layout_signature,
    plan_buckets,
)
from ferrosync.errors import ConfigError


def test_buckets_group_by_dtype_in_order_and_fill_up_to_the_size():
    f = [torch.zeros(10) for _ in range(5)]  # 40 bytes each
    h = torch.zeros(3, dtype=torch.float16)
    plan = plan_buckets([f[0], h, f[1], f[2], f[3], f[4]], bucket_bytes=100)
    assert [(b.dtype, b.numel) for b in plan] == [
        (torch.float32, 20), (torch.float32, 20), (torch.float32, 10), (torch.float16, 3)]
    assert [b.index for b in plan] == [0, 1, 2, 3]
    assert len(plan_buckets(f, bucket_bytes=None)) == 1
    big = torch.zeros(100)
    assert [b.numel for b in plan_buckets([f[0], big, f[1]], bucket_bytes=100)] == [10, 100, 10]


def test_a_lone_contiguous_tensor_travels_in_place_and_others_through_the_pool():
    pool = BufferPool()
    t = torch.arange(6.0)
    flat, copied = plan_buckets([t], None)[0].flat(pool)
    assert not copied and flat.data_ptr() == t.data_ptr()
    a, b = torch.arange(4.0).view(2, 2).t(), torch.tensor([9.0])  # a transpose
    bucket = plan_buckets([a, b], None)[0]
    flat, copied = bucket.flat(pool)
    assert copied and flat.tolist() == [0.0, 2.0, 1.0, 3.0, 9.0]
    bucket.scatter(flat * 10)
    assert a.tolist() == [[0.0, 20.0], [10.0, 30.0]] and b.tolist() == [90.0]


def test_a_negative_view_is_copied_with_its_sign():
    base = torch.tensor([1.0, -2.0])
    neg = base._neg_view()
    assert neg.is_neg()
    flat, copied = plan_buckets([neg], None)[0].flat(BufferPool())
    assert copied and flat.tolist() == [-1.0, 2.0]


def test_the_pool_grows_never_shrinks_and_keeps_roles_apart():
    pool = BufferPool()
    a = pool.get("flat", 10, torch.float32, "cpu")
    b = pool.get("flat", 4, torch.float32, "cpu")
    assert b.numel() == 4 and b.data_ptr() == a.data_ptr()  # reused
    c = pool.get("flat", 100, torch.float32, "cpu")
    assert c.numel() == 100
    other = pool.get("recv", 4, torch.float32, "cpu")
    assert other.data_ptr() != c.data_ptr()
    assert pool.get("flat", 0, torch.float32, "cpu").numel() == 0
    pool.clear()


def test_layout_signature_names_dtype_and_shape():
    assert layout_signature([torch.zeros(2, 3), torch.zeros(1, dtype=torch.int8)]) == [
        "float32[2, 3]", "int8[1]"]


@pytest.mark.parametrize("tensor, words", [
    (torch.zeros(3, 3).to_sparse(), "is a sparse_coo tensor"),
    (torch.empty(4, device="meta"), "is on the meta device"),
    (torch.zeros(1).expand(4), "has elements that share memory"),
])
def test_tensors_a_collective_cannot_move_are_refused_with_the_rank_and_url(tensor, words):
    with pytest.raises(ConfigError, match=words) as info:
        check_tensors([torch.zeros(1), tensor], op="average_", rank=1, path="s3://b/run")
    assert info.value.rank == 1 and info.value.path == "s3://b/run"
    assert "tensors[1]" in info.value.what and info.value.hint


def test_dtypes_and_read_only_overlap():
    with pytest.raises(ConfigError, match="grad has dtype torch.int64; average_ takes "
                                          "float32, float16"):
        check_tensors([torch.zeros(1, dtype=torch.int64)], op="average_", names=["grad"],
                      dtypes=(torch.float32, torch.float16))
    expanded = torch.zeros(1).expand(4)
    assert has_internal_overlap(expanded) and not has_internal_overlap(torch.zeros(1))
    check_tensors([expanded], op="broadcast", in_place=False)  # only read: fine


def test_as_tensor_list_accepts_one_or_many_and_names_what_is_not_a_tensor():
    t = torch.zeros(1)
    assert as_tensor_list(t) == [t] and as_tensor_list((t, t)) == [t, t]
    with pytest.raises(ConfigError, match="grads must be a tensor or an iterable of "
                                          "tensors, got int"):
        as_tensor_list(3, "grads")
    with pytest.raises(ConfigError, match=r"tensors\[1\] is a list, not a torch.Tensor"):
        as_tensor_list([t, [1.0]])
