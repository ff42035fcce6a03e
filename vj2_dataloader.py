"""
The VJ2 .npz trajectory dataset: file validation, a global index and cheap per-sample reads.

A file holds `embeddings` [N, T, P, D] and `actions` [N, T-1, A, C], float16 or float32 (see DESIGN.md).
Every file is validated before training (validate_npz), so a bad file fails up front with an error naming the
file, the key and what was expected, instead of crashing one rank in the middle of an epoch. Other keys in a
file are ignored.

Reading: VJ2TrajectoryDataset.__getitem__ never re-opens a file per sample.
- Stored (np.savez, uncompressed) members are np.memmap'ed straight out of the zip: the .npy data of a stored
  member is a plain byte range of the file. Pages live in the OS page cache and are reclaimable, so resident
  memory does not grow with the dataset. At most `max_open_files` maps are kept (each holds a descriptor).
- Deflated (np.savez_compressed) members cannot be mapped; each process keeps an LRU of `cache_files`
  decompressed files. Random access across many compressed files thrashes it (one decompression per visit),
  so store big datasets uncompressed.
Maps and caches are opened lazily in the process that reads. Nothing with a file position is kept open (a map
reads by address), so fork-started DataLoader workers can share what the parent opened, and pickling (spawn
workers) drops the caches instead of shipping arrays.
"""

import bisect
import math
import struct
import warnings
import zipfile
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset

KEYS = ("embeddings", "actions")
LAYOUTS = {"embeddings": "[N, T, P, D]", "actions": "[N, T-1, A, C]"}
FLOAT_DTYPES = "float16 or float32"
# zip members decompressing to more than this many times their stored size are refused (deflate tops out near
# 1032x, so only a crafted member gets here)
MAX_COMPRESSION_RATIO = 1000.0
# largest array a header may declare; far above real files (1000 real trajectories are 4 GiB)
MAX_ARRAY_BYTES = 1 << 40
# bytes per read while scanning values for NaN/inf
SCAN_BYTES = 16 << 20
ZIP_LOCAL_HEADER = struct.Struct("<4s22xHH")
# version 3.0 differs from 2.0 only in allowing utf-8 field names, which no accepted dtype has
NPY_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0,
                      (3, 0): np.lib.format.read_array_header_2_0}


class DataFileError(ValueError):
    """A data file that cannot be used; the message names the file, the key and what was expected."""


class Geometry(NamedTuple):
    steps: int
    patches: int
    embed_dim: int
    actions_per_step: int
    channels: int

    def __str__(self):
        return (f"T={self.steps} P={self.patches} D={self.embed_dim} "
                f"A={self.actions_per_step} C={self.channels}")


class Member(NamedTuple):
    """One array of a file: where it sits in the zip and what its .npy header declares."""
    name: str
    shape: tuple
    dtype: np.dtype
    fortran_order: bool
    header_bytes: int  # bytes of .npy header before the array data
    data_offset: int | None  # absolute file offset of the array data; None unless the member is stored

    @property
    def nbytes(self):
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class FileInfo:
    """A validated file: its path and its two members; everything else follows from their headers."""
    path: Path
    members: dict = field(repr=False)  # key -> Member

    @property
    def n(self):
        return self.members["embeddings"].shape[0]

    @property
    def geometry(self):
        _, steps, patches, embed_dim = self.members["embeddings"].shape
        return Geometry(steps, patches, embed_dim, *self.members["actions"].shape[2:])

    @property
    def dtypes(self):
        """key -> dtype name as stored"""
        return {k: m.dtype.name for k, m in self.members.items()}

    @property
    def mappable(self):
        """True when every array can be np.memmap'ed (all members stored, none deflated)."""
        return all(m.data_offset is not None for m in self.members.values())

# -----------------------------------------------------------------------------------------------------------------
# validation


