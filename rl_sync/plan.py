"""What moves where: the subscriber's arena layout, the bucket layout, the plan hash.

Theory of operation:

* A subscriber lays its weights out in a few flat ``uint8`` *arenas* (each at
  most ``arena_bytes``, entries 64-byte aligned, in its state dict's order) and
  describes them in a :class:`Manifest`, which it registers on its endpoint as
  a small buffer (:data:`MANIFEST_BUFFER`) so a publisher can ``get`` it
  one-sidedly.
* A publisher reads the manifest once per subscriber incarnation and cuts
  each arena into *buckets*: contiguous byte ranges of at most
  ``bucket_bytes``, cut at entry boundaries where an entry fits (an entry
  larger than a bucket is split across several). A bucket is packed on the
  publisher into one flat send slot and lands in one contiguous range of the
  subscriber's arena.
* :func:`plan_hash` covers the ordered entries (names, dtypes, shapes,
  offsets), the arenas and the bucket layout. The publisher sends it with
  every push; the subscriber recomputes it from its own manifest and refuses
  a push whose hash differs, so a layout mismatch is an error before any
  byte moves, never garbage at run time.
"""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

import transport

from .errors import PlanMismatchError
from .messages import Pull

__all__ = [
    "ARENA_PREFIX",
    "MANIFEST_BUFFER",
    "arena_name",
    "Bucket",
    "Entry",
    "Manifest",
    "Piece",
    "build_manifest",
    "check_sources",
    "SourceMemo",
    "decode_manifest",
    "dtype_from_name",
    "dtype_name",
    "encode_manifest",
    "host_key",
    "make_buckets",
    "plan_hash",
    "pull_where",
    "sent_dtype",
]

MANIFEST_BUFFER = "rl_sync/manifest"
ARENA_PREFIX = "rl_sync/arena/"


def arena_name(bank: int, arena: int) -> str:
    """The registered name of arena ``arena`` of bank ``bank`` (``mode="swap"`` has two banks)."""
    return f"{ARENA_PREFIX}{bank}/{arena}"
ALIGN = 64
FORMAT = 1


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise PlanMismatchError([f"unknown dtype {name!r} in a subscriber manifest"])
    return dt


class Entry(msgspec.Struct, frozen=True, array_like=True):
    """One named tensor inside an arena."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    arena: int
    offset: int  # bytes from the arena's start
    nbytes: int

    def view_in(self, buf: torch.Tensor, start: int = 0, stop: int | None = None, *, origin: int = 0,
                flat: bool = False) -> torch.Tensor:
        """Bytes ``[start, stop)`` of this entry (default: all of them) in ``buf``, a flat uint8
        tensor whose byte 0 is byte ``origin`` of the entry's arena (default: ``buf`` is the whole
        arena), viewed as the entry's dtype: shaped like the entry when they are all of it (unless
        ``flat``), else flat."""
        stop = self.nbytes if stop is None else stop
        at = self.offset + start - origin
        view = buf[at:at + stop - start].view(dtype_from_name(self.dtype))
        return view.view(self.shape) if not flat and start == 0 and stop == self.nbytes else view


class Manifest(msgspec.Struct, frozen=True):
    """A subscriber's receive layout, as registered under :data:`MANIFEST_BUFFER`."""

    format: int
    entries: tuple[Entry, ...]
    arenas: tuple[int, ...]  # byte size of arena i, registered as arena_name(bank, i) for each bank
    host: str = ""  # which host the subscriber runs on (used to group relays)
    shared: bool = False  # mode="shared": it reads the publisher's banks (no arenas registered)


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(Manifest)


def encode_manifest(m: Manifest) -> bytes:
    return _enc.encode(m)


def decode_manifest(data: bytes) -> Manifest:
    try:
        m = _dec.decode(data)
    except Exception as exc:  # a peer's bytes: DecodeError, and RecursionError / MemoryError on hostile nesting
        raise PlanMismatchError([f"the subscriber's manifest does not decode: {type(exc).__name__}: {exc}"]) from exc
    if m.format != FORMAT:
        raise PlanMismatchError([f"manifest format {m.format}, this rl_sync reads format {FORMAT}"])
    return m


