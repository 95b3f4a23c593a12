"""Where checkpoints live: a local directory or an fsspec URL, and the few storage operations the
checkpoints need (list, exists, a small file written atomically and durably, recursive delete, a
torch.distributed.checkpoint write and read of a flat {name: tensor} dict).

Local directories (and `file://` URLs) go through the local file system with fsync: the data files
(DCP fsyncs them), then the checkpoint directory (its entries), then the marker (temporary name,
fsync, rename, fsync of the directory). Other URLs go through fsspec: on object stores a put is atomic
and durable when it returns.

DCP is always called with `no_dist=True`: the one writer of a stage is one rank of the world group
(gloo), and its peers do not call save, so DCP must not run its planning collectives.
"""

from __future__ import annotations

import os
import posixpath
import re
import warnings
from typing import Any

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

_MANGLED = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):/(?!/)")  # str(Path("s3://b/k")) == "s3:/b/k"


def normalise(root: str | os.PathLike[str]) -> str:
    """`root` as text; a URL that went through pathlib (`file:/x`, `s3:/bucket`) gets its `//` back."""
    text = os.fspath(root)
    m = _MANGLED.match(text)
    if m and m.group(1).lower() in fsspec.available_protocols():
        rest = text[m.end() - 1 :] if m.group(1).lower() in ("file", "local") else text[m.end() :]
        text = f"{m.group(1)}://{rest}"
    return text


def is_url(root: str | os.PathLike[str]) -> bool:
    """Whether `root` is an fsspec URL (scheme://...) rather than a local path."""
    return "://" in normalise(root)


def _quiet_dcp() -> None:
    """DCP warns on every no_dist call; no_dist is what we mean (the filter is added once: re-adding
    an equal filter replaces it)."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


class Root:
    """A checkpoint root: a local directory or an fsspec URL. Paths inside it are '/'-joined."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.text = normalise(root)
        self.url = "://" in self.text
        self.fs: Any
        if self.url:
            self.fs, base = fsspec.core.url_to_fs(self.text)
        else:
            self.fs, base = LocalFileSystem(), os.path.abspath(self.text)
        self.base = str(base).rstrip("/")
        self.local = isinstance(self.fs, LocalFileSystem)

    def __str__(self) -> str:
        return self.text

    def path(self, *parts: str) -> str:
        """The file system path of `parts` under the root."""
        return "/".join([self.base, *parts])

    def _target(self, path: str) -> str:
        """What DCP is given for `path`: the local path, or the full URL (it picks the fsspec writer)."""
        return path if not self.url else self.fs.unstrip_protocol(path)

    def names(self, path: str) -> list[str]:
        """The entry names in directory `path` ([] if it does not exist)."""
        try:
            entries = self.fs.ls(path, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return [posixpath.basename(str(e).rstrip("/")) for e in entries]

    def exists(self, path: str) -> bool:
        """Whether `path` exists."""
        return bool(self.fs.exists(path))

    def remove(self, path: str) -> None:
        """Delete `path` (a file or a directory tree) if it exists."""
        if self.exists(path):
            self.fs.rm(path, recursive=True)

    def write_small(self, path: str, data: bytes) -> None:
        """Write `data` to `path` so that a reader sees the whole file or none (after fsync of the
        parent directory, which also makes its other entries durable, when local)."""
        parent = posixpath.dirname(path)
        tmp = posixpath.join(parent, f".{posixpath.basename(path)}.tmp{os.getpid()}")
        if self.local:
            _fsync_dir(parent)  # the entries written so far (DCP's files, its .metadata rename)
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            _fsync_dir(parent)
        else:
            self.fs.pipe_file(tmp, data)
            self.fs.mv(tmp, path)

    def read_small(self, path: str) -> bytes:
        """The content of the small file `path`."""
        data: bytes = self.fs.cat_file(path)
        return data

    def save_tensors(self, path: str, tensors: dict[str, torch.Tensor]) -> None:
        """Write `tensors` with torch.distributed.checkpoint into directory `path` (no collectives)."""
        _quiet_dcp()
        self.fs.makedirs(path, exist_ok=True)
        target = self._target(path)
        import torch.distributed.checkpoint as dcp  # (lazily: 0.6 s of imports a worker start needs not)
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        writer: dcp.StorageWriter
        if self.url:
            writer = FsspecWriter(target, sync_files=True)
        else:
            writer = dcp.FileSystemWriter(target, sync_files=True)
        dcp.save(tensors, storage_writer=writer, no_dist=True)

    def load_tensors(self, path: str) -> dict[str, torch.Tensor]:
        """Every tensor of the DCP checkpoint in directory `path`, on the CPU (no collectives)."""
        _quiet_dcp()
        target = self._target(path)
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
        from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        reader: dcp.StorageReader = FsspecReader(target) if self.url else dcp.FileSystemReader(target)
        out: dict[str, Any] = {}
        # What torch's own dcp_to_torch_save does: rebuild the dict from the checkpoint's metadata.
        _load_state_dict(out, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
        return out


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