def validate_npz(path, max_ratio=MAX_COMPRESSION_RATIO, max_bytes=MAX_ARRAY_BYTES):
    """
    Checks one .npz file without trusting it and returns its FileInfo; raises DataFileError otherwise.
    Headers are read before any data: dtype, shapes and declared sizes are checked first (so a pickle
    payload or a zip bomb is refused without being unpickled or inflated), then values are scanned for
    NaN/inf a chunk at a time, so memory stays bounded whatever the file size.
    """
    path = Path(path)
    check_zip_magic(path)
    try:
        with np.load(path, allow_pickle=False) as npz:
            missing = [k for k in KEYS if k not in npz.files]
            if missing:
                raise DataFileError(f"{path}: missing key '{missing[0]}' (found keys: {sorted(npz.files)}); "
                                    f"expected 'embeddings' {LAYOUTS['embeddings']} and "
                                    f"'actions' {LAYOUTS['actions']}")
            members = {k: read_member(path, npz.zip, k, max_ratio, max_bytes) for k in KEYS}
            check_shapes(path, members["embeddings"].shape, members["actions"].shape)
            for key, member in members.items():
                scan_values(path, npz.zip, key, member)
    except DataFileError:
        raise
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError, NotImplementedError) as e:
        raise DataFileError(f"{path}: not a readable .npz archive ({type(e).__name__}: {e})") from e
    return FileInfo(path, members)


def check_zip_magic(path):
    # np.load would happily read a plain .npy (whole) or try a pickle; only a zip is a .npz
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise DataFileError(f"{path}: cannot be read ({e})") from e
    if magic not in (b"PK\x03\x04", b"PK\x05\x06"):
        raise DataFileError(f"{path}: not a zip archive (starts with {magic!r}); expected an .npz written "
                            f"by np.savez with keys 'embeddings' and 'actions'")


def read_member(path, zf, key, max_ratio, max_bytes):
    """Reads and checks the .npy header of `key`, without decompressing its data."""
    name = key + ".npy" if key + ".npy" in zf.namelist() else key
    info = zf.getinfo(name)
    if info.flag_bits & 0x1:
        raise DataFileError(f"{path}: key '{key}' is encrypted; expected a plain .npy member")
    if info.file_size > max_ratio * max(info.compress_size, 1):
        raise DataFileError(f"{path}: key '{key}' claims {info.file_size:,} bytes from {info.compress_size:,} "
                            f"compressed (ratio > {max_ratio:g}); refusing a likely zip bomb")
    with zf.open(info) as fp:
        try:
            version = np.lib.format.read_magic(fp)
            if version not in NPY_HEADER_READERS:
                raise ValueError(f"unsupported .npy format version {version}")
            shape, fortran_order, dtype = NPY_HEADER_READERS[version](fp)
        except ValueError as e:
            raise DataFileError(f"{path}: key '{key}' is not a valid .npy array ({e}); "
                                f"expected a {FLOAT_DTYPES} array {LAYOUTS[key]}") from e
        header_bytes = fp.tell()
    check_dtype(path, key, dtype)
    declared = math.prod(shape) * dtype.itemsize
    held = info.file_size - header_bytes
    if declared > max_bytes or declared > held:
        raise DataFileError(f"{path}: key '{key}' header declares shape {shape} {dtype.name} = {declared:,} bytes "
                            f"but the member holds {held:,}; expected the header to match the data "
                            f"(truncated file or zip bomb)")
    offset = data_offset(path, info) + header_bytes if info.compress_type == zipfile.ZIP_STORED else None
    return Member(name, tuple(shape), dtype, fortran_order, header_bytes, offset)


def check_dtype(path, key, dtype):
    if dtype.hasobject:
        raise DataFileError(f"{path}: key '{key}' holds Python objects (a pickle payload); expected "
                            f"{FLOAT_DTYPES}; refusing to unpickle")
    if dtype.kind != "f" or dtype.itemsize not in (2, 4):
        raise DataFileError(f"{path}: key '{key}' has dtype {dtype}; expected {FLOAT_DTYPES}")


def data_offset(path, info):
    """Absolute offset of a stored member's bytes: its local header, then name and extra field."""
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        local = f.read(ZIP_LOCAL_HEADER.size)
    if len(local) != ZIP_LOCAL_HEADER.size or local[:4] != b"PK\x03\x04":
        raise DataFileError(f"{path}: member '{info.filename}' has no local zip header at {info.header_offset}")
    _, name_len, extra_len = ZIP_LOCAL_HEADER.unpack(local)
    return info.header_offset + ZIP_LOCAL_HEADER.size + name_len + extra_len


