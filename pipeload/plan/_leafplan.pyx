# cython: language_level=3, boundscheck=False, wraparound=False
"""The per-leaf loops of planning, compiled: a tensor's box on this rank (:func:`box`, behind
:func:`pipeload.statedict.tensor_box`) and the local plan's pass over the state dict (:func:`resolve`,
behind :func:`pipeload.planner.local_plan`).

A trainer's state dict has a leaf per parameter and optimizer state, thousands to 100k of them, and
every load resolves each one before its first collective: whatever this costs per leaf, every rank
pays it while the others wait. What the loops decide is documented at their Python callers; here they
only do it without an interpreted step per leaf.
"""

from cpython.dict cimport PyDict_Next
from cpython.object cimport PyObject, PyTypeObject, Py_TYPE
from cpython.tuple cimport PyTuple_GET_ITEM

cdef extern from "Python.h":
    int _is_subtype "PyType_IsSubtype"(PyTypeObject* a, PyTypeObject* b)

import numpy as np
import torch

from ..slices import Slice
from .placements import _StridedShard, mesh_box
from .tensorkinds import adopt, problem as kind_problem, refusal

try:  # DTensor moved out of the private namespace in torch 2.4
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # pragma: no cover - older torch
    from torch.distributed._tensor import DTensor, Replicate, Shard  # type: ignore

cdef object _Tensor = torch.Tensor
cdef object _Parameter = torch.nn.Parameter
cdef object _strided = torch.strided
cdef object _Slice = Slice
cdef PyTypeObject* _TensorType = <PyTypeObject*>_Tensor  # (kept alive by _Tensor)


def _local_box(shape, mesh, placements):
    """(lengths, offsets) of this rank's box, or (None, None) outside the mesh."""
    if mesh.get_coordinate() is None:
        return None, None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    lengths, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
    return tuple(int(x) for x in lengths), tuple(int(x) for x in offsets)


cdef tuple _placement_key(tuple placements):
    """What the box depends on in ``placements``, as plain ints (a sharded tensor dim, or None for Replicate),
    so the cache key hashes and compares in C; None when one is neither (the uncached path refuses it)."""
    cdef list out = []
    for p in placements:
        t = type(p)
        if t is Shard:
            out.append(p.dim)
        elif t is Replicate:
            out.append(None)
        elif t is _StridedShard:
            out.append((p.dim, p.split_factor))
        else:
            return None
    return tuple(out)


cpdef local_of(value):
    """A DTensor's local tensor itself (``to_local()`` goes through autograd: ~50 us a call on 3,000
    tensors), a :class:`pipeload.Slice`'s view; any other value as it is."""
    if not isinstance(value, DTensor):
        return value.view if isinstance(value, _Slice) else value
    local = getattr(value, "_local_tensor", None)
    return local if local is not None else value.to_local()


def bind(list specs, list positions, list values, dict objects):
    """A reused save plan's items for this save: ``(key, dtype, shape, value)`` for each spec
    ``(key, dtype, shape, fqn)``, the value being ``objects[fqn]`` (an object's bytes, its shape their
    length) or else the local tensor of ``values[positions[i]]``."""
    cdef Py_ssize_t i, n = len(specs)
    cdef list out = [None] * n
    cdef tuple spec
    for i in range(n):
        spec = <tuple>specs[i]
        data = objects.get(spec[3])
        if data is not None:
            out[i] = (spec[0], spec[1], (len(data),), data)
        else:
            out[i] = (spec[0], spec[1], spec[2], local_of(values[<Py_ssize_t>positions[i]]))
    return out


