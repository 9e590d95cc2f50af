"""rl_sync.packing.pack: a bucket's bytes, as the subscriber's layout wants them, whatever the
sources look like; its kept destination views never write into memory other than the destination's.

In-process (the pack is pure tensor work); the pushes that use it run in tests/test_rl_sync.py.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from rl_sync import packing
from rl_sync.plan import build_manifest, dtype_from_name, make_buckets


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "emb": torch.randn(37, 16, generator=g),  # large: split across buckets at small bucket sizes
        "norm": torch.randn(16, generator=g).to(torch.bfloat16),
        "steps": torch.randint(0, 1 << 40, (5,), generator=g),
        "half": torch.randn(3, 7, generator=g).to(torch.float16),
        "scalar": torch.tensor(3.5),
        "flag": torch.tensor([True, False, True]),
        "w": torch.randn(9, 11, generator=g),
    }


def _layout(state: dict[str, torch.Tensor], want: dict[str, torch.dtype], bucket_bytes: int):  # type: ignore[no-untyped-def]
    manifest = build_manifest({k: torch.empty(v.shape, dtype=want.get(k, v.dtype)) for k, v in state.items()},
                              1 << 30)
    return manifest, make_buckets(manifest, bucket_bytes)


def _expected(manifest, state: dict[str, torch.Tensor]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The arena the subscriber's layout wants: each entry in its dtype at its offset (made without pack)."""
    out = torch.zeros(manifest.arenas[0], dtype=torch.uint8)
    for e in manifest.entries:
        dt = dtype_from_name(e.dtype)
        out[e.offset:e.offset + e.nbytes].view(dt).copy_(state[e.name].to(dt).reshape(-1))
    return out


@pytest.mark.parametrize("bucket_bytes", [64, 256, 1 << 20])
def test_pack_casts_each_piece_into_its_place(bucket_bytes: int) -> None:
    """Mixed destination dtypes in one bucket (fp32 -> bf16 next to fp32 -> fp32, fp16 -> fp32),
    integer and bool pieces, a 0-dim entry, a transposed (non-contiguous) source, a source shaped
    otherwise with the same numel, and large entries split across buckets."""
    state = _state(1)
    want = {"emb": torch.bfloat16, "half": torch.float32, "w": torch.bfloat16}
    manifest, buckets = _layout(state, want, bucket_bytes)
    sources = dict(state)
    sources["w"] = state["w"].t().contiguous().t()  # the same values, column-major
    assert not sources["w"].is_contiguous()
    sources["half"] = state["half"].reshape(7, 3).reshape(21)  # (21,) where the layout says (3, 7)
    expected = _expected(manifest, {**state, "half": state["half"]})
    base = torch.zeros(manifest.arenas[0] + 64, dtype=torch.uint8)
    for _ in range(2):  # the second pass uses the kept views
        base.zero_()
        for b in buckets:
            packing.pack(b, sources, base, b.offset)
        assert torch.equal(base[:manifest.arenas[0]], expected)
        assert not base[manifest.arenas[0]:].any(), "a pack wrote past its bucket"
    if bucket_bytes == 64:
        assert len(buckets) > len(manifest.entries), "the entries must be split across buckets here"


def test_the_kept_plan_of_a_bucket_follows_its_sources_pack_after_pack() -> None:
    """One bucket packed into one destination again and again (the kept plan of its whole-entry
    pieces): all sources of one dtype (one copy), then mixed source dtypes, a source shaped
    otherwise, and one with fewer elements (refused): each pack gives the layout's bytes."""
    state = {n: t.float() for n, t in _state(5).items() if n not in ("steps", "flag")}
    manifest, buckets = _layout(state, {}, 1 << 20)
    (b,) = buckets
    base = torch.zeros(manifest.arenas[0], dtype=torch.uint8)
    mixed = dict(state, half=state["half"].half(), w=state["w"].double())  # (cast into the float32 layout)
    shaped = dict(state, w=state["w"].reshape(-1))
    for sources in (state, mixed, shaped, state):
        base.zero_()
        packing.pack(b, sources, base, b.offset)
        assert torch.equal(base, _expected(manifest, {n: t.reshape(state[n].shape) for n, t in sources.items()}))
    with pytest.raises((ValueError, RuntimeError)):
        packing.pack(b, dict(state, w=torch.zeros(50)), base, b.offset)