def check_shapes(path, emb, act):
    for key, shape in (("embeddings", emb), ("actions", act)):
        if len(shape) != 4:
            raise DataFileError(f"{path}: key '{key}' has shape {shape} ({len(shape)}-D); "
                                f"expected 4-D {LAYOUTS[key]}")
    if act[0] != emb[0]:
        raise DataFileError(f"{path}: key 'actions' holds N={act[0]} trajectories but 'embeddings' holds "
                            f"N={emb[0]}; expected the same N")
    if emb[1] < 2:
        raise DataFileError(f"{path}: key 'embeddings' has T={emb[1]} steps; expected T >= 2")
    if act[1] != emb[1] - 1:
        raise DataFileError(f"{path}: key 'actions' has {act[1]} steps but 'embeddings' has T={emb[1]}; "
                            f"expected T-1 = {emb[1] - 1} (one action block between consecutive steps)")
    if min(emb[2:] + act[2:]) < 1:
        raise DataFileError(f"{path}: keys 'embeddings' {emb} / 'actions' {act} have an empty dimension; "
                            f"expected P, D, A, C >= 1")


def scan_values(path, zf, key, member):
    """Streams the member's data: checks its length, its CRC and that every value is finite."""
    step = SCAN_BYTES - SCAN_BYTES % member.dtype.itemsize
    row = math.prod(member.shape[1:]) or 1
    seen = 0
    with zf.open(member.name) as fp:
        fp.read(member.header_bytes)
        while seen < member.nbytes:
            buf = fp.read(min(step, member.nbytes - seen))
            if not buf or len(buf) % member.dtype.itemsize:
                raise DataFileError(f"{path}: key '{key}' is truncated: {seen + len(buf):,} of "
                                    f"{member.nbytes:,} data bytes; expected shape {member.shape}")
            bad = ~np.isfinite(np.frombuffer(buf, member.dtype))
            if bad.any():
                where = "" if member.fortran_order else \
                    f" (first in trajectory {(seen // member.dtype.itemsize + int(bad.argmax())) // row})"
                raise DataFileError(f"{path}: key '{key}' contains NaN or inf{where}; expected finite values")
            seen += len(buf)
        # reading to the end makes zipfile verify the member's CRC
        while fp.read(SCAN_BYTES):
            pass

# -----------------------------------------------------------------------------------------------------------------
# the dataset


def list_files(data_dir):
    data_dir = Path(data_dir)
    if data_dir.is_file() and data_dir.suffix == ".npz":
        return [data_dir]
    if not data_dir.is_dir():
        raise FileNotFoundError(f"data directory {data_dir} does not exist")
    files = sorted(data_dir.glob("*.npz"))
    if not files:
        raise DataFileError(f"{data_dir}: no *.npz files found; expected trajectory files "
                            f"(create_synthetic_data.py writes some)")
    return files


