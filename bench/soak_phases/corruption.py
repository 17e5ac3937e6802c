"""Soak phase `corruption`: flip bytes of disk pages while the daemon runs and while it is stopped.

Each flipped page must be reported (a failed recall, `check(verify_bytes=True)`), never served,
and then be a miss.
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path

from kvtier.tiers.disk import DISK_ALIGNMENT
from kvtier.tiers.page_format import HEADER, MAGIC
from kvtier.tiers.page_format import HEADER_BYTES as PAGE_HEADER_BYTES
from soak_phases.common import (
    PAGE_BYTES,
    Figures,
    Pager,
    chunks,
    key_of,
    running_daemon,
    serve_args,
)


def slot_offsets(slot_file: Path) -> dict[bytes, int]:
    """{key: offset of its slot} from the page headers in a slot file (slots start at 64 bytes)."""
    data = slot_file.read_bytes()
    offsets = {}
    for match in re.finditer(re.escape(MAGIC), data):
        offset = match.start()
        if offset % DISK_ALIGNMENT == 0:
            fields = HEADER.unpack_from(data, offset)
            offsets[fields[5]] = offset
    return offsets


def flip_bytes(slot_file: Path, offset: int, rng: random.Random, in_header: bool) -> None:
    """Invert one byte of a page's header or payload in place."""
    if in_header:
        position = offset + rng.choice((0, 20, 36, 56))  # magic, fingerprint, key, checksum
    else:
        position = offset + PAGE_HEADER_BYTES + rng.randrange(PAGE_BYTES)
    with open(slot_file, "r+b") as file:
        file.seek(position)
        byte = file.read(1)
        file.seek(position)
        file.write(bytes([byte[0] ^ 0xFF]))
        file.flush()
        os.fsync(file.fileno())


def phase_corruption(work: Path, num_flips: int, rng: random.Random) -> Figures:
    """Flip bytes of disk pages while the daemon runs and while it is stopped."""
    socket_path, disk_path = work / "cr.sock", work / "cr-disk"
    slot_file = disk_path / "pages.slots"
    args = serve_args(disk_path, "1MiB", "16MiB", "--write-policy", "write-through")
    keys = [key_of("corrupt", i) for i in range(256)]
    figures: Figures = {"flipped_running": 0, "flipped_stopped": 0, "corrupt_served": 0,
                        "corrupt_reported": 0, "corrupt_listed_after": 0,
                        "reported_by_check": 0, "check_after_problems": 0, "wrong_pages": 0,
                        "lost_pages": 0}
    with running_daemon(socket_path, *args) as daemon:
        pager = Pager(socket_path, "corrupt")
        try:
            for batch in chunks(keys, 64):
                assert not pager.store(batch)
            tiers = pager.client.lookup(pager.handle, keys).tiers
            disk_only = [k for k, tier in zip(keys, tiers) if tier == "disk"]
            offsets = slot_offsets(slot_file)
            victims = rng.sample(disk_only, num_flips)
            for index, key in enumerate(victims):
                flip_bytes(slot_file, offsets[key], rng, in_header=index % 4 == 0)
            figures["flipped_running"] = len(victims)
            figures.update(_judge_corrupt(pager, victims))
        finally:
            pager.close()
        daemon.stop(30)
    kept = [k for k in keys if k not in set(victims)]
    offsets = slot_offsets(slot_file)
    stopped_victims = rng.sample(kept, num_flips)
    for index, key in enumerate(stopped_victims):
        flip_bytes(slot_file, offsets[key], rng, in_header=index % 4 == 1)
    figures["flipped_stopped"] = len(stopped_victims)
    with running_daemon(socket_path, *args) as daemon:
        pager = Pager(socket_path, "corrupt")
        try:
            figures["check_problems"] = len(pager.client.check())
            problems = pager.client.check(verify_bytes=True)
            figures["reported_by_check"] = sum(
                any(key.hex() in problem for problem in problems) for key in stopped_victims)
            stopped = _judge_corrupt(pager, stopped_victims)
            for name, value in stopped.items():
                figures[name] += value
            sound = [k for k in kept if k not in set(stopped_victims)]
            served, num_wrong, _ = pager.recall(sound)
            figures["wrong_pages"] = num_wrong
            figures["lost_pages"] = len(set(sound) - served)
            figures["check_after_problems"] = len(pager.client.check(verify_bytes=True))
        finally:
            pager.close()
    return figures


def _judge_corrupt(pager: Pager, victims: list[bytes]) -> Figures:
    """Recall corrupted pages: each must be reported failed, never served, then be a miss."""
    served, num_wrong, failed = pager.recall(victims)
    return {"corrupt_served": len(served), "corrupt_reported": len(set(failed) & set(victims)),
            "corrupt_listed_after": len(set(victims) - pager.lookup_missing(victims)),
            "wrong_pages": num_wrong}