def box(str fqn, value, dict cache):
    """(global shape, offsets, lengths, local tensor or None) of ``value``: see ``statedict.tensor_box``.

    ``cache`` memoises a DTensor's (lengths, offsets, global shape, mesh) per (shape, mesh, placements);
    its values end with the mesh (``statedict.cached_meshes``).
    """
    cdef tuple shape, hit = None
    if isinstance(value, _Slice):
        return _slice_box(value)
    if not isinstance(value, DTensor):
        shape = tuple(value.shape)
        return shape, (0,) * len(shape), shape, value
    spec = getattr(value, "_spec", None)  # the attributes behind DTensor's properties, read once
    if spec is not None:  # (DTensor.shape goes through Python: 4x the spec's tensor_meta)
        mesh, placements, meta = spec.mesh, spec.placements, spec.tensor_meta
        size = meta.shape if meta is not None else value.shape
    else:
        mesh, placements, size = value.device_mesh, value.placements, value.shape
    if type(placements) is not tuple:
        placements = tuple(placements)
    local = local_of(value)
    kind = _placement_key(placements)
    key = (size, id(mesh), kind)
    if cache is not None and kind is not None:
        hit = cache.get(key)
    if hit is None:
        shape = tuple(size)
        strided = False
        for p in placements:
            if type(p) is _StridedShard:
                strided = True
            elif type(p) is not Shard and type(p) is not Replicate:
                raise ValueError(
                    f"{fqn!r}: DTensor placement {p} cannot be stored; use Shard or Replicate "
                    f"(redistribute Partial placements first)"
                )
        if strided:  # FSDP2 over TP: see pipeload.plan.placements
            try:
                hit = (*mesh_box(shape, mesh, placements), shape, mesh)
            except ValueError as e:
                raise ValueError(f"{fqn!r}: {e}") from None
        else:
            hit = (*_local_box(shape, mesh, placements), shape, mesh)
        if cache is not None:
            cache[key] = hit
    lengths, offsets, shape = hit[0], hit[1], hit[2]
    if lengths is None:  # this rank is outside the mesh
        return shape, (0,) * len(shape), (0,) * len(shape), None
    if local.shape != lengths:  # (torch.Size compares equal to the tuple of its sizes)
        raise ValueError(
            f"{fqn!r}: DTensor local shard has shape {list(local.shape)}, its placements say {list(lengths)}"
        )
    return shape, offsets, lengths, local


cdef tuple _slice_box(value):
    """A Slice's box: the one it states, its view the local tensor. Raises ``ValueError`` naming the slice
    for a view pipeload cannot write through (a DTensor, a meta tensor, a kind :mod:`tensorkinds` refuses)."""
    view = value.view
    if isinstance(view, DTensor):
        raise ValueError(f"{value.label}: its view is a DTensor; a Slice views a plain tensor (a DTensor's "
                         f"local tensor, or an engine's parameter)")
    if not _plain(view):
        why = refusal(view, load=True)
        if why is None and view.device.type == "meta":
            why = "a view on the meta device has no memory to fill; materialise the parameter first"
        if why is not None:
            raise ValueError(f"{value.label}: {why}")
    return value.shape, value.offsets, tuple(view.shape), view


cdef inline tuple _slice_facts(value):
    """What a kept plan depends on in a Slice: its tensor, box and global shape, and its view's facts."""
    view = value.view
    return (_Slice, value.name, value.offsets, value.shape, view.shape, view.dtype, view.device.type, type(view),
            view.layout)


cdef inline bint _plain(t):
    """The common kind of destination (see :mod:`pipeload.plan.tensorkinds`): a plain tensor or parameter,
    dense, on the CPU or a CUDA device. Anything else goes to ``tensorkinds.adopt``."""
    return (type(t) is _Tensor or type(t) is _Parameter) and (t.is_cpu or t.is_cuda) and t.layout is _strided