class VJ2TrajectoryDataset(Dataset):
    """
    All trajectories of the *.npz files in data_dir (sorted by name), one item per trajectory:
    (embeddings [T, P, D] tensor in the stored dtype, actions [T-1, A*C] float32 tensor).
    Files are validated up front; with skip_bad_files a bad file is warned about and listed in `skipped`
    instead of raising. All files must share one geometry. rollout_horizon, when given, must fit in T-1.
    """

    def __init__(self, data_dir, skip_bad_files=False, logger=None, rollout_horizon=None,
                 cache_files=2, max_open_files=64):
        self.data_dir = Path(data_dir)
        self.cache_files = cache_files
        self.max_open_files = max_open_files
        self.skipped = []  # (path, reason)
        self.infos = []
        for path in list_files(self.data_dir):
            try:
                self.infos.append(self._checked(validate_npz(path)))
            except DataFileError as e:
                if not skip_bad_files:
                    raise
                self.skipped.append((path, str(e)))
                message = f"skipping bad data file: {e}"
                if logger is not None:
                    logger.warning(message)
                else:
                    warnings.warn(message, stacklevel=2)
        if not self.infos:
            raise DataFileError(f"{self.data_dir}: no usable .npz files ({len(self.skipped)} skipped, "
                                f"first: {self.skipped[0][1] if self.skipped else 'none'})")
        self.files = [info.path for info in self.infos]
        self.geometry = self.infos[0].geometry
        # mixed float16/float32 files come out in the wider dtype, so a batch always stacks
        self.dtype = np.result_type(*(info.members["embeddings"].dtype for info in self.infos)).newbyteorder("=")
        self.ends = list(np.cumsum([info.n for info in self.infos]).tolist())
        if rollout_horizon is not None and self.geometry.steps - 1 < rollout_horizon:
            raise ValueError(f"{self.data_dir}: trajectories have T={self.geometry.steps} steps, so at most "
                             f"T-1={self.geometry.steps - 1} rollout steps, but rollout_horizon={rollout_horizon}; "
                             f"lower the horizon or use longer trajectories")
        self._reset_caches()

    def _checked(self, info):
        if self.infos and info.geometry != self.infos[0].geometry:
            raise DataFileError(f"{info.path}: geometry {info.geometry} differs from {self.infos[0].path}: "
                                f"{self.infos[0].geometry}; expected one geometry for all files of a dataset")
        return info

    def _reset_caches(self):
        self._mapped = OrderedDict()  # file index -> (embeddings, actions) np.memmap
        self._loaded = OrderedDict()  # file index -> (embeddings, actions) decompressed arrays

    def __getstate__(self):
        # spawn-started workers get the index, not the arrays; they open what they read themselves
        state = self.__dict__.copy()
        state["_mapped"], state["_loaded"] = OrderedDict(), OrderedDict()
        return state

    def __len__(self):
        return self.ends[-1]

    def locate(self, index):
        """(file index, row in that file) of a global trajectory index; O(log files)."""
        if not -len(self) <= index < len(self):
            raise IndexError(f"trajectory index {index} out of range for {len(self)} trajectories")
        index %= len(self)
        f = bisect.bisect_right(self.ends, index)
        return f, index - (self.ends[f - 1] if f else 0)

    def __getitem__(self, index):
        f, row = self.locate(index)
        # np.array copies out of the map/cache (and fixes byte order) so the tensor owns writable memory
        embeddings = torch.from_numpy(np.array(self.arrays(f)[0][row], dtype=self.dtype))
        return embeddings, self._actions(f, row)

    def actions(self, index):
        """Trajectory `index`'s actions [T-1, A*C] alone, without reading its embeddings."""
        return self._actions(*self.locate(index))

    def _actions(self, f, row):
        T, _, _, A, C = self.geometry
        return torch.from_numpy(np.array(self.arrays(f)[1][row], dtype=np.float32).reshape(T - 1, A * C))

    def arrays(self, f):
        """(embeddings, actions) arrays of file f: memory maps, or decompressed copies kept in a small LRU."""
        info = self.infos[f]
        if info.mappable:
            return lru_get(self._mapped, f, self.max_open_files, lambda: map_file(info))
        return lru_get(self._loaded, f, self.cache_files, lambda: load_file(info))

    def summary(self):
        return (f"{self.data_dir}: {len(self.files)} files, {len(self)} trajectories, "
                f"{len(self.skipped)} skipped, geometry {self.geometry} ({self.dtype.name})")


def lru_get(cache, key, limit, load):
    if key in cache:
        cache.move_to_end(key)
        return cache[key]
    value = cache[key] = load()
    while len(cache) > max(limit, 1):
        cache.popitem(last=False)
    return value


def map_file(info):
    return tuple(np.memmap(info.path, dtype=m.dtype, mode="r", offset=m.data_offset, shape=m.shape,
                           order="F" if m.fortran_order else "C")
                 for m in (info.members[k] for k in KEYS))


def load_file(info):
    with np.load(info.path, allow_pickle=False) as npz:
        return tuple(npz[k] for k in KEYS)
