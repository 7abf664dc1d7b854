"""Where each tensor of a weight update sits in a bucket (pure): the bucket plan, the segment size,
views into a segment and the bytes an update carries."""

from __future__ import annotations

import pytest
import torch

from rlactors.weight_sync.layout import (
    ALIGN_BYTES,
    Entry,
    aligned,
    bucket_info,
    layer_of,
    plan_buckets,
    segment_bytes_for,
    tensor_bytes,
    update_bytes,
    views,
)

# Sizes chosen so that offsets need rounding up: 7 * 4 = 28 bytes, 33 * 2 = 66 bytes, ...
METAS = [
    ("embed", torch.float32, (7,)),
    ("q", torch.bfloat16, (3, 11)),
    ("k", torch.float16, (5,)),
    ("v", torch.float32, (4, 4)),
    ("norm", torch.bfloat16, (1,)),
    ("mlp", torch.float32, (2, 3, 5)),
    ("head", torch.float16, (40,)),
]


def flat(buckets):
    return [entry for bucket in buckets for entry in bucket]


def check_plan(buckets, metas, segment_bytes):
    """What every bucket plan holds: source order, aligned and disjoint offsets, within the segment."""
    assert [entry.name for entry in flat(buckets)] == [name for name, _, _ in metas]
    assert [(e.dtype, e.shape) for e in flat(buckets)] == [(dtype, shape) for _, dtype, shape in metas]
    for bucket in buckets:
        assert bucket, "an empty bucket"
        assert bucket[0].offset == 0
        for entry in bucket:
            assert entry.offset % ALIGN_BYTES == 0
            assert entry.offset + entry.num_bytes <= segment_bytes
        for before, after in zip(bucket, bucket[1:], strict=False):
            assert after.offset >= before.offset + before.num_bytes  # no overlap
            assert after.offset == aligned(before.offset + before.num_bytes)  # no space wasted


def test_tensor_bytes_and_alignment():
    assert tensor_bytes(torch.float32, (3, 5)) == 60
    assert tensor_bytes(torch.bfloat16, (3, 5)) == 30
    assert tensor_bytes(torch.float16, ()) == 2
    assert tensor_bytes(torch.float32, (4, 0)) == 0
    assert [aligned(n) for n in (0, 1, ALIGN_BYTES - 1, ALIGN_BYTES, ALIGN_BYTES + 1)] == [
        0, ALIGN_BYTES, ALIGN_BYTES, ALIGN_BYTES, 2 * ALIGN_BYTES]
    assert Entry("x", torch.bfloat16, (3, 4), 0).num_bytes == 24


def test_one_big_segment_holds_everything_in_order_at_aligned_offsets():
    buckets = plan_buckets(METAS, 1 << 20)
    assert len(buckets) == 1
    check_plan(buckets, METAS, 1 << 20)
    assert [entry.offset for entry in buckets[0]] == [0, 64, 192, 256, 320, 384, 512]


def test_a_full_bucket_opens_the_next_one():
    segment_bytes = 128
    buckets = plan_buckets(METAS, segment_bytes)
    check_plan(buckets, METAS, segment_bytes)
    # embed (28 B) at 0; q (66 B) at 64 would end at 130 > 128: a new bucket; k (10 B) at 128 too;
    # v (64 B) fits at 64 after k; mlp (120 B) never shares a bucket of 128.
    assert [[entry.name for entry in bucket] for bucket in buckets] == [
        ["embed"], ["q"], ["k", "v"], ["norm"], ["mlp"], ["head"]]
    assert [[entry.offset for entry in bucket] for bucket in buckets] == [[0], [0], [0, 64], [0], [0], [0]]


def test_a_tensor_exactly_filling_the_rest_of_a_segment_stays_in_its_bucket():
    metas = [("a", torch.float32, (16,)), ("b", torch.float32, (16,)), ("c", torch.float32, (1,))]
    buckets = plan_buckets(metas, 128)
    check_plan(buckets, metas, 128)
    assert [[(e.name, e.offset) for e in bucket] for bucket in buckets] == [[("a", 0), ("b", 64)], [("c", 0)]]


