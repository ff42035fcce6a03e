"""
The VJ2 .npz trajectory dataset: file validation, a global index and cheap per-sample reads.

A file holds `embeddings` [N, T, P, D] and `actions` [N, T-1, A, C], float16 or float32 (see README.md).
Every file is validated before training (validate_npz), so a bad file fails up front with an error naming the
file, the key and what was expected, instead of crashing one rank in the middle of an epoch. Other keys in a
file are ignored.

Reading: VJ2TrajectoryDataset.__getitem__ never re-opens a file per sample.
- Stored (np.savez, uncompressed) members are read straight out of the zip: the .npy data of a stored member
  is a plain byte range of the file, so one trajectory is one os.pread of exactly its bytes, from the OS page
  cache into an array the sample owns. Not a memory map: every page read through a map stays in the reading
  process's resident set until the map is closed, so with the maps of a whole data set open a worker's RSS
  grew to the data it had read. At most `max_open_files` descriptors are kept.
- Deflated (np.savez_compressed) members cannot be read by offset; each process keeps an LRU of `cache_files`
  decompressed files. Random access across many compressed files thrashes it (one decompression per visit),
  so store big datasets uncompressed.
Descriptors and caches are opened lazily in the process that reads. pread takes an offset, never the
descriptor's position, so fork-started DataLoader workers can share what the parent opened, and pickling
(spawn workers) drops the caches instead of shipping arrays.
"""

import bisect
import hashlib
import math
import os
import struct
import tokenize
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

import config

KEYS = ("embeddings", "actions")
LAYOUTS = {"embeddings": "[N, T, P, D]", "actions": "[N, T-1, A, C]"}
FLOAT_DTYPES = "float16 or float32"
# zip members decompressing to more than this many times their stored size are refused: deflate tops out near
# 1032x (constant data gets there: idle actions, all zeros), so only a member whose declared size lies gets here
MAX_COMPRESSION_RATIO = 1100.0
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
        """True when every array lies in the file as it is (stored, not deflated): read with os.pread at an
        offset, no map and no decompression."""
        return all(m.data_offset is not None for m in self.members.values())

# -----------------------------------------------------------------------------------------------------------------
# validation


def validate_npz(path, max_ratio=MAX_COMPRESSION_RATIO, max_bytes=MAX_ARRAY_BYTES):
    """
    Checks one .npz file without trusting it and returns its FileInfo; raises DataFileError otherwise.
    Headers are read before any data: dtype, shapes and declared sizes are checked first (so a pickle
    payload or a zip bomb is refused without being unpickled or inflated), then values are scanned for
    NaN/inf (and actions for their range) a chunk at a time, so memory stays bounded whatever the file size.
    """
    path = Path(path)
    check_zip_magic(path)
    key = None  # the array being read, named in an error from a damaged stream
    try:
        with np.load(path, allow_pickle=False) as npz:
            missing = [k for k in KEYS if k not in npz.files]
            if missing:
                raise DataFileError(f"{path}: missing key '{missing[0]}' (found keys: {sorted(npz.files)}); "
                                    f"expected 'embeddings' {LAYOUTS['embeddings']} and "
                                    f"'actions' {LAYOUTS['actions']}")
            members = {}
            for key in KEYS:
                members[key] = read_member(path, npz.zip, key, max_ratio, max_bytes)
            key = None
            check_shapes(path, members["embeddings"].shape, members["actions"].shape)
            for key, member in members.items():
                scan_values(path, npz.zip, key, member)
    except DataFileError:
        raise
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError, NotImplementedError) as e:
        where = f" (key '{key}')" if key else ""
        raise DataFileError(f"{path}: not a readable .npz archive{where} ({type(e).__name__}: {e})") from e
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


def member_name(path, zf, key):
    """
    The one zip member holding `key`. np.load(path)[key] reads a bare `key` member before `key.npy`, so with
    both present what is checked and what is read could differ (a valid .npy beside a NaN bare member):
    an archive holding both, or one name twice, is refused as ambiguous.
    """
    names = [name for name in zf.namelist() if name in (key, key + ".npy")]
    if len(names) != 1:
        raise DataFileError(f"{path}: key '{key}' is held by {len(names)} zip members "
                            f"({', '.join(map(repr, names))}); expected exactly one ('{key}.npy' as np.savez "
                            f"writes it)")
    return names[0]


