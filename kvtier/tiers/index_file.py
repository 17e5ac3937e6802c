"""What the disk index's LMDB file must look like before LMDB may map it.

LMDB maps `data.mdb` and trusts it: a file cut short (a full disk, a bad copy, a person) makes
it read pages past the end of the file, and the daemon dies by SIGBUS at start; a B-tree page
that is not what its parent says (zeroed, overwritten) trips an assertion inside LMDB that
aborts the process. Neither can be caught. So the file is read with plain system calls first:
two meta pages with LMDB's magic, a page size it could have written, the newer meta's last page
inside the file, and every page reachable from the roots (the free list, the main database and
each named database under it) carrying its own page number and a kind its parent allows, with
node offsets inside the page. Anything else is damage, reported in one sentence; the disk tier
then moves the index aside and rebuilds it from the slot file. What this walk cannot see (a key or a
value with wrong bytes) surfaces as an `lmdb.Error` or a record that does not decode, which the tier
also catches. Verbs: `index_file_problem`.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

# The 64-bit LMDB 0.9 layout (lmdb/mdb.c): a 16-byte page header, then MDB_meta.
_MAGIC = 0xBEEFC0DE
_META = struct.Struct("<II8x8x")  # mm_magic, mm_version, mm_address, mm_mapsize
_META_OFFSET = 16
_PAGE_SIZE_OFFSET = 40  # mm_dbs[FREE_DBI].md_pad holds the page size
_FREE_ROOT_OFFSET = 80  # mm_dbs[FREE_DBI].md_root
_MAIN_ROOT_OFFSET = 128  # mm_dbs[MAIN_DBI].md_root
_LAST_PAGE_OFFSET = 136  # mm_last_pg, then mm_txnid
_NO_PAGE = (1 << 64) - 1  # P_INVALID: an empty tree
_MIN_PAGE_BYTES, _MAX_PAGE_BYTES = 512, 1 << 16


def index_file_problem(data_path: Path) -> str | None:
    """Why LMDB must not map `data_path`, or None when it may (or the file does not exist yet).

    Never raises for a bad file; an unreadable one is a problem like any other.
    """
    try:
        fd = os.open(data_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot read it ({exc.strerror or exc})"
    try:
        return _file_problem(fd)
    except OSError as exc:
        return f"cannot read it ({exc.strerror or exc})"
    finally:
        os.close(fd)


def _file_problem(fd: int) -> str | None:
    size_bytes = os.fstat(fd).st_size
    head = os.pread(fd, 512, 0)
    if len(head) < 512:
        return f"it is {size_bytes} bytes, shorter than LMDB's meta pages"
    page_bytes = struct.unpack_from("<I", head, _PAGE_SIZE_OFFSET)[0]
    if (page_bytes < _MIN_PAGE_BYTES or page_bytes > _MAX_PAGE_BYTES
            or page_bytes & (page_bytes - 1)):
        return f"its header names a page size of {page_bytes} bytes"
    if size_bytes < 2 * page_bytes:
        return f"it is {size_bytes} bytes, shorter than its two meta pages"
    metas = [head, os.pread(fd, 512, page_bytes)]
    newest = None
    for number, meta in enumerate(metas):
        magic, version = _META.unpack_from(meta, _META_OFFSET)
        if magic != _MAGIC or version != 1:
            return f"meta page {number} is not an LMDB meta page"
        last_page, txn_id = struct.unpack_from("<QQ", meta, _LAST_PAGE_OFFSET)
        if newest is None or txn_id > newest[1]:
            newest = (last_page, txn_id, meta)
    assert newest is not None  # two meta pages, each returned on or kept as the newest
    last_page, _, meta = newest
    needed_bytes = (last_page + 1) * page_bytes
    if needed_bytes > size_bytes:
        return f"it is {size_bytes} bytes but its meta page says {needed_bytes}"
    walk = _TreeWalk(fd, page_bytes, last_page)
    for offset in (_FREE_ROOT_OFFSET, _MAIN_ROOT_OFFSET):
        root = struct.unpack_from("<Q", meta, offset)[0]
        problem = walk.tree(root, named_dbs=offset == _MAIN_ROOT_OFFSET)
        if problem is not None:
            return problem
    return None


_P_BRANCH, _P_LEAF, _P_OVERFLOW = 0x01, 0x02, 0x04
_F_BIGDATA, _F_SUBDATA = 0x01, 0x02
_PAGE_HEADER = struct.Struct("<QHHHH")  # mp_pgno, mp_pad, mp_flags, mp_lower, mp_upper
_NODE = struct.Struct("<HHHH")  # mn_lo, mn_hi, mn_flags, mn_ksize
_DB_ROOT_OFFSET = 40  # md_root inside an MDB_db record (a named database's node data)
_MAX_DEPTH = 64


class _TreeWalk:
    """Every page reachable from a root, checked against what its parent says it is."""

    def __init__(self, fd: int, page_bytes: int, last_page: int) -> None:
        self._fd = fd
        self._page_bytes = page_bytes
        self._last_page = last_page
        self._seen: set[int] = set()

    def tree(self, root: int, named_dbs: bool, depth: int = 0) -> str | None:
        """Problems of the B-tree at `root`; `named_dbs`: its leaves name sub-databases."""
        if root == _NO_PAGE:
            return None
        if depth > _MAX_DEPTH:
            return "its B-tree is deeper than any LMDB writes"
        page, problem = self._page(root, _P_BRANCH | _P_LEAF)
        if problem is not None:
            return problem
        flags, lower = _PAGE_HEADER.unpack_from(page)[2:4]
        for node_offset in self._node_offsets(page, lower):
            if node_offset is None:
                return f"page {root} has a node outside the page"
            lo, hi, node_flags, key_bytes = _NODE.unpack_from(page, node_offset)
            if node_offset + _NODE.size + key_bytes > self._page_bytes:
                return f"page {root} has a key past its end"
            data_offset = node_offset + _NODE.size + key_bytes
            if flags & _P_BRANCH:
                problem = self.tree(lo | hi << 16 | node_flags << 32, named_dbs, depth + 1)
            elif node_flags & _F_BIGDATA:
                if data_offset + 8 > self._page_bytes:
                    return f"page {root} has a value past its end"
                problem = self._overflow(struct.unpack_from("<Q", page, data_offset)[0])
            elif named_dbs and node_flags & _F_SUBDATA:
                if data_offset + 48 > self._page_bytes:
                    return f"page {root} has a database record past its end"
                sub_root = struct.unpack_from("<Q", page, data_offset + _DB_ROOT_OFFSET)[0]
                problem = self.tree(sub_root, named_dbs=False)
            if problem is not None:
                return problem
        return None

    def _page(self, number: int, kinds: int) -> tuple[bytes, str | None]:
        if not 2 <= number <= self._last_page:
            return b"", f"a B-tree points at page {number}, outside the file"
        if number in self._seen:
            return b"", f"page {number} is reached twice"
        self._seen.add(number)
        page = os.pread(self._fd, self._page_bytes, number * self._page_bytes)
        if len(page) < self._page_bytes:
            return b"", f"page {number} is cut short"
        header_number, _, flags = _PAGE_HEADER.unpack_from(page)[:3]
        if header_number != number or not flags & kinds:
            return b"", f"page {number} is not the page its parent points at (damaged)"
        return page, None

    def _node_offsets(self, page: bytes, lower: int) -> list[int | None]:
        count = (lower - _PAGE_HEADER.size) // 2
        if lower > self._page_bytes or count < 0:
            return [None]
        offsets = struct.unpack_from(f"<{count}H", page, _PAGE_HEADER.size)
        return [o if _PAGE_HEADER.size <= o <= self._page_bytes - _NODE.size else None
                for o in offsets]

    def _overflow(self, number: int) -> str | None:
        page, problem = self._page(number, _P_OVERFLOW)
        if problem is not None:
            return problem
        num_pages = struct.unpack_from("<I", page, 12)[0]
        if num_pages < 1 or number + num_pages - 1 > self._last_page:
            return f"overflow page {number} runs past the file"
        return None
