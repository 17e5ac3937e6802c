"""Engine pools: where a pool's pages are, and how the store reads and writes them.

An engine's KV pool is its own memory; the daemon reaches it as shared memory (a sealed memfd it
maps, or a segment it copies by descriptor) or as GPU memory opened through a CUDA IPC handle.
This package holds all of that below the tiers, the transfer lanes, the store, the daemon and
the client, which each use part of it:

- `layout`: pool geometry (`PoolLayout`, `PoolMemory`), shared by both sides of the socket;
- `page_access`: `PageAccess`, a request's pages as the store moves them, and `PageRows`, its
  in-process form (numpy arrays or buffers);
- `pool_pages`: the page-access kinds of a registered pool (`PoolPageAccess`, `PoolFilePages`,
  `MappedPoolPages`), `device` (`MappedDevicePool`, `DevicePoolPages`) for GPU pools;
- `pool_file` (a pool by descriptor, copied with system calls) and `sealed` (a sealed memfd,
  mapped): the daemon's two kinds of shared-memory pool.

Importing the package loads none of them, so a client that needs only the geometry loads only it.
"""
