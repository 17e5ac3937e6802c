"""Client library: attach an engine to the kvtier daemon (the engine side of the socket).

`Client` (blocking) and `AsyncClient` (asyncio) speak the same verbs, each request built once in
`verbs`: `register_pool`, `register_sealed_pool`, `register_device_pool`, `open_namespace`,
`unregister_pool`, `lookup`, `store`, `recall`, `rotate`, `prefetch`, `pin` / `unpin`, `delete`,
`stats`, `check`, `ping`. `Client.store`, `recall` and `rotate` return a job at once; `job.result()`
waits for completion, which names exactly the keys that failed. An engine's pages live in a
`SharedPool` (a sealed memfd the daemon maps, on a machine without a GPU; `SegmentPool` is the same
by /dev/shm name, for a client that cannot send a descriptor) or a `DeviceMemory` (GPU memory, sent
as a CUDA IPC handle). Page bytes never travel over the socket.

Before saying hello both clients check who serves the socket (SO_PEERCRED, see `trust`): a
server of another uid than ours or root's could be another local user's fake, to whom
registering a pool would hand our pages. Reply frames are capped in size like requests.

Modules: `connection` (Client and its jobs), `async_connection` (AsyncClient), `verbs` (each
verb's request and reply), `results` (what verbs return), `trust`, `shared_pool`,
`device_memory`, `demo` (the demo's page workload).
"""

from kvtier.client.async_connection import AsyncClient
from kvtier.client.connection import MAX_REPLY_BYTES, Client, Job, PendingReply, RotateJob
from kvtier.client.device_memory import DeviceMemory
from kvtier.client.results import JobResult, LookupReply, PoolHandle, RotateResult
from kvtier.client.shared_pool import SegmentPool, SharedPool
from kvtier.client.trust import TRUSTED_SERVER_UIDS_ENV, check_server
from kvtier.client.verbs import CLIENT_VERBS
from kvtier.errors import DaemonReplyError, UntrustedServerError

__all__ = ["AsyncClient", "CLIENT_VERBS", "Client", "DaemonReplyError", "DeviceMemory", "Job",
           "JobResult", "LookupReply", "MAX_REPLY_BYTES", "PendingReply", "PoolHandle",
           "RotateJob", "RotateResult", "SegmentPool", "SharedPool", "TRUSTED_SERVER_UIDS_ENV",
           "UntrustedServerError", "check_server"]
