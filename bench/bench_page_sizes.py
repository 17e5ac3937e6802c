"""Three models of different page bytes (64 KiB, 256 KiB, 2 MiB) on one node: do recalls keep
their pages, and what do the tiers hold?

    python bench/bench_page_sizes.py HOST_GIB DISK_GIB meta|bytes REQUESTS RECENT_BATCHES
    python bench/bench_page_sizes.py 1 2 meta 3000 120

Seeded: REQUESTS requests of 8 MiB each, to a random model; half of them (when it has pages)
recall one of that model's last RECENT_BATCHES stores, the rest store new pages. Prints the tiers'
chunking, how many recalled pages were in no tier right after their recall (must be 0), the
evictions, the pages dropped, the tiers' occupancy and `check()`. `meta` runs a metadata-only
store (placement and the cascade, no bytes), `bytes` a real one (arena and slot file).
"""
import pathlib
import random
import shutil
import sys
import tempfile
import time

import numpy as np

from kvtier.config import DiskConfig, HostConfig, StoreConfig
from kvtier.keys import Namespace
from kvtier.store.page_store import PageStore

host_gib, disk_gib, with_bytes = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3] == "bytes"
steps = int(sys.argv[4])
d = tempfile.mkdtemp(prefix="kvtier-prod-", dir="/tmp")
s = PageStore(StoreConfig(host=HostConfig(capacity_bytes=int(host_gib * (1 << 30)),
                                          prefault=False),
                          disk=DiskConfig(path=pathlib.Path(d),
                                          capacity_bytes=int(disk_gib * (1 << 30))),
                          with_bytes=with_bytes))
models = [Namespace(f"m{pb}", "bfloat16", "page-first", 16, pb)
          for pb in (64 << 10, 256 << 10, 2 << 20)]
rng = random.Random(0)
batches = {m.fingerprint: [] for m in models}
lost = recalled_pages = recalls = 0
t0 = time.time()
for _ in range(steps):
    m = rng.choice(models)
    n = max(1, (8 << 20) // m.page_bytes)  # 8 MiB per request
    if batches[m.fingerprint] and rng.random() < 0.5:
        keys = rng.choice(batches[m.fingerprint][-int(sys.argv[5]):])
        out = np.zeros((len(keys), m.page_bytes), np.uint8) if with_bytes else None
        r = s.recall(m, keys, out)
        recalls += 1
        recalled_pages += len(r.recalled)
        after = s.lookup(m, r.recalled).tiers
        lost += sum(t is None for t in after)
    else:
        keys = [rng.randbytes(16) for _ in range(n)]
        pages = np.zeros((n, m.page_bytes), np.uint8) if with_bytes else None
        assert s.store(m, keys, pages).ok
        batches[m.fingerprint].append(keys)
st = s.stats()
print(f"host {host_gib} GiB chunk {s.host.slots.chunk_bytes >> 20} MiB x{s.host.slots.num_chunks}, "
      f"disk {disk_gib} GiB chunk {s.disk.slots.chunk_bytes >> 20} MiB x{s.disk.slots.num_chunks}; "
      f"{steps} requests of 8 MiB, {recalls} recalls of {recalled_pages} pages: "
      f"{lost} recalled pages in no tier right after; evictions host {st.tier('host').evictions} "
      f"disk {st.tier('disk').evictions}; dropped {getattr(st.counters, 'pages_dropped', 'n/a')}; "
      f"demotion failures {st.counters.demotion_failures}; "
      f"host {st.tier('host').used_bytes / st.tier('host').capacity_bytes:.0%} used, "
      f"disk {st.tier('disk').used_bytes / st.tier('disk').capacity_bytes:.0%}; "
      f"check {s.check()}; {time.time() - t0:.1f} s")
s.close()
shutil.rmtree(d, ignore_errors=True)