def test_pack_into_a_slot_at_offset_zero_and_refusals() -> None:
    """Slots take every bucket at their start; a source with fewer elements than its piece is refused."""
    state = _state(2)
    manifest, buckets = _layout(state, {}, 256)
    expected = _expected(manifest, state)
    slot = torch.zeros(max(b.nbytes for b in buckets), dtype=torch.uint8)
    for b in buckets:
        slot.zero_()  # (the layout's alignment gaps stay as they were)
        packing.pack(b, state, slot, 0)
        assert torch.equal(slot[:b.nbytes], expected[b.offset:b.offset + b.nbytes])
    short = dict(state, w=torch.zeros(50))
    with pytest.raises((ValueError, RuntimeError)):
        for b in buckets:
            packing.pack(b, short, slot, 0)


def test_kept_views_follow_their_destination_and_die_with_it() -> None:
    """Views are kept per destination object: a new destination (a slot made again) gets its own and
    the old one's memory is not written; once a destination is dropped its views go with it."""
    state = _state(3)
    manifest, buckets = _layout(state, {}, 1 << 20)
    old = torch.zeros(manifest.arenas[0], dtype=torch.uint8)
    packing.pack(buckets[0], state, old, 0)
    snapshot = old.clone()
    new = torch.zeros(manifest.arenas[0], dtype=torch.uint8)
    other = _state(4)
    packing.pack(buckets[0], other, new, 0)
    assert torch.equal(new, _expected(manifest, other)) and torch.equal(old, snapshot)
    kept = len(packing._kept)
    gone = weakref.ref(old)
    del old
    gc.collect()
    assert gone() is None, "the kept views must not keep their destination alive"
    assert len(packing._kept) < kept and packing._kept.get(new) is not None, "a dead destination's views must go"


def test_a_source_of_another_shape_is_refused_never_broadcast() -> None:
    """A whole entry's source of another shape (a tensor reshaped during a push, against its
    contract) goes piece by piece, where ``copy_`` refuses a size that does not fit: it is never
    broadcast into the entry (a (1, 3) source into a (4, 3) entry would fit a broadcast)."""
    state = {"w": torch.arange(12.0).reshape(4, 3)}
    manifest, buckets = _layout(state, {}, 1 << 20)
    base = torch.zeros(manifest.arenas[0], dtype=torch.uint8)
    for b in buckets:
        packing.pack(b, state, base, b.offset)  # (the kept plan of the bucket is made)
    before = base.clone()
    with pytest.raises((ValueError, RuntimeError)):
        for b in buckets:
            packing.pack(b, {"w": torch.full((1, 3), 7.0)}, base, b.offset)
    assert not bool((base.view(torch.float32) == 7.0).all()), "broadcast into the entry"
    assert torch.equal(base, before)


def test_an_entry_view_in_its_arena_or_a_part_of_it() -> None:
    """Entry.view_in: the whole entry, shaped, in its arena; a piece of it, flat, in a buffer that
    starts elsewhere in the arena (origin); flat=True keeps a whole entry flat."""
    state = _state(7)
    manifest, _ = _layout(state, {}, 1 << 20)
    arena = _expected(manifest, state)
    for e in manifest.entries:
        view = e.view_in(arena)
        assert view.dtype == state[e.name].dtype and view.shape == state[e.name].shape
        assert torch.equal(view, state[e.name]) and view.data_ptr() == arena.data_ptr() + e.offset
        assert e.view_in(arena, flat=True).shape == (state[e.name].numel(),)
    e = next(e for e in manifest.entries if e.name == "emb")
    size = state["emb"].element_size()
    origin = e.offset + 8 * size  # (a buffer that starts 8 elements into the entry)
    part = e.view_in(arena[origin:], 16 * size, 40 * size, origin=origin)
    assert part.shape == (24,) and torch.equal(part, state["emb"].reshape(-1)[16:40])