def resolve(list names, dict leaves, dict key_index, md, box_of, dict cache, Py_ssize_t width, dict dtype_names,
            exact_of, reads_of, make_shard, broadcastable, writer_of):
    """The tensor leaves of ``names`` (sorted fqns of ``leaves``) resolved against ``md``.

    Returns ``(shards, offsets, lengths, problems, unboxed, others, adopted, paths)``: one
    ``make_shard(...)`` per box this rank loads, in ``names`` order, and their boxes as ``n x width`` int64
    arrays (zero-padded); the problems found (dtype, shape, box, a kind of tensor pipeload refuses); the
    tensors whose box was not resolved (their meshes still count); the fqns of every leaf that is not a
    tensor of the checkpoint, for the caller; ``(fqn, tensor)`` for each leaf loaded into a tensor that
    stands in for it (``tensorkinds.adopt``: a meta tensor's materialised copy; only when ``box_of`` is
    None, as the simulation's boxes hold meta tensors on purpose); and, when some leaf is a
    :class:`pipeload.Slice`, the leaf path of each shard (None otherwise: each shard's path is its fqn).

    A Slice leaf loads the tensor it names (the shard's fqn is that name, not its path) into the box it
    states (:func:`_slice_box`); a Slice whose name the checkpoint lacks is one of ``others``.

    ``box_of(fqn, value, cache)`` gives a leaf's box as :func:`box` does (None: :func:`box` itself);
    ``exact_of(rows, offsets, lengths)`` the ``(file, checksum)`` of the stored chunk that is exactly each
    box, or ``(file, checksum, chunk shape)`` of the one whole chunk it lies inside, or None (format 2 only); ``reads_of(fqn, offsets, lengths, itemsize)`` the reads and affinity of
    a box that is not one stored chunk.
    """
    cdef Py_ssize_t n = len(names), j = 0, d, nd, i
    table = md.tensor_columns()
    cdef bint indexed = table is not None
    cdef dict pos = None, metas = None
    cdef list dtypes = None, ndims = None
    cdef const long long[:, :] stored
    if indexed:
        pos, dtypes, ndims, stored = table
    else:
        metas = md.tensors
    offsets_a = np.zeros((n, width), dtype=np.int64)
    lengths_a = np.zeros((n, width), dtype=np.int64)
    rows_a = np.zeros(n, dtype=np.int64)
    cdef long long[:, ::1] off = offsets_a, ln = lengths_a
    cdef long long[::1] rows = rows_a
    cdef list problems = [], unboxed = [], others = [], todo = [], adopted = []
    cdef tuple shape, offsets, lengths, b
    cdef bint mismatch, sliced, any_slice = False
    for fqn in names:
        value = leaves[fqn].value
        sliced = False
        if isinstance(value, _Tensor):
            name = fqn
        elif isinstance(value, _Slice):
            name = value.name
            sliced = any_slice = True
        else:
            others.append(fqn)
            continue
        if indexed:
            p = pos.get(name)
            if p is None:
                if not sliced:
                    unboxed.append(value)
                others.append(fqn)
                continue
            i = p
            want_dtype = dtypes[i]
            nd = ndims[i]
        else:
            m = metas.get(name)
            if m is None:
                if not sliced:
                    unboxed.append(value)
                others.append(fqn)
                continue
            want_dtype, want_shape = m[0], m[1]
        try:
            b = box(fqn, value, cache) if box_of is None or sliced else tuple(box_of(fqn, value, cache))
            shape, offsets, lengths, local = b
            if box_of is None and not sliced and local is not None and not _plain(local):
                local = adopt(fqn, value, local)
                if local is not b[3]:
                    adopted.append((fqn, local))
        except (ValueError, RuntimeError) as e:  # (a nested tensor has no .shape)
            problems.append(str(e) if sliced else kind_problem(fqn, value, e))
            if not sliced:
                unboxed.append(value)
            continue
        dtype = local.dtype if sliced else value.dtype
        have = dtype_names.get(dtype)
        if have is None:
            have = str(dtype)
        if indexed:
            mismatch = len(shape) != nd
            if not mismatch:
                for d in range(nd):
                    if <long long>shape[d] != stored[i, d]:
                        mismatch = True
                        break
            if mismatch:
                want_shape = tuple([stored[i, d] for d in range(nd)])
        else:
            mismatch = shape != want_shape
        if mismatch or have != want_dtype:
            problems.append(
                f"{value.label if sliced else repr(fqn)}: the {'slice' if sliced else 'state dict'} has dtype "
                f"{have} {'global ' if sliced else ''}shape {list(shape)}, the checkpoint {want_dtype} "
                f"{list(want_shape if mismatch else shape)}"
            )
            continue
        if local is None or 0 in lengths:
            continue
        nd = len(shape)
        if len(offsets) != nd or len(lengths) != nd or nd > width:  # (indexed below without bounds checks)
            problems.append(f"{value.label if sliced else repr(fqn)}: a box of {len(offsets)} offsets and "
                            f"{len(lengths)} lengths for a tensor of {nd} dimensions, in a checkpoint of at most {width}")
            continue
        for d in range(nd):
            off[j, d] = offsets[d]
            ln[j, d] = lengths[d]
        if indexed:
            rows[j] = i
        j += 1
        todo.append((name, dtype, offsets, lengths, local, lengths == shape, fqn))
    offsets_a, lengths_a = offsets_a[:j], lengths_a[:j]
    exact = exact_of(rows_a[:j], offsets_a, lengths_a) if indexed and j else None
    cdef list shards = []
    cdef dict writers = {}
    cdef long long numel
    for k in range(j):
        fqn, dtype, offsets, lengths, local, whole, _ = todo[k]
        itemsize = dtype.itemsize
        numel = 1
        for x in lengths:
            numel *= <long long>x
        hit = exact[k] if exact is not None else None
        if hit is not None:
            file = hit[0]
            # its one ReadItem, built when the read runs (DestShard.reads); a box inside the tensor's one
            # whole chunk: (file, checksum, chunk shape)
            reads = (file, hit[1], whole) if len(hit) == 2 else hit
            if writer_of is None:
                affinity = -1
            else:
                affinity = writers.get(file)
                if affinity is None:
                    affinity = writers[file] = writer_of(file)
        else:
            reads, affinity = reads_of(fqn, offsets, lengths, itemsize)
        shards.append(make_shard(fqn, (key_index[fqn], offsets, lengths), dtype, numel * itemsize, reads, local,
                                 broadcastable(local), affinity))
    paths = [t[6] for t in todo] if any_slice else None
    return shards, offsets_a, lengths_a, problems, unboxed, others, adopted, paths


