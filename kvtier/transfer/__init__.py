"""The transfer engine: full-duplex page copies between engine pools and the host arena.

`DuplexLanes(backend, arena)` runs a d2h lane (store) and an h2d lane (recall) at once; jobs
are `submit_store` / `submit_recall` (-> `LaneJob`, whose `result()` names failed keys in a
`TransferError`) and `rotate(swap_out, swap_in)`. Backends: `CpuBackend` (numpy, runs anywhere)
and `kvtier.transfer.cuda.CudaBackend` (CuPy, imported only when asked for).
"""

from kvtier.pools.layout import PoolMemory
from kvtier.transfer.cpu import CpuBackend
from kvtier.transfer.duplex import DuplexLanes, LaneStats, Rotation, Swap
from kvtier.transfer.jobs import Direction, LaneJob, PoolPageIds
from kvtier.transfer.staging import StagingRing

__all__ = ["CpuBackend", "Direction", "LaneJob", "LaneStats", "PoolMemory", "PoolPageIds",
           "Rotation", "StagingRing", "Swap", "DuplexLanes"]