def read_member(path, zf, key, max_ratio, max_bytes):
    """Reads and checks the .npy header of `key`, without decompressing its data."""
    info = zf.getinfo(member_name(path, zf, key))
    name = info.filename
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
        # numpy's parser fails on a damaged header dict (or dtype string) not only with a ValueError: also
        # with a SyntaxError or tokenize's TokenError
        except (ValueError, SyntaxError, tokenize.TokenError) as e:
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
    if emb[0] < 1:
        raise DataFileError(f"{path}: key 'embeddings' has shape {emb}, N=0 trajectories; expected N >= 1")
    if emb[1] < 2:
        raise DataFileError(f"{path}: key 'embeddings' has T={emb[1]} steps; expected T >= 2")
    if act[1] != emb[1] - 1:
        raise DataFileError(f"{path}: key 'actions' has {act[1]} steps but 'embeddings' has T={emb[1]}; "
                            f"expected T-1 = {emb[1] - 1} (one action block between consecutive steps)")
    if min(emb[2:] + act[2:]) < 1:
        raise DataFileError(f"{path}: keys 'embeddings' {emb} / 'actions' {act} have an empty dimension; "
                            f"expected P, D, A, C >= 1")
    if act[3] < len(config.ACTION_CHANNEL_NAMES):
        raise DataFileError(f"{path}: key 'actions' has C={act[3]} channels; expected at least "
                            f"{len(config.ACTION_CHANNEL_NAMES)}: {list(config.ACTION_CHANNEL_NAMES)}")
    if act[3] > config.MAX_ACTION_CHANNELS:  # every value would pass the range check: scrambled actions trained
        raise DataFileError(f"{path}: key 'actions' has shape {act}, A={act[2]} actions of C={act[3]} channels, "
                            f"more than the {config.MAX_ACTION_CHANNELS} an action may have: actions stored "
                            f"channels-first ([N, T-1, C, A]) read so; expected {LAYOUTS['actions']} with the "
                            f"{list(config.ACTION_CHANNEL_NAMES)} channels last (np.swapaxes(actions, 2, 3) "
                            f"converts them)")
    if emb[3] < config.MIN_EMBED_DIM:
        raise DataFileError(f"{path}: key 'embeddings' has D={emb[3]}; expected D >= {config.MIN_EMBED_DIM} "
                            f"(the predictor layer-norms tokens over D, and one value normalises to 0)")


def scan_values(path, zf, key, member):
    """
    Streams the member's data once: checks its length, its CRC and that every value is finite; for `actions`
    the same pass gathers each channel's min and max, checked against config.ACTION_VALUE_RANGE at the end.
    """
    extrema = {}  # channel -> (min, max), actions only
    # a token whose D values are all equal layer-norms to 0: a file of only such tokens has nothing to predict
    varies = key != "embeddings" or member.fortran_order  # (a Fortran-order chunk holds no whole tokens)
    for start, values in read_chunks(path, zf, key, member):
        bad = ~np.isfinite(values)
        if bad.any():
            row = math.prod(member.shape[1:])
            where = "" if member.fortran_order else f" (first in trajectory {(start + int(bad.argmax())) // row})"
            raise DataFileError(f"{path}: key '{key}' contains NaN or inf{where}; expected finite values")
        if not varies:  # checked until one token varies: real embeddings within the first few tokens, so
            # the whole chunk (another pass over it) is compared only where those were all constant
            tokens = values.reshape(-1, member.shape[-1])
            varies = bool((tokens[:64] != tokens[:64, :1]).any()) or bool((tokens != tokens[:, :1]).any())
        if key == "actions":
            for channel, (lo, hi) in channel_extrema(member, start, values).items():
                old_lo, old_hi = extrema.get(channel, (lo, hi))
                extrema[channel] = (min(lo, old_lo), max(hi, old_hi))
    if key == "actions":
        check_action_range(path, extrema)
    if not varies:
        raise DataFileError(f"{path}: key 'embeddings': every token's D={member.shape[-1]} values are equal (constant "
                            f"or zero embeddings); the predictor layer-norms tokens over D, which makes each 0, "
                            f"so there is nothing to predict; expected encoder embeddings")


