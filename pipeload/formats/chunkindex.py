"""The chunk table of a format-2 checkpoint: columnar int64 arrays in one safetensors file.

Format 1 lists every chunk in ``.metadata`` JSON: a checkpoint saved by 4,096 FSDP ranks has 1.9 M
chunks, 326 MB that every rank parsed (10 s) and matched its boxes against one by one. Format 2 keeps
tensor-level facts (names, dtypes, files, objects) in a small ``.metadata`` and the chunk table in
``index-<save id>.safetensors`` (docs/FORMAT.md), which every rank maps and reads only where it looks:

- ``shape`` (T x K), ``chunk_start`` (T + 1, CSR row pointers), ``max_rows`` (T: the longest first
  dimension of any chunk of the tensor), ``chunk_offsets`` / ``chunk_lengths`` (C x K), ``chunk_file``
  (C, index into the JSON file list), ``chunk_checksum`` (C, xxh3-64 as uint64). K is the largest
  tensor rank; shorter shapes are zero-padded. A tensor's chunks are sorted by offsets.

:meth:`ChunkIndex.overlapping` finds the chunks a box needs by binary search on the first dimension
(chunks starting at or after the box's end, or ending before it, are never touched), then checks the few
candidates vectorised. What a rank uses is validated when it is used: each candidate lies inside the
shape and names a listed file, and the chunks found cover the box exactly (no gap, no overlap). The
whole table's tiling is checked by ``pipeload verify`` and, for each tensor, by :meth:`tensor`.
"""

from __future__ import annotations

from typing import Iterator, Mapping


import numpy as np

from ..io.storage import open_safetensors
from ..errors import CheckpointFormatError
from .chunks import ChunkMeta, TensorMeta, _any_overlap, chunk_key, tiling_problem

INLINE_INDEX = 8 << 20  # index files up to this size travel with .metadata from rank 0
SMALL_TABLE = 1 << 18  # chunk tables up to this many rows are converted to Python lists once per load

ARRAYS = {  # name -> (safetensors dtype, numpy dtype)
    "shape": ("I64", np.int64),
    "chunk_start": ("I64", np.int64),
    "max_rows": ("I64", np.int64),
    "chunk_offsets": ("I64", np.int64),
    "chunk_lengths": ("I64", np.int64),
    "chunk_file": ("I32", np.int32),
    "chunk_checksum": ("U64", np.uint64),
}


def index_file_name(save_id: str) -> str:
    return f"index-{save_id}.safetensors"


def build_arrays(names: list[str], tensors: Mapping, files: list[str]) -> dict[str, np.ndarray]:
    """The index arrays of ``tensors`` (fqn -> TensorMeta) in ``names`` order; chunk files by ``files``."""
    width = max((len(tensors[n].shape) for n in names), default=0)
    file_ix = {f: i for i, f in enumerate(files)}
    shape = np.zeros((len(names), width), dtype=np.int64)
    start = np.zeros(len(names) + 1, dtype=np.int64)
    max_rows = np.zeros(len(names), dtype=np.int64)
    offs, lens, fls, sums = [], [], [], []
    for i, n in enumerate(names):
        t = tensors[n]
        shape[i, : len(t.shape)] = t.shape
        chunks = sorted(t.chunks, key=lambda c: c.offsets)
        start[i + 1] = start[i] + len(chunks)
        for c in chunks:
            offs.append(list(c.offsets) + [0] * (width - len(c.offsets)))
            lens.append(list(c.lengths) + [0] * (width - len(c.lengths)))
            fls.append(file_ix[c.file])
            sums.append(int(c.checksum, 16))
        max_rows[i] = max((c.lengths[0] for c in chunks if c.lengths), default=0)
    return {
        "shape": shape,
        "chunk_start": start,
        "max_rows": max_rows,
        "chunk_offsets": np.asarray(offs, dtype=np.int64).reshape(len(offs), width),
        "chunk_lengths": np.asarray(lens, dtype=np.int64).reshape(len(lens), width),
        "chunk_file": np.asarray(fls, dtype=np.int32),
        "chunk_checksum": np.asarray(sums, dtype=np.uint64),
    }


