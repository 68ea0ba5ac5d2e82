"""Typing stub of the compiled reader ``pipeload._fastio`` (source: _fastio.pyx; rules: docs/READER.md).

Torch-free: it hands out bytes as buffers. ``torch.frombuffer(f.buffer(name), dtype=torch.uint8)`` is a
zero-copy tensor that stays valid after ``f.close()`` and after the file is evicted from a FileCache.
"""

import os
from types import TracebackType
from typing import Callable, Iterable, Iterator, Literal

#: safetensors dtype name -> bytes per element, for every dtype whose element is whole bytes.
#: The sub-byte dtypes (F4, F6_E2M3, F6_E3M2) are absent: see DTYPE_BITS.
DTYPE_SIZES: dict[str, int]
#: safetensors dtype name -> bits per element, for all 22 names safetensors 0.8 accepts.
#: A tensor's byte length is numel * bits / 8, which must be a whole number.
DTYPE_BITS: dict[str, int]

Advice = Literal["normal", "sequential", "random", "willneed", "dontneed"]

class SafetensorsFile:
    """One open safetensors file: validated header, name index, zero-copy views of its bytes.

    Opening does open(O_RDONLY|O_CLOEXEC), fstat, one mmap of the whole file (MAP_PRIVATE,
    PROT_READ|PROT_WRITE, MAP_NORESERVE: copy-on-write, so views are writable and writes never reach
    the file), then validates the header exactly as safetensors does and builds the name index once.

    Raises:
        FileNotFoundError, IsADirectoryError, PermissionError: from open, unchanged (they name the path).
        pipeload.errors.HeaderError: the file is not valid safetensors ("<path>: <problem>", naming the
            tensor where there is one); also for an empty or non-regular file.
        pipeload.errors.ReadError: the file cannot be mapped.
    """

    path: str
    """The path as given (str; os.fspath of a PathLike)."""
    size: int
    """File size in bytes at open."""
    data_offset: int
    """8 + header length: absolute offset of the data section."""
    metadata: dict[str, str] | None
    """The header's ``__metadata__`` map; None when absent or null."""
    closed: bool

    def __init__(self, path: str | os.PathLike[str]) -> None: ...
    def __len__(self) -> int: ...
    def __contains__(self, name: object) -> bool: ...
    def __iter__(self) -> Iterator[str]: ...
    def keys(self) -> list[str]:
        """Tensor names in data-offset order (a new list each call)."""
    def entry(self, name: str) -> tuple[str, tuple[int, ...], int, int]:
        """(dtype, shape, start, end); start/end are ABSOLUTE file offsets of the tensor's bytes.

        Works after close(). Raises TensorNotFoundError("<path>: no tensor named '<name>'")."""
    def buffer(self, name: str) -> memoryview:
        """The tensor's bytes: 1-D, format "B", writable (copy-on-write), zero-copy over the mapping.

        Zero-size tensors give an empty view (torch.frombuffer refuses those: use torch.empty).
        Raises TensorNotFoundError for an unknown name, ValueError once closed."""
    def span(self, start: int, end: int) -> memoryview:
        """Raw bytes [start, end) of the file (absolute offsets), with buffer()'s properties.

        Raises ValueError if start < 0 or end < start or the file is closed, ReadError if end is
        past the end of the file."""
    def check_unchanged(self) -> None:
        """fstat the open descriptor; ReadError naming the path if the size, inode, device or
        mtime_ns differ from open time (a file now shorter than the mapping would SIGBUS a reader).

        A file replaced by rename is not a change: the open inode, and every view, keep the old
        bytes. Raises ValueError once closed."""
    def advise(self, advice: Advice, start: int = 0, end: int | None = None) -> None:
        """madvise(2) over [start, end) (widened to whole pages; end defaults to the file size).

        "dontneed" also discards bytes written through views of that range.
        Raises ValueError for an unknown advice, a bad range or a closed file; OSError if madvise
        fails."""
    def copy_box(self, name: str, dtype: str, chunk_shape: tuple[int, ...], src_offsets: tuple[int, ...],
                 lengths: tuple[int, ...], dst: int, dst_offsets: tuple[int, ...], dst_strides: tuple[int, ...],
                 dst_shape: tuple[int, ...], willneed: bool = False) -> int:
        """Copy the box (src_offsets, lengths) of tensor ``name`` to address ``dst`` (element 0 of a host
        tensor of ``dst_shape`` / ``dst_strides`` in elements), at ``dst_offsets`` there; returns bytes copied.

        One call, no views: the reader's fast path. A contiguous box of at least 16 KiB is pread()
        into the destination (a file cut meanwhile: ReadError "file ended while tensor ... was read");
        others are copied from the mapping. Checks first, copying nothing on failure: the stored
        dtype and shape are ``dtype`` / ``chunk_shape`` (CheckpointFormatError naming file and tensor),
        both boxes fit their tensors (ValueError). The copy runs without the GIL under the SIGBUS guard
        (ReadError "bus error while copying tensor ..."; the box then holds partial bytes).
        ``willneed``: madvise(WILLNEED) the box's byte span first. Raises ValueError once closed."""
    def willneed_tensors(self, names: Iterable[str], merge_gap: int = 1 << 20) -> int:
        """madvise(WILLNEED) the bytes of the named tensors, sorted, ranges closer than ``merge_gap`` merged,
        in 1 MiB pieces without the GIL; returns the bytes requested. TensorNotFoundError for an unknown
        name (before anything is requested); ValueError once closed."""
    def close(self) -> None:
        """Idempotent. Closes the descriptor and drops this object's reference to the mapping: the
        mapping is unmapped when the last view handed out is released, never before."""
    def __enter__(self) -> SafetensorsFile: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]: ...