def read_chunks(path, zf, key, member):
    """
    Yields (index of the first element, values) over the member's data and reads to its end, so zipfile
    verifies the CRC. A chunk holds whole rows of the last axis, so a C-order chunk reshapes to [-1, C].
    """
    row_bytes = member.dtype.itemsize * member.shape[-1]
    step = max(row_bytes, SCAN_BYTES - SCAN_BYTES % row_bytes)
    seen = 0
    with zf.open(member.name) as fp:
        fp.read(member.header_bytes)
        while seen < member.nbytes:
            want = min(step, member.nbytes - seen)
            buf = fp.read(want)  # ZipExtFile.read returns fewer bytes only at the end of the member
            if len(buf) != want:
                raise DataFileError(f"{path}: key '{key}' is truncated: {seen + len(buf):,} of "
                                    f"{member.nbytes:,} data bytes; expected shape {member.shape}")
            yield seen // member.dtype.itemsize, np.frombuffer(buf, member.dtype)
            seen += len(buf)
        while fp.read(SCAN_BYTES):
            pass


def channel_extrema(member, start, values):
    """
    {channel: (min, max)} within one chunk starting at element `start`, for the [x, y, touch] channels only:
    channels beyond them are not defined by the format, so their values are not judged.
    """
    channels = member.shape[-1]
    checked = range(min(channels, len(config.ACTION_CHANNEL_NAMES)))
    if not member.fortran_order:  # the channel axis varies fastest
        rows = values.reshape(-1, channels)
        return {c: (float(rows[:, c].min()), float(rows[:, c].max())) for c in checked}
    # Fortran order stores each channel as one contiguous block; a chunk may touch several
    block = math.prod(member.shape[:-1])
    out = {}
    for c in range(start // block, (start + len(values) - 1) // block + 1):
        part = values[max(c * block - start, 0):(c + 1) * block - start]
        if c in checked:
            out[c] = (float(part.min()), float(part.max()))
    return out


def check_action_range(path, extrema):
    low, high = config.ACTION_VALUE_RANGE
    bad = [f"channel {c} ({config.ACTION_CHANNEL_NAMES[c]}) from {lo:g} to {hi:g}"
           for c, (lo, hi) in sorted(extrema.items()) if lo < low or hi > high]
    if bad:
        raise DataFileError(f"{path}: key 'actions' holds values out of range: {'; '.join(bad)}; expected every "
                            f"[x, y, touch] value in [{low:g}, {high:g}] (x and y as fractions of the screen "
                            f"width and height, not pixels)")

# -----------------------------------------------------------------------------------------------------------------
# the dataset


def list_files(data_dir):
    data_dir = Path(data_dir)
    if data_dir.is_file() and data_dir.suffix == ".npz":
        return [data_dir]
    if data_dir.exists() and not data_dir.is_dir():
        raise FileNotFoundError(f"data directory {data_dir} is a file, not a directory (nor an .npz file)")
    if not data_dir.is_dir():
        where = "" if data_dir.is_absolute() else f" (relative to the working directory {Path.cwd()})"
        raise FileNotFoundError(f"data directory {data_dir} does not exist{where}")
    files = sorted(data_dir.glob("*.npz"))
    if not files:
        below = " (its subdirectories are not searched)" if any(p.is_dir() for p in data_dir.iterdir()) else ""
        raise DataFileError(f"{data_dir}: no *.npz files found{below}; expected trajectory files "
                            f"(create_synthetic_data.py writes some)")
    seen = {}
    for path in files:  # a link to another file here (latest.npz) would train its trajectories twice
        try:
            st = path.stat()
        except OSError:
            continue  # a dangling link: the file checks name it
        if (st.st_dev, st.st_ino) in seen:
            raise DataFileError(f"{seen[st.st_dev, st.st_ino]} and {path} are the same file (a link); its "
                                f"trajectories would be read twice; expected each file once in {data_dir}")
        seen[st.st_dev, st.st_ino] = path
    return files


class VJ2TrajectoryDataset(Dataset):
    """
    All trajectories of the *.npz files in data_dir (sorted by name), one item per trajectory:
    (embeddings [T, P, D] tensor in the widest stored dtype, native byte order; actions [T-1, A*C] float32).
    Files are validated up front; with skip_bad_files a bad file is warned about and listed in `skipped`
    instead of raising. All files must share one geometry; with skip_bad_files the geometry held by the most
    trajectories is kept and files of another are skipped (a tie is an error). rollout_horizon, when given,
    must fit in T-1.
    """

    def __init__(self, data_dir, skip_bad_files=False, logger=None, rollout_horizon=None,
                 cache_files=2, max_open_files=64):
        self.data_dir = Path(data_dir)
        self.cache_files = cache_files
        self.max_open_files = max_open_files
        self.skipped = []  # (path, reason)
        valid = []
        for path in list_files(self.data_dir):
            valid += self._validated(path, skip_bad_files, logger)
        self.infos = self._one_geometry(valid, skip_bad_files, logger)
        if not self.infos:
            raise DataFileError(f"{self.data_dir}: no usable trajectories: all {len(self.skipped)} .npz files "
                                f"were skipped (first: {self.skipped[0][1]}); expected at least one valid file "
                                f"with N >= 1 trajectories")
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

    def _validated(self, path, skip_bad_files, logger):
        """[FileInfo] of a good file, [] of a skipped one."""
        try:
            return [validate_npz(path)]
        except DataFileError as e:
            if not skip_bad_files:
                raise
            self._skip(path, e, logger)
            return []

    def _one_geometry(self, infos, skip_bad_files, logger):
        """The files of the one geometry to train on; with skip_bad_files the others are skipped."""
        groups = {}
        for info in infos:
            groups.setdefault(info.geometry, []).append(info)
        if len(groups) <= 1:
            return infos
        if not skip_bad_files:
            raise DataFileError(f"{self.data_dir}: files disagree on the geometry: {describe_groups(groups)}; "
                                f"expected one geometry for all files of a dataset")
        reference = majority_geometry(self.data_dir, groups)
        held_by = describe_groups({reference: groups[reference]})
        for info in infos:
            if info.geometry != reference:
                self._skip(info.path, DataFileError(
                    f"{info.path}: geometry {info.geometry} differs from {held_by}, the geometry of most "
                    f"trajectories; expected one geometry for all files of a dataset"), logger)
        return groups[reference]

    def _skip(self, path, error, logger):
        self.skipped.append((path, str(error)))
        message = f"skipping bad data file: {error}"
        if logger is not None:
            logger.warning(message)
        else:
            warnings.warn(message, stacklevel=4)  # the line that built the dataset

    def _reset_caches(self):
        self._open = OrderedDict()  # file index -> StoredFile
        self._loaded = OrderedDict()  # file index -> (embeddings, actions) decompressed arrays

    def __getstate__(self):
        # spawn-started workers get the index, not the arrays; they open what they read themselves
        state = self.__dict__.copy()
        state["_open"], state["_loaded"] = OrderedDict(), OrderedDict()
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
        return torch.from_numpy(self.read(f, "embeddings", row, self.dtype)), self._actions(f, row)

    def actions(self, index):
        """Trajectory `index`'s actions [T-1, A*C] alone, without reading its embeddings."""
        return self._actions(*self.locate(index))

    def _actions(self, f, row):
        T, _, _, A, C = self.geometry
        return torch.from_numpy(self.read(f, "actions", row, np.float32).reshape(T - 1, A * C))

    def read(self, f, key, row, dtype):
        """Row `row` of member `key` of file f as a new writable array of `dtype` (native byte order)."""
        info = self.infos[f]
        if info.mappable:
            return lru_get(self._open, f, self.max_open_files, lambda: StoredFile(info)).read(key, row, dtype)
        arrays = lru_get(self._loaded, f, self.cache_files, lambda: load_file(info))
        return np.array(arrays[KEYS.index(key)][row], dtype=dtype)

    def fingerprint(self):
        """Of every file's name and its members' sizes and CRC-32s, read from the zip directory (no data is
        read): another data set, or a file changed since, gives another."""
        h = hashlib.sha256()
        for info in self.infos:
            with zipfile.ZipFile(info.path) as z:
                members = sorted((m.filename, m.file_size, m.CRC) for m in z.infolist())
            h.update(repr((info.path.relative_to(self.data_dir).as_posix(), members)).encode())
        return h.hexdigest()[:16]

    def summary(self):
        return (f"{self.data_dir}: {len(self.files)} file{'s' * (len(self.files) != 1)}, {len(self)} trajectories, "
                f"{len(self.skipped)} skipped, geometry {self.geometry} ({self.dtype.name})")


def majority_geometry(data_dir, groups):
    """
    The geometry held by the most trajectories in {geometry: [FileInfo]}. Not the first file's: a leftover file
    that sorts first must not outvote the data set. A tie has no right answer, so it is an error naming the
    competing geometries and their files.
    """
    held = {geometry: sum(info.n for info in infos) for geometry, infos in groups.items()}
    top = [geometry for geometry in groups if held[geometry] == max(held.values())]
    if len(top) > 1:
        raise DataFileError(f"{data_dir}: files disagree on the geometry and no geometry is held by the most "
                            f"trajectories: {describe_groups({g: groups[g] for g in top})}; expected one geometry "
                            f"for all files (remove the files of the wrong one)")
    return top[0]


def describe_groups(groups, max_files=3):
    """'<geometry> in a.npz, b.npz (N trajectories); ...' for {geometry: [FileInfo]}."""
    parts = []
    for geometry, infos in groups.items():
        names = ", ".join(str(info.path) for info in infos[:max_files])
        more = f" and {len(infos) - max_files} more files" if len(infos) > max_files else ""
        parts.append(f"{geometry} in {names}{more} ({sum(info.n for info in infos)} trajectories)")
    return "; ".join(parts)


def lru_get(cache, key, limit, load):
    if key in cache:
        cache.move_to_end(key)
        return cache[key]
    value = cache[key] = load()
    while len(cache) > max(limit, 1):
        _, evicted = cache.popitem(last=False)
        if hasattr(evicted, "close"):  # an open file: its descriptor now, not whenever the collector runs
            evicted.close()
    return value


class StoredFile:
    """One open file whose members are all stored: reads a row of a member by its offset (os.pread)."""

    def __init__(self, info):
        self.info = info
        self.file = open(info.path, "rb", buffering=0)  # closed by close(), when the LRU evicts this file
        self._maps = {}  # Fortran-order members only: their rows are strided, not one byte range

    def read(self, key, row, dtype):
        m = self.info.members[key]
        if m.fortran_order:
            if key not in self._maps:
                self._maps[key] = np.memmap(self.info.path, dtype=m.dtype, mode="r", offset=m.data_offset,
                                            shape=m.shape, order="F")
            return np.array(self._maps[key][row], dtype=dtype)
        out = np.empty(m.shape[1:], m.dtype)
        self._pread_into(out, m.data_offset + row * out.nbytes, key, row)
        return out if out.dtype == dtype else out.astype(dtype)

    def close(self):
        self.file.close()
        self._maps.clear()

    def _pread_into(self, out, offset, key, row):
        view = memoryview(out.reshape(-1).view(np.uint8))
        done = 0
        while done < len(view):
            n = os.preadv(self.file.fileno(), [view[done:]], offset + done)
            if n == 0:
                raise DataFileError(f"{self.info.path}: key '{key}' ends early: trajectory {row} has "
                                    f"{done} of {len(view)} bytes; the file changed after it was validated")
            done += n


def load_file(info):
    """Both arrays of a deflated file, read from exactly the members that were validated (not np.load's pick)."""
    with zipfile.ZipFile(info.path) as zf:
        return tuple(read_npy(zf, info.members[k].name) for k in KEYS)


def read_npy(zf, name):
    with zf.open(name) as fp:
        return np.lib.format.read_array(fp, allow_pickle=False)


def data_fingerprint(path):
    """
    ((CRC-32, size) of each of KEYS' members), as the zip's central directory records them: equal for two
    files holding the same arrays (a copy, or the same .npy data stored another way). None for a file that is
    not a readable zip with one member per key; the loader reports such files. Costs one small read per file.
    """
    try:
        with zipfile.ZipFile(path) as zf:
            return tuple((i.CRC, i.file_size) for i in (zf.getinfo(member_name(path, zf, k)) for k in KEYS))
    # DataFileError too; NotImplementedError: a zip version Python cannot extract. The loader says why
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError):
        return None