@pytest.mark.parametrize("segment_bytes", [64, 100, 128, 192, 256, 1000, 4096])
def test_plans_hold_for_many_segment_sizes(segment_bytes):
    metas = [(f"t{i}", dtype, (i % 5 + 1, 3)) for i, dtype in
             enumerate([torch.float32, torch.bfloat16, torch.float16] * 8)]
    assert max(tensor_bytes(dtype, shape) for _, dtype, shape in metas) <= 64
    buckets = plan_buckets(metas, segment_bytes)
    check_plan(buckets, metas, segment_bytes)
    # Greedy: the first tensor of each bucket after the first did not fit the bucket before it.
    for before, after in zip(buckets, buckets[1:], strict=False):
        last = before[-1]
        assert aligned(last.offset + last.num_bytes) + after[0].num_bytes > segment_bytes


def decoder_metas(num_layers: int = 2) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """An HF decoder's order: the embedding, each layer's four 32-byte tensors, the final norm."""
    layers = [(f"model.layers.{layer}.{part}.weight", torch.float32, (8,))
              for layer in range(num_layers) for part in ("q", "k", "v", "mlp")]
    return [("model.embed_tokens.weight", torch.float32, (10,)), *layers, ("model.norm.weight", torch.float32, (2,))]


def test_layer_of_is_the_decoder_layer_or_the_weight_itself():
    assert layer_of("model.layers.12.self_attn.q_proj.weight") == "model.layers.12"
    assert layer_of("model.language_model.layers.3.mlp.up_proj.weight") == "model.language_model.layers.3"
    assert layer_of("model.layers.1") == "model.layers.1"  # no dot after the index: a weight of its own
    assert layer_of("model.embed_tokens.weight") == "model.embed_tokens.weight"
    assert layer_of("lm_head.weight") == "lm_head.weight"


def test_a_layer_that_fits_a_bucket_of_its_own_never_straddles_two():
    # A layer takes 3 * 64 + 32 = 224 bytes; after the embedding (40 bytes at 0) it would start at
    # 64 and end at 288 > 256, so it opens the next bucket instead of splitting after its k.
    metas = decoder_metas()
    buckets = plan_buckets(metas, 256)
    check_plan(buckets, metas, 256)
    assert [[entry.name.rsplit(".", 2)[-2] for entry in bucket] for bucket in buckets] == [
        ["embed_tokens"], ["q", "k", "v", "mlp"], ["q", "k", "v", "mlp"], ["norm"]]
    for bucket in buckets:
        assert len({layer_of(entry.name) for entry in bucket}) == 1
    # With room for the embedding and a whole layer, they share a bucket.
    assert [len(bucket) for bucket in plan_buckets(metas, 320)] == [5, 5]


def test_a_layer_bigger_than_a_bucket_is_split_greedily():
    metas = decoder_metas(num_layers=1)
    buckets = plan_buckets(metas, 128)  # a layer (224 bytes) cannot travel whole
    check_plan(buckets, metas, 128)
    # The embedding and q, k and v, the mlp and the norm: a split layer packs like any tensors.
    assert [len(bucket) for bucket in buckets] == [2, 2, 2]


def test_a_tensor_bigger_than_the_segment_raises_naming_it():
    metas = [("small", torch.float32, (4,)), ("model.embed_tokens.weight", torch.float32, (10, 10))]
    with pytest.raises(ValueError, match=r"'model.embed_tokens.weight' \(400 bytes\) does not fit a segment of 256"):
        plan_buckets(metas, 256)
    assert len(plan_buckets(metas, 400)) == 2  # exactly its size: it travels alone


def test_segment_is_the_bucket_size_or_the_largest_tensor():
    assert segment_bytes_for(METAS, 1 << 20) == 1 << 20
    largest = max(tensor_bytes(dtype, shape) for _, dtype, shape in METAS)  # mlp: 120 bytes
    assert largest == 120
    assert segment_bytes_for(METAS, 16) == aligned(largest) == 128
    assert segment_bytes_for(METAS, 129) == 192  # rounded up to the alignment
    assert segment_bytes_for([], 0) == ALIGN_BYTES  # never empty
    for bucket_bytes in (1, 50, 120, 121, 500):
        segment_bytes = segment_bytes_for(METAS, bucket_bytes)
        assert segment_bytes >= max(largest, bucket_bytes) and segment_bytes % ALIGN_BYTES == 0
        check_plan(plan_buckets(METAS, segment_bytes), METAS, segment_bytes)  # every tensor fits one