def walk(object state_dict, is_container):
    """The traversal of ``plancache.signature``: ``(nodes, facts, values, homes)``.

    Visits containers as ``statedict.flatten`` does (a stack, children in order; ``is_container`` is its
    rule). Per container: a dict's keys with their types, or a list's length, then the keys of its children
    that are containers. Per leaf in visiting order: its value, and its facts (a DTensor's spec; a plain
    tensor's shape, dtype, device type, class and layout; a Slice's name, box and global shape and its view's
    facts; None for an object, whose ``(container, key)`` goes to ``homes`` under the leaf's position). A tensor is an instance of a subclass of ``torch.Tensor``, tested
    without ``isinstance``'s call to the metaclass's ``__instancecheck__`` (an object that claims the class
    by its ``__class__`` alone is an object here, and so in every kept plan's ``homes``: the plan's objects,
    which ``flatten`` tells by ``isinstance``, are among them).
    """
    cdef list nodes = [], values = [], facts = [], stack = [state_dict], inner
    cdef dict homes = {}
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            keys = tuple(node)
            nodes.append((keys, tuple(map(type, keys))))  # (1 and True are equal keys, named differently)
            items = node.items()
        else:
            nodes.append(len(node))
            items = enumerate(node)
        inner = []  # which children are containers ({"a": {}, "b": 1} and {"a": 1, "b": {}} differ)
        for k, v in items:
            if _is_subtype(Py_TYPE(v), _TensorType):  # (isinstance, without the metaclass's __instancecheck__)
                spec = getattr(v, "_spec", None)
                facts.append(spec if spec is not None else (v.shape, v.dtype, v.device.type, type(v), v.layout))
            elif isinstance(v, _Slice):
                facts.append(_slice_facts(v))
            elif is_container(v):
                stack.append(v)
                inner.append(k)
                continue
            else:
                facts.append(None)
                homes[len(values)] = (node, k)
            values.append(v)
        nodes.append(tuple(inner))
    return nodes, facts, values, homes


