"""GPU pools registered through CUDA IPC handles.

Without CuPy (CI), the daemon refuses a device pool with a clear error and carries on. On a GPU
machine (`gpu` marker), a pool in device memory stores and recalls byte-identical pages, in both
layouts, through a real daemon.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from kvtier.client import DaemonReplyError
from kvtier.ipc import messages as m
from kvtier.testing import daemon as harness

REFUSED_LAYOUT = harness.make_layout("page-first", 8)


def refusal(daemon, name: str, code: str = "bad_request", **fields) -> str:
    """Register a device pool of REFUSED_LAYOUT with `fields` (a made-up handle unless one is
    given); assert it is refused with `code` and that the daemon serves on; return why."""
    namespace = harness.namespace_for(REFUSED_LAYOUT, name)
    with daemon.client("device-test") as client:
        with pytest.raises(DaemonReplyError) as error:
            client._call(m.RegisterPool(
                client._next_id(), m.NamespaceSpec(**harness.namespace_spec(namespace)), "",
                m.LayoutSpec(**harness.layout_spec(REFUSED_LAYOUT)),
                size_bytes=REFUSED_LAYOUT.span_bytes, **{"cuda_ipc_handle": bytes(64), **fields}))
        assert error.value.code == code
        client.ping()  # the connection and the daemon carry on
    return str(error.value)


def assert_round_trip(daemon, cupy, memory, layout, namespace, seed: int) -> None:
    """Random pages in the pool's first half, stored, recalled into its second half: the same
    bytes in both halves, and a sound store."""
    pages = memory.pages(layout)
    half = layout.num_pages // 2
    rng = np.random.default_rng(seed)
    source = rng.integers(0, 256, (half, *pages.shape[1:]), dtype=np.uint8)
    pages[:half] = cupy.asarray(source)
    cupy.cuda.get_current_stream().synchronize()  # landed before the daemon reads the pool
    keys = harness.random_keys(rng, half)
    with daemon.client("device-test") as client:
        handle = client.register_device_pool(namespace, memory, layout)
        assert client.store(handle, keys, range(half)).result().ok
        assert client.recall(handle, keys, range(half, 2 * half)).result().ok
        np.testing.assert_array_equal(cupy.asnumpy(pages[half : 2 * half]), source)
        np.testing.assert_array_equal(cupy.asnumpy(pages[:half]), source)  # source untouched
        assert client.check(verify_bytes=True) == []


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None,
                    reason="CuPy is installed: the daemon can open device pools here")
def test_device_pool_without_cupy_is_refused_clearly(daemon) -> None:
    assert "CuPy" in refusal(daemon, "device-refused", code="backend_unavailable")


def test_a_negative_offset_into_a_device_allocation_is_refused(daemon) -> None:
    why = refusal(daemon, "device-negative", cuda_ipc_offset=-4096)
    assert "offset" in why and "negative" in why


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["page-first", "layer-first"])
def test_device_pool_store_and_recall_are_byte_identical(daemon, cupy, kind: str) -> None:
    from kvtier.client import DeviceMemory

    layout = harness.make_layout(kind, 32)
    namespace = harness.namespace_for(layout, f"device-{kind}", kind)
    assert_round_trip(daemon, cupy, DeviceMemory.allocate(layout), layout, namespace, seed=7)


@pytest.mark.gpu
def test_a_pool_inside_a_larger_allocation_is_found_at_its_offset(daemon, cupy) -> None:
    """A CUDA IPC handle maps the whole allocation holding a buffer: a pool that starts inside
    one (as one carved from an engine's own memory does) travels with its offset."""
    from kvtier.client import DeviceMemory

    layout = harness.make_layout("layer-first", 16)
    namespace = harness.namespace_for(layout, "device-offset", "layer-first")
    lead_bytes = 3 << 12
    allocation = cupy.zeros(lead_bytes + layout.span_bytes, dtype=cupy.uint8)
    memory = DeviceMemory(cupy, allocation[lead_bytes:], 0)
    assert memory.ipc_offset >= lead_bytes
    assert_round_trip(daemon, cupy, memory, layout, namespace, seed=11)
    assert not cupy.asnumpy(allocation[:lead_bytes]).any()  # nothing before the pool written


@pytest.mark.gpu
def test_memory_another_library_allocated_is_a_pool(daemon, cupy) -> None:
    """`DeviceMemory.wrap`: what the vLLM connector registers (vLLM's own KV allocation)."""
    from kvtier.client import DeviceMemory

    layout = harness.make_layout("layer-first", 16)
    namespace = harness.namespace_for(layout, "device-wrapped", "layer-first")
    owner = cupy.zeros(layout.span_bytes, dtype=cupy.uint8)
    memory = DeviceMemory.wrap(owner.data.ptr, layout.span_bytes, 0, owner)
    assert memory.size_bytes == layout.span_bytes
    assert_round_trip(daemon, cupy, memory, layout, namespace, seed=13)


@pytest.mark.gpu
def test_a_torch_cuda_tensor_is_a_pool_as_the_vllm_worker_registers_it(daemon, cupy) -> None:
    """The vLLM worker on a GPU wraps vLLM's KV tensor: memory from torch's caching allocator,
    usually inside a larger segment than the tensor."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    from kvtier.client import DeviceMemory

    layout = harness.make_layout("layer-first", 16)
    namespace = harness.namespace_for(layout, "device-torch", "layer-first")
    tensor = torch.zeros(layout.span_bytes, dtype=torch.uint8, device="cuda:0")
    memory = DeviceMemory.wrap(tensor.data_ptr(), layout.span_bytes, 0, owner=tensor)
    assert_round_trip(daemon, cupy, memory, layout, namespace, seed=17)


@pytest.mark.gpu
def test_a_pool_claiming_more_than_its_allocation_is_refused(daemon, cupy) -> None:
    from kvtier.client import DeviceMemory

    memory = DeviceMemory.allocate(REFUSED_LAYOUT)
    assert "runs past" in refusal(daemon, "device-too-big", cuda_ipc_handle=memory.ipc_handle,
                                  cuda_ipc_offset=64 << 20)


@pytest.mark.gpu
def test_a_pool_on_a_gpu_the_daemon_does_not_see_is_refused(daemon, cupy) -> None:
    """Engines pinned to one GPU count it as device 0 whatever it is: the daemon finds the GPU
    by its PCI address, and says so when it has none there."""
    from kvtier.client import DeviceMemory

    memory = DeviceMemory.allocate(REFUSED_LAYOUT)
    assert memory.pci_bus_id  # sent with every device pool
    assert "no GPU at PCI address" in refusal(daemon, "device-elsewhere",
                                              cuda_ipc_handle=memory.ipc_handle,
                                              cuda_pci_bus_id="0000:ff:1f.0")