class RawFile:
    """One open file of any layout (e.g. a torch.distributed.checkpoint ``.distcp``), mapped whole.

    Mapped like SafetensorsFile (copy-on-write, MAP_NORESERVE, readahead off) with no header to
    validate: ``view()`` hands out zero-copy byte ranges that outlive ``close()`` and LRU eviction.

    Raises:
        FileNotFoundError, IsADirectoryError, PermissionError: from open, unchanged.
        pipeload.errors.ReadError: not a regular file, or it cannot be mapped.
    """

    path: str
    size: int
    closed: bool

    def __init__(self, path: str | os.PathLike[str]) -> None: ...
    def view(self, offset: int, length: int) -> memoryview:
        """Bytes [offset, offset + length): 1-D, format "B", writable (copy-on-write), zero-copy.

        Raises ValueError for a negative offset/length or a closed file; ReadError past the end."""
    def check_unchanged(self) -> None:
        """As SafetensorsFile.check_unchanged()."""
    def copy_box(self, name: str, start: int, itemsize: int, chunk_shape: tuple[int, ...],
                 src_offsets: tuple[int, ...], lengths: tuple[int, ...], dst: int, dst_offsets: tuple[int, ...],
                 dst_strides: tuple[int, ...], dst_shape: tuple[int, ...], willneed: bool = False) -> int:
        """SafetensorsFile.copy_box for a C-contiguous chunk of ``chunk_shape`` x ``itemsize`` bytes stored at
        byte ``start`` (``name`` only names it in errors). ReadError if it runs past the end of the file."""
    def willneed(self, start: int, end: int) -> None:
        """Hint: MADV_WILLNEED over [start, end) clipped to the file, in 1 MiB pieces; never raises."""
    def close(self) -> None:
        """Idempotent; views handed out stay valid."""
    def __enter__(self) -> RawFile: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]: ...

class FileCache:
    """LRU of open SafetensorsFile objects keyed by the path string as given (one cache per load).

    A hit costs a dict lookup and a move to the front, no system call (~0.2 µs). A miss opens the
    file and, past `capacity`, evicts and closes the least recently used one; views already handed
    out of an evicted file stay valid. A cached file its user closed is reopened on the next get().
    Different spellings of one path are different entries.
    """

    capacity: int
    opens: int
    """Cold opens performed."""
    hits: int

    def __init__(self, capacity: int = 8, opener: Callable[[str], object] | None = None) -> None:
        """Raises ValueError if capacity < 1. ``opener(path)`` makes each cached object (default
        SafetensorsFile); it must have ``closed`` and ``close()``."""
    def get(self, path: str | os.PathLike[str]) -> SafetensorsFile:
        """The open file for `path`; raises what SafetensorsFile() raises on a miss."""
    def __len__(self) -> int: ...
    def __contains__(self, path: str | os.PathLike[str]) -> bool: ...
    def close(self) -> None:
        """Close every cached file (views handed out stay valid); the cache stays usable."""
    def __enter__(self) -> FileCache: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]: ...

def read_header(path: str | os.PathLike[str]) -> dict[str, object]:
    """{name: (dtype, shape, start, end)} in file order, plus "__metadata__": dict or None.

    start/end are absolute file offsets; the file is validated like SafetensorsFile()."""

def _set_force_readonly(value: bool) -> None:
    """Testing only: make later opens take the read-only mapping fallback."""

def guarded_copy(
    dst: int,
    dst_strides: tuple[int, ...],
    src: int,
    src_strides: tuple[int, ...],
    shape: tuple[int, ...],
    itemsize: int,
    source: str,
) -> None:
    """Copy a strided box (strides in bytes) from address ``src`` to ``dst`` without the GIL, with a
    per-thread SIGBUS guard: a fault on a mapped page raises ReadError("<source>: bus error ...")
    instead of killing the process. Internal primitive of pipeload.reader; addresses are not checked.
    """