cdef class _Match:
    """The state of one :func:`match`: the leaves found so far and the position in ``facts``."""
    cdef list values, stack
    cdef dict homes
    cdef tuple facts
    cdef Py_ssize_t fi, nf
    cdef object is_container

    cdef int item(self, object node, PyObject* k, object v, tuple inner, Py_ssize_t* m) except -2:
        """One child ``v`` under key ``k``: 1 a container (pushed), 0 a leaf as recorded, -1 a difference."""
        if _is_subtype(Py_TYPE(v), _TensorType):
            if self.fi >= self.nf:
                return -1
            f = self.facts[self.fi]
            self.fi += 1
            spec = getattr(v, "_spec", None)
            if spec is not None:
                if spec is not f and not (spec == f):
                    return -1
            elif f is None or not (f == (v.shape, v.dtype, v.device.type, type(v), v.layout)):
                return -1
        elif isinstance(v, _Slice):
            if self.fi >= self.nf:
                return -1
            f = self.facts[self.fi]
            self.fi += 1
            if f is None or not (f == _slice_facts(v)):
                return -1
        elif self.is_container(v):
            if m[0] >= len(inner):
                return -1
            w = PyTuple_GET_ITEM(inner, m[0])
            if k != w and not (<object>k == <object>w):
                return -1
            m[0] += 1
            self.stack.append(v)
            return 1
        else:
            if self.fi >= self.nf or self.facts[self.fi] is not None:
                return -1
            self.fi += 1
            self.homes[len(self.values)] = (node, <object>k)
        self.values.append(v)
        return 0


cdef inline bint _same_key(PyObject* k, tuple keys, tuple types, Py_ssize_t j):
    """Whether ``k`` is the ``j``-th of ``keys`` as :func:`walk`'s tuples compare it: the same object, or
    one of the same type that is equal (1 and True are equal keys, named differently)."""
    cdef PyObject* w = PyTuple_GET_ITEM(keys, j)
    return k == w or (<PyObject*>Py_TYPE(<object>k) == PyTuple_GET_ITEM(types, j) and <object>k == <object>w)


def match(object state_dict, is_container, tuple nodes, tuple facts):
    """``(values, homes)`` as :func:`walk` gives them when its ``nodes`` and ``facts`` would equal
    ``nodes`` and ``facts``, else None.

    A reused load's check: it compares as it walks, with the equality the tuples of :func:`walk` are
    compared with (identity first, then ``==``; a key's type as well), stops at the first difference and
    builds nothing but what it returns. A dict's keys are compared by address first, so the keys of an
    unchanged state dict are not even read (each would be a cache miss on a large one).
    """
    cdef _Match M = _Match()
    M.values, M.stack, M.homes, M.facts, M.fi, M.nf, M.is_container = [], [state_dict], {}, facts, 0, len(facts), is_container
    cdef tuple keys, types, inner
    cdef Py_ssize_t ni = 0, nn = len(nodes), j, m, pos, nkeys
    cdef PyObject *kp
    cdef PyObject *vp
    while M.stack:
        node = M.stack.pop()
        if ni + 1 >= nn:
            return None
        want = nodes[ni]
        inner = <tuple>nodes[ni + 1]
        ni += 2
        m = 0
        if isinstance(node, dict):
            if type(want) is not tuple or len(<tuple>want) != 2:
                return None
            keys, types = <tuple>want[0], <tuple>want[1]
            nkeys = len(keys)
            if len(<dict>node) != nkeys:
                return None
            pos = j = 0
            if type(node) is dict:  # its storage order is its order (not so for an OrderedDict moved)
                while PyDict_Next(node, &pos, &kp, &vp):
                    if j >= nkeys or not _same_key(kp, keys, types, j):  # (keys is indexed unchecked)
                        return None
                    j += 1
                    if M.item(node, kp, <object>vp, inner, &m) < 0:
                        return None
            else:
                for k, v in node.items():
                    if j >= nkeys or not _same_key(<PyObject*>k, keys, types, j):
                        return None
                    j += 1
                    if M.item(node, <PyObject*>k, v, inner, &m) < 0:
                        return None
        else:
            if type(want) is not int or <Py_ssize_t>want != len(node):
                return None
            for k, v in enumerate(node):
                if M.item(node, <PyObject*>k, v, inner, &m) < 0:
                    return None
        if m != len(inner):
            return None
    if ni != nn or M.fi != M.nf:
        return None
    return M.values, M.homes


def unbind(list shards):
    """Drop each shard's tensor (``planner.DestShard``), as a kept plan is put away: it holds none
    between its loads and finds each again when first used."""
    for shard in shards:
        shard._dest = None