_EVERY = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128]
_EVERY += [getattr(torch, n) for n in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2")
           if hasattr(torch, n)]


@pytest.mark.parametrize("as_bytes", [None, True], ids=["default", "as_bytes"])
@pytest.mark.parametrize("dtype", _EVERY, ids=str)
def test_foreach_copy_is_byte_exact_for_every_dtype(dtype: torch.dtype, as_bytes: bool | None) -> None:
    """rl_sync's batched copies (the pack, the staged commit) run one dtype pair per
    ``_foreach_copy_``; an uncast batch runs as a byte copy (CUDA's kernel has no uint16/32/64):
    every byte lands, whatever the shapes (0-d, empty, views of an arena), nothing else is written.
    ``as_bytes=True`` runs here the byte copy a GPU batch of such a dtype takes."""
    from rl_sync.device import foreach_copy

    g = torch.Generator().manual_seed(7)
    shapes = [(), (0,), (5,), (3, 4)]
    size = torch.tensor([], dtype=dtype).element_size()
    top = 2 if dtype == torch.bool else 256  # (random bytes of every value, valid ones for bool)
    srcs = [torch.randint(0, top, (int(torch.Size(s).numel()) * size,), dtype=torch.uint8, generator=g)
            .view(dtype).reshape(s) for s in shapes]
    total = sum(t.numel() for t in srcs)
    arena = torch.full(((total + 2) * size,), 0xA5, dtype=torch.uint8)  # (one spare element at each end)
    dests, at = [], size
    for t in srcs:
        dests.append(arena[at:at + t.numel() * size].view(dtype).reshape(t.shape))
        at += t.numel() * size
    foreach_copy(dests, srcs, as_bytes=as_bytes)
    for d, s in zip(dests, srcs, strict=True):
        assert d.dtype == dtype and torch.equal(d.reshape(-1).view(torch.uint8), s.reshape(-1).view(torch.uint8))
    assert bool((arena[:size] == 0xA5).all()) and bool((arena[at:] == 0xA5).all())


def test_foreach_copy_casts_as_copy_does() -> None:
    """A cast batch (the publisher's float32 -> bfloat16) gives what ``copy_`` gives; a cast between
    types ``_foreach_copy_`` does not take on every device runs one ``copy_`` per tensor."""
    from rl_sync.device import foreach_copy

    g = torch.Generator().manual_seed(3)
    srcs = [torch.randn(5, generator=g), torch.randn(2, 3, generator=g)]
    dests = [torch.empty(t.shape, dtype=torch.bfloat16) for t in srcs]
    foreach_copy(dests, srcs)
    assert all(torch.equal(d, s.to(torch.bfloat16)) for d, s in zip(dests, srcs, strict=True))
    if hasattr(torch, "uint16"):
        ints = [torch.tensor([1, 2, 65535], dtype=torch.int32)]
        out = [torch.zeros(3, dtype=torch.uint16)]
        foreach_copy(out, ints)
        assert out[0].to(torch.int32).tolist() == [1, 2, 65535]
    foreach_copy([], [])  # (nothing to do)
    # the byte copy only for one dtype pair of plain tensors: a mixed batch, a lazily conjugated or negated
    # view (which .view(dtype) refuses) are copied one by one, as copy_ does
    mixed_src, mixed_dst = [torch.ones(2), torch.full((2,), 2.0, dtype=torch.bfloat16)], [torch.zeros(2),
                                                                                        torch.zeros(2, dtype=torch.bfloat16)]
    foreach_copy(mixed_dst, mixed_src, as_bytes=True)
    assert all(torch.equal(d, s) for d, s in zip(mixed_dst, mixed_src, strict=True))
    c = torch.complex(torch.randn(3, generator=g), torch.randn(3, generator=g))
    for lazy in (c.conj(), c.conj().imag):  # (is_conj(), is_neg())
        out = [torch.zeros(lazy.shape, dtype=lazy.dtype)]
        foreach_copy(out, [lazy], as_bytes=True)
        assert torch.equal(out[0], lazy.resolve_conj().resolve_neg())