class ChunkIndex:
    """A mapped index file; arrays are zero-copy views of the mapping."""

    def __init__(self, path: str, n_tensors: int, n_files: int, data: bytes | None = None,
                 arrays: dict[str, np.ndarray] | None = None, checksums: bool = True):
        """``arrays``: the arrays themselves (a foreign layout's table, :mod:`pipeload.formats.table`);
        ``checksums=False``: the layout records none (``chunk_checksum`` is ignored, chunks carry "")."""
        self.path = path
        self._file = None
        self.checksums = checksums
        a = {}
        if arrays is not None:
            for name, (_, np_dtype) in ARRAYS.items():
                arr = arrays.get(name)
                if name == "chunk_checksum" and arr is None and not checksums:
                    arr = np.broadcast_to(np.uint64(0), arrays["chunk_file"].shape)
                if arr is None or arr.dtype != np_dtype:
                    raise CheckpointFormatError(f"{path}: chunk table has no {np.dtype(np_dtype)} array {name!r}")
                a[name] = arr
        elif data is not None:  # the whole file, read once by rank 0 and sent with .metadata
            try:
                from safetensors.numpy import load

                loaded = load(data)
            except Exception as e:  # noqa: BLE001 - safetensors' own validation of the bytes
                raise CheckpointFormatError(f"{path}: the chunk index is not valid safetensors ({e})") from None
            for name, (_, np_dtype) in ARRAYS.items():
                arr = loaded.get(name)
                if arr is None:
                    raise CheckpointFormatError(f"{path}: chunk index has no array {name!r}")
                if arr.dtype != np_dtype:
                    raise CheckpointFormatError(f"{path}: chunk index array {name!r} is {arr.dtype}, expected "
                                                f"{np.dtype(np_dtype)}")
                a[name] = arr
        else:
            try:
                self._file = open_safetensors(path)
            except FileNotFoundError:
                raise CheckpointFormatError(f"{path}: the chunk index of this checkpoint is missing") from None
            except OSError as e:
                raise CheckpointFormatError(f"{path}: cannot read the chunk index ({e.strerror or e})") from None
            for name, (st_dtype, np_dtype) in ARRAYS.items():
                try:
                    dtype, shape, _, _ = self._file.entry(name)
                except KeyError:
                    raise CheckpointFormatError(f"{path}: chunk index has no array {name!r}") from None
                if dtype != st_dtype:
                    raise CheckpointFormatError(f"{path}: chunk index array {name!r} is {dtype}, expected {st_dtype}")
                a[name] = np.frombuffer(self._file.buffer(name), dtype=np_dtype).reshape(shape)
        t = n_tensors
        width = a["shape"].shape[1] if a["shape"].ndim == 2 else -1
        c = int(a["chunk_start"][-1]) if a["chunk_start"].shape == (t + 1,) else -1
        if (a["shape"].shape != (t, width) or a["chunk_start"].shape != (t + 1,) or a["max_rows"].shape != (t,)
                or c < 0 or a["chunk_offsets"].shape != (c, width) or a["chunk_lengths"].shape != (c, width)
                or a["chunk_file"].shape != (c,) or a["chunk_checksum"].shape != (c,)):
            raise CheckpointFormatError(f"{path}: chunk index arrays do not match {t} tensors")
        if a["chunk_start"][0] != 0 or np.any(np.diff(a["chunk_start"]) < 0) or np.any(a["shape"] < 0):
            raise CheckpointFormatError(f"{path}: chunk index row pointers or shapes are invalid")
        self.a = a
        self.width = width
        self.n_files = n_files
        self._starts: list[int] | None = None  # chunk_start / max_rows as lists, once a box is looked up
        self._max_rows: list[int] = []
        self._shapes: list | None = None
        self._lists: tuple | None = None
        self._whole: list[int] | None = None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()

    def _rows(self, i: int) -> tuple[int, int]:
        return int(self.a["chunk_start"][i]), int(self.a["chunk_start"][i + 1])

    def _check(self, i: int, fqn: str, lo: int, hi: int, ndim: int) -> None:
        """Candidates ``[lo, hi)`` of tensor ``i`` lie inside its shape and name listed files."""
        if hi <= lo:
            return
        off = self.a["chunk_offsets"][lo:hi, :ndim]
        ln = self.a["chunk_lengths"][lo:hi, :ndim]
        shape = self.a["shape"][i, :ndim]
        fl = self.a["chunk_file"][lo:hi]
        if (np.any(off < 0) or np.any(ln < 0) or np.any(off + ln > shape) or np.any(fl < 0)
                or np.any(fl >= self.n_files) or np.any(self.a["chunk_offsets"][lo:hi, ndim:])
                or np.any(self.a["chunk_lengths"][lo:hi, ndim:])):
            raise CheckpointFormatError(f"{self.path}: tensor {fqn!r}: a chunk lies outside the shape or names "
                                        f"no listed file")

    def shape(self, i: int, ndim: int) -> tuple[int, ...]:
        if self._shapes is None:
            self._shapes = self.a["shape"].tolist()  # T x K small ints: one C conversion per load
        return tuple(self._shapes[i][:ndim])

    def _columns(self) -> tuple[list, list, list] | None:
        """Offsets, lengths and files of every chunk as Python lists, when the table is small enough that
        converting it once costs less than looking up each box with numpy (None otherwise)."""
        if self._lists is None:
            if len(self.a["chunk_file"]) > SMALL_TABLE:
                self._lists = ()
            else:
                self._lists = (self.a["chunk_offsets"].tolist(), self.a["chunk_lengths"].tolist(),
                               self.a["chunk_file"].tolist())
        return self._lists or None

    def chunks(self, i: int, fqn: str, ndim: int, files: list[str], lo: int | None = None,
               hi: int | None = None, rows: np.ndarray | None = None) -> list:
        """ChunkMeta of tensor ``i``'s chunks (all, rows ``[lo, hi)``, or the rows listed)."""
        if rows is None:
            a, b = self._rows(i)
            rows = np.arange(a if lo is None else lo, b if hi is None else hi)
        shape = self.shape(i, ndim)
        out = []
        rows = np.asarray(rows, dtype=np.int64)
        offs = self.a["chunk_offsets"][rows, :ndim].tolist()
        lens = self.a["chunk_lengths"][rows, :ndim].tolist()
        fls = self.a["chunk_file"][rows].tolist()
        sums = self.a["chunk_checksum"][rows].tolist()
        for o, n, f, s in zip(offs, lens, fls, sums):
            o, n = tuple(o), tuple(n)
            key = chunk_key(fqn, o, n == shape)
            out.append(ChunkMeta(o, n, files[f], key, f"{s:016x}" if self.checksums else ""))
        return out

    def exact(self, tensors: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Per box (tensor row, offsets and lengths zero-padded to :attr:`width`), the row of the chunk that
        is exactly that box and names a listed file, or -1: loaded as saved, every box is one chunk.

        One vectorised binary search over all boxes at once (a tensor's chunks are sorted by offsets);
        a table that is not sorted, or a box no single chunk matches, gives -1 and is resolved box by box
        by :meth:`overlapping`, which validates what it finds.
        """
        n = len(tensors)
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        start = self.a["chunk_start"]
        table = self.a["chunk_offsets"]
        lo, hi = start[tensors].copy(), start[tensors + 1].copy()
        end = hi.copy()
        rows = np.arange(n)
        steps = int(np.max(hi - lo)).bit_length() if self.width else 0  # all scalars: nothing to order
        for _ in range(steps):  # the lower bound of each box's offsets among its tensor's chunks
            active = lo < hi
            if not active.any():
                break
            mid = (lo + hi) >> 1
            at = table[np.where(active, mid, 0)]
            differ = at != offsets
            first = differ.argmax(axis=1)
            less = differ[rows, first] & (at[rows, first] < offsets[rows, first])
            lo = np.where(active & less, mid + 1, lo)
            hi = np.where(active & ~less, mid, hi)
        found = lo < end
        r = np.where(found, lo, 0)
        files = self.a["chunk_file"][r]
        found &= ((table[r] == offsets).all(axis=1) & (self.a["chunk_lengths"][r] == lengths).all(axis=1)
                  & (files >= 0) & (files < self.n_files))
        return np.where(found, lo, -1)

    def whole_rows(self) -> list[int]:
        """Per tensor, the row of its one chunk when that chunk is the whole tensor and names a listed file
        (whole-tensor layouts: Hugging Face files, anything saved unsharded), else -1: one vectorised
        check of the table instead of one per box (offsets, lengths and shape are zero-padded alike)."""
        if self._whole is None:
            a = self.a
            start = a["chunk_start"]
            ok = np.diff(start) == 1
            rows = np.where(ok, start[:-1], 0)
            if len(a["chunk_file"]):
                f = a["chunk_file"][rows]
                ok &= ((a["chunk_offsets"][rows] == 0).all(axis=1) & (a["chunk_lengths"][rows] == a["shape"]).all(axis=1)
                       & (f >= 0) & (f < self.n_files))
            self._whole = np.where(ok, rows, -1).tolist()
            self._whole_file = a["chunk_file"][rows].tolist() if len(a["chunk_file"]) else []
            self._whole_sum = a["chunk_checksum"][rows].tolist() if len(a["chunk_file"]) else []
        return self._whole

    def overlapping(self, i: int, fqn: str, ndim: int, files: list[str], offsets, lengths) -> list:
        """The chunks of tensor ``i`` that overlap the box; they must cover it exactly."""
        if ndim and self.whole_rows()[i] >= 0:  # one whole chunk: it covers any non-empty box inside the shape
            shape = self.shape(i, ndim)
            if all(n > 0 and 0 <= o and o + n <= d for o, n, d in zip(offsets, lengths, shape)):
                return [ChunkMeta((0,) * ndim, shape, files[self._whole_file[i]], chunk_key(fqn, (0,) * ndim, True),
                                  f"{self._whole_sum[i]:016x}" if self.checksums else "")]
        if self._starts is None:
            self._starts = self.a["chunk_start"].tolist()
            self._max_rows = self.a["max_rows"].tolist()
        a, b = self._starts[i], self._starts[i + 1]
        if ndim == 0 or a == b:
            self._check(i, fqn, a, b, ndim)
            return self.chunks(i, fqn, ndim, files, a, b)
        cols = self._columns()
        if cols is not None and b - a <= 8:  # few chunks: plain Python over the converted table
            lo, hi = a, b
            off, ln, fl = (c[a:b] for c in cols)
            return self._match(i, fqn, ndim, files, offsets, lengths, lo, hi, off, ln, fl)
        o0 = self.a["chunk_offsets"][a:b, 0]
        if b - a > 1:
            lo = a + int(np.searchsorted(o0, offsets[0] - self._max_rows[i], side="right"))
            hi = a + int(np.searchsorted(o0, offsets[0] + lengths[0], side="left"))
        else:
            lo, hi = a, b
        if hi - lo > 64:
            self._check(i, fqn, lo, hi, ndim)
        off = self.a["chunk_offsets"][lo:hi].tolist()
        ln = self.a["chunk_lengths"][lo:hi].tolist()
        fl = self.a["chunk_file"][lo:hi].tolist()
        return self._match(i, fqn, ndim, files, offsets, lengths, lo, hi, off, ln, fl)

    def _match(self, i, fqn, ndim, files, offsets, lengths, lo, hi, off, ln, fl) -> list:
        """The candidates ``[lo, hi)`` (as lists) that overlap the box, checked to cover it exactly."""
        shape = self.shape(i, ndim)
        nfiles = self.n_files
        hits, vol = [], 0
        for k, (o, n) in enumerate(zip(off, ln)):
            if hi - lo <= 64 and (any(o[ndim:]) or any(n[ndim:]) or not 0 <= fl[k] < nfiles
                                  or any(x < 0 or y < 0 or x + y > s for x, y, s in zip(o, n, shape))):
                raise CheckpointFormatError(f"{self.path}: tensor {fqn!r}: a chunk lies outside the shape or "
                                            f"names no listed file")
            v = 1
            for oo, nn, bo, bn in zip(o, n, offsets, lengths):
                top = min(oo + nn, bo + bn)
                bot = max(oo, bo)
                if top <= bot:
                    v = 0
                    break
                v *= top - bot
            if v:
                hits.append(k)
                vol += v
        want = 1
        for x in lengths:
            want *= x
        if vol != want or any(ln[h][0] > self._max_rows[i] for h in hits):
            raise CheckpointFormatError(
                f"{self.path}: tensor {fqn!r}: the chunks do not cover the box at {list(offsets)} of size "
                f"{list(lengths)} exactly (gap or overlap)"
            )
        sums = self.a["chunk_checksum"][lo:hi]
        found = []
        for h in hits:
            o, n = tuple(off[h][:ndim]), tuple(ln[h][:ndim])
            key = chunk_key(fqn, o, n == shape)
            found.append(ChunkMeta(o, n, files[fl[h]], key, f"{int(sums[h]):016x}" if self.checksums else ""))
        if len(found) > 1 and _any_overlap([(c.offsets, c.lengths) for c in found]):
            raise CheckpointFormatError(f"{self.path}: tensor {fqn!r}: chunks overlap")
        return found


class IndexedTensors(Mapping):
    """``Metadata.tensors`` of a format-2 checkpoint: TensorMeta decoded per key on access."""

    def __init__(self, index: ChunkIndex, names: list[str], dtypes: list[str], ndims: list[int],
                 files: list[str]):
        self.index, self.names, self.dtypes, self.files = index, names, dtypes, files
        self.pos = dict(zip(names, range(len(names))))
        self.ndim = np.asarray(ndims, dtype=np.int64)
        self.ndims = self.ndim.tolist()  # the same as Python ints: looked up once per tensor leaf
        if len(self.ndim) != len(names) or np.any(self.ndim < 0) or np.any(self.ndim > index.width):
            raise CheckpointFormatError(f"{index.path}: tensor ranks do not match the chunk index")

    def __getitem__(self, fqn: str):
        i = self.pos[fqn]
        nd = self.ndims[i]
        shape = self.index.shape(i, nd)
        a, b = self.index._rows(i)
        self.index._check(i, fqn, a, b, nd)
        chunks = tuple(self.index.chunks(i, fqn, nd, self.files, a, b))
        problem = tiling_problem(shape, [(c.offsets, c.lengths) for c in chunks])
        if problem:
            raise CheckpointFormatError(f"{self.index.path}: tensor {fqn!r}: {problem}")
        return TensorMeta(self.dtypes[i], shape, chunks)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, fqn: object) -> bool:
        return fqn in self.pos


def open_index(path: str, names: list[str], dtypes: list[str], ndims: list[int],
               files: list[str], data: bytes | None = None) -> IndexedTensors:
    """The tensors of a format-2 checkpoint whose index file is ``path`` (resolved inside the checkpoint;
    ``data``: its bytes, already read, as :func:`pipeload.formats.native.read_small_index` gives them)."""
    idx = ChunkIndex(path, len(names), len(files), data)
    return IndexedTensors(idx, names, dtypes, ndims, files)