def build_manifest(state: Mapping[str, torch.Tensor], arena_bytes: int, host: str = "", *,
                   shared: bool = False) -> Manifest:
    """Lay ``state`` out in arenas of at most ``arena_bytes`` (a larger tensor gets an arena of its own)."""
    entries: list[Entry] = []
    arenas: list[int] = []
    cur = -1
    used = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        start = -(-used // ALIGN) * ALIGN
        if cur < 0 or (start + nbytes > arena_bytes and used > 0):
            arenas.append(0)
            cur += 1
            start = 0
        entries.append(Entry(name, dtype_name(t.dtype), tuple(t.shape), cur, start, nbytes))
        used = start + nbytes
        arenas[cur] = used
    return Manifest(FORMAT, tuple(entries), tuple(arenas), host, shared)


@dataclass(frozen=True)
class Piece:
    """The part of one entry that travels in one bucket: entry bytes ``[start, stop)``."""

    entry: Entry
    start: int
    stop: int


@dataclass(frozen=True)
class Bucket:
    """Bytes ``[offset, offset + nbytes)`` of arena ``arena``, packed from ``pieces``."""

    index: int
    arena: int
    offset: int
    nbytes: int
    pieces: tuple[Piece, ...]


def make_buckets(manifest: Manifest, bucket_bytes: int) -> list[Bucket]:
    """Cut every arena into byte ranges of at most ``bucket_bytes``, at entry boundaries where possible."""
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes must be >= {ALIGN}, got {bucket_bytes}")
    out: list[Bucket] = []
    by_arena: dict[int, list[Entry]] = {}
    for e in manifest.entries:
        by_arena.setdefault(e.arena, []).append(e)
    for arena in range(len(manifest.arenas)):
        start = end = 0
        pieces: list[Piece] = []
        for e in by_arena.get(arena, []):
            if e.nbytes == 0:
                continue
            if pieces and e.offset + e.nbytes - start > bucket_bytes:
                out.append(Bucket(len(out), arena, start, end - start, tuple(pieces)))
                pieces = []
            pos = 0
            while pos < e.nbytes:  # an entry larger than a bucket is split across several
                if not pieces:
                    start = e.offset + pos
                take = min(e.nbytes - pos, bucket_bytes - (e.offset + pos - start))
                pieces.append(Piece(e, pos, pos + take))
                pos += take
                end = e.offset + pos
                if pos < e.nbytes:
                    out.append(Bucket(len(out), arena, start, end - start, tuple(pieces)))
                    pieces = []
        if pieces:
            out.append(Bucket(len(out), arena, start, end - start, tuple(pieces)))
    return out


def plan_hash(manifest: Manifest, buckets: list[Bucket]) -> str:
    """A digest of the ordered entries, arenas and bucket layout (both sides compute it)."""
    h = hashlib.sha256()
    h.update(_enc.encode((manifest.format, manifest.entries, manifest.arenas)))
    h.update(_enc.encode([(b.arena, b.offset, b.nbytes) for b in buckets]))
    return h.hexdigest()[:32]


NameMap = Mapping[str, str] | Callable[[str], "str | None"]


def check_sources(
    tensors: Mapping[str, torch.Tensor], manifest: Manifest, *, dtype: torch.dtype | str | None,
    name_map: NameMap | None, subscriber: str,
) -> dict[str, torch.Tensor]:
    """Map the trainer's tensors onto the subscriber's entries; raise listing every difference.

    Returns generator name -> trainer tensor. Names the ``name_map`` maps to
    None are dropped. Differences: a generator entry the trainer lacks, a
    trainer tensor the generator lacks, a shape mismatch, a dtype that does
    not match the generator's after the cast (:func:`sent_dtype`).
    """
    mapped: dict[str, torch.Tensor] = {}
    problems: list[str] = []
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            problems.append(f"{name!r} is a {type(t).__name__}, not a tensor")
            continue
        gen = _map_name(name_map, name)
        if gen is None:
            continue
        if gen in mapped:
            problems.append(f"two trainer tensors map to {gen!r}")
            continue
        mapped[gen] = t
    want = {e.name: e for e in manifest.entries}
    for gen in mapped.keys() - want.keys():
        problems.append(f"{gen!r}: the trainer has it, subscriber {subscriber!r} does not")
    for e in manifest.entries:
        src = mapped.get(e.name)
        if src is None:
            problems.append(f"{e.name!r}: subscriber {subscriber!r} expects it, the trainer does not send it")
            continue
        t = src
        if tuple(t.shape) != tuple(e.shape):
            problems.append(f"{e.name!r}: shape {tuple(e.shape)} on {subscriber!r}, {tuple(t.shape)} on the trainer")
        sent = sent_dtype(t.dtype, e.dtype, dtype)
        if dtype_name(sent) != e.dtype:
            how = dtype_name(sent) if sent == t.dtype else f"{dtype_name(t.dtype)} cast to {dtype_name(sent)}"
            problems.append(f"{e.name!r}: dtype {e.dtype} on {subscriber!r}, the trainer sends {how}"
                            + ("" if dtype is not None else " (pass dtype= to cast)"))
    if problems:
        raise PlanMismatchError(sorted(problems), subscriber=subscriber)
    return mapped


@dataclass(slots=True)
class _Checked:
    """What :class:`SourceMemo` keeps of one layout's passed check: what the check read, and its answer."""

    dtype: torch.dtype | str | None  # the publisher's dtype=
    name_map: NameMap | None  # (compared by identity)
    contents: dict[str, str] | None  # a mapping name map's contents (else None)
    names: tuple[str, ...]  # the trainer's tensor names, in order
    shapes: list[torch.Size]  # their shapes and dtypes, in that order
    dtypes: list[torch.dtype]
    gens: dict[str, str]  # generator name -> trainer name


class SourceMemo:
    """:func:`check_sources`'s answer per layout, kept while the trainer's tensors come with the
    same names, shapes and dtypes (all that the check reads of them) and the same ``dtype`` and
    name map (the same object; a mapping also with the same contents): a push of a model's own
    tensors then maps them with one pass over their shapes and dtypes. It keeps no tensor. A
    callable name map is called again only when the names, shapes or dtypes change: it must give
    the same answer for the same name.
    """

    def __init__(self) -> None:
        self._memo: dict[str, _Checked] = {}  # layout digest -> its check

    def sources(self, digest: str, tensors: Mapping[str, torch.Tensor], manifest: Manifest, *,
                dtype: torch.dtype | str | None, name_map: NameMap | None,
                subscriber: str) -> dict[str, torch.Tensor]:
        """Generator name -> trainer tensor for the layout ``digest`` (see :func:`check_sources`,
        whose :class:`PlanMismatchError` it raises)."""
        names = tuple(tensors)
        ts = tensors.values()
        have = self._memo.get(digest)
        if (have is not None and have.dtype == dtype and have.name_map is name_map
                and (not isinstance(name_map, Mapping) or have.contents == name_map) and have.names == names
                and [t.shape for t in ts] == have.shapes and [t.dtype for t in ts] == have.dtypes):
            return {gen: tensors[name] for gen, name in have.gens.items()}
        mapped = check_sources(tensors, manifest, dtype=dtype, name_map=name_map, subscriber=subscriber)
        gens = ((_map_name(name_map, name), name) for name in tensors)
        contents = dict(name_map) if isinstance(name_map, Mapping) else None
        self._memo[digest] = _Checked(dtype, name_map, contents, names, [t.shape for t in ts], [t.dtype for t in ts],
                                      {gen: name for gen, name in gens if gen is not None})
        return mapped

    def forget(self, keep: set[str]) -> None:
        """Drop the answers of layouts not in ``keep``."""
        for digest in self._memo.keys() - keep:
            del self._memo[digest]


def sent_dtype(trainer: torch.dtype, subscriber: str, dtype: torch.dtype | str | None) -> torch.dtype:
    """The dtype a trainer tensor travels in: only floating-point tensors are cast.

    ``dtype=None`` sends every tensor as it is; a ``torch.dtype`` casts floating-point
    tensors to it; ``"auto"`` casts each floating-point tensor to the subscriber's
    (floating-point) dtype for it. Integer and bool tensors always go as they are.
    """
    if dtype is None or not trainer.is_floating_point:
        return trainer
    if dtype == "auto":
        want = dtype_from_name(subscriber)
        return want if want.is_floating_point else trainer
    assert isinstance(dtype, torch.dtype)
    return dtype


def _map_name(name_map: NameMap | None, name: str) -> str | None:
    if name_map is None:
        return name
    if callable(name_map):
        return name_map(name)
    return name_map.get(name, name)


def host_key() -> str:
    """Which host this process runs on (hostname and kernel boot id): a manifest's ``host``."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def pull_where(b: Bucket, dest: torch.Tensor, msg: Pull) -> dict[str, Any]:
    """What a Pull reads into ``dest`` (bucket ``b``'s bytes in the subscriber's arena): one range
    of the source's buffer, or, served live, each piece from the source's tensor of its entry."""
    if not msg.live:
        return {msg.buffer: transport.At(dest, msg.offset)}
    if len(msg.live) != len(b.pieces) or len(set(msg.live)) != len(msg.live):
        raise ValueError(f"the pull names {len(msg.live)} live buffers for the {len(b.pieces)} pieces of "
                         f"bucket {b.index}")
    where: dict[str, Any] = {}
    for name, p in zip(msg.live, b.pieces, strict=True):
        view = p.entry.view_in(dest, p.start, p.stop, origin=b.offset, flat=True)
        where[name] = transport.At(view, p.start // view.element_size())
    return where