def test_bucket_info_lists_each_entry():
    bucket = plan_buckets(METAS[:3], 1024)[0]
    assert bucket_info(bucket) == {
        "names": ["embed", "q", "k"],
        "dtype_names": ["float32", "bfloat16", "float16"],
        "shapes": [[7], [3, 11], [5]],
        "offsets": [0, 64, 192],
    }


def test_views_round_trip_mixed_dtypes_through_a_uint8_segment():
    generator = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(shape, generator=generator).to(dtype) for name, dtype, shape in METAS}
    segment_bytes = segment_bytes_for(METAS, 200)
    buckets = plan_buckets(METAS, segment_bytes)
    assert len(buckets) > 1
    received = {}
    for bucket in buckets:
        segment = torch.full((segment_bytes,), 0xAB, dtype=torch.uint8)  # garbage between the tensors
        info = bucket_info(bucket)
        for name, view in views(segment, info):  # the sender's side: write into the views
            view.copy_(tensors[name])
        # The receiver's side, from the plain lists alone, after the segment went through bytes.
        copied = torch.frombuffer(bytearray(segment.numpy().tobytes()), dtype=torch.uint8)
        for name, view in views(copied, info):
            received[name] = view.clone()
    assert list(received) == [name for name, _, _ in METAS]
    for name, tensor in tensors.items():
        assert received[name].dtype == tensor.dtype and received[name].shape == tensor.shape
        assert torch.equal(received[name], tensor), name


def test_views_share_the_segment_memory():
    segment = torch.zeros(256, dtype=torch.uint8)
    info = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2, 2]], "offsets": [64]}
    [(name, view)] = views(segment, info)
    view.fill_(1.0)
    assert name == "w" and segment[:64].sum() == 0 and segment[80:].sum() == 0
    assert torch.equal(segment[64:80].view(torch.float32), torch.ones(4))


@pytest.mark.parametrize(("offset", "shape"), [(-64, [4]), (250, [4]), (0, [65]), (192, [16, 2])])
def test_views_refuse_an_entry_outside_the_segment(offset, shape):
    segment = torch.zeros(256, dtype=torch.uint8)
    info = {"names": ["layers.0.w"], "dtype_names": ["float32"], "shapes": [shape], "offsets": [offset]}
    with pytest.raises(ValueError, match=r"weight 'layers.0.w': bytes .* lie outside the segment of 256 bytes"):
        views(segment, info)


def test_views_refuse_lists_of_different_lengths():
    segment = torch.zeros(256, dtype=torch.uint8)
    with pytest.raises(ValueError):
        views(segment, {"names": ["a", "b"], "dtype_names": ["float32"], "shapes": [[1]], "offsets": [0]})


def test_update_bytes_counts_each_tensor_once():
    buckets = plan_buckets(METAS, 128)
    total = sum(tensor_bytes(dtype, shape) for _, dtype, shape in METAS)
    assert total == 28 + 66 + 10 + 64 + 2 + 120 + 80
    assert sum(update_bytes(bucket_info(bucket)) for bucket in buckets) == total
    # Offsets (and padding) do not count; any backend's info with dtype names and shapes does.
    assert update_bytes({"names": ["a", "b"], "dtype_names": ["bfloat16", "float32"], "shapes": [[3, 4], [5]],
                         "data": [b"", b""]}) == 24 + 20
    assert update_bytes({}) == 0
    with pytest.raises(ValueError):
        update_bytes({"dtype_names": ["float32"], "shapes": [[1], [2]]})


def test_an_empty_tensor_first_gets_a_bucket():
    metas = [("empty", torch.float32, (0,)), ("a", torch.float32, (4,))]
    buckets = plan_buckets(metas, 64)
    check_plan(buckets, metas, 64)
