"""GPU pools registered through CUDA IPC handles.

Without CuPy (CI), the daemon refuses a device pool with a clear error and carries on. On a GPU
machine (`gpu` marker), a pool in device memory stores and recalls byte-identical pages, in both
layouts, through a real daemon.
"""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest

from kvtier.client import DaemonReplyError
from kvtier.ipc import messages as m

harness = sys.modules["kvtier_daemon_harness"]  # loaded by tests/conftest.py


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None,
                    reason="CuPy is installed: the daemon can open device pools here")
def test_device_pool_without_cupy_is_refused_clearly(daemon) -> None:
    layout = harness.make_layout("page-first", 8)
    namespace = harness.namespace_for(layout, "device-refused")
    with daemon.client("device-test") as client:
        with pytest.raises(DaemonReplyError) as error:
            client._call(m.RegisterPool(client._next_id(),
                                        m.NamespaceSpec(**harness.namespace_spec(namespace)), "",
                                        m.LayoutSpec(**harness.layout_spec(layout)),
                                        cuda_ipc_handle=bytes(64), size_bytes=layout.span_bytes))
        assert error.value.code == "bad_request"
        assert "CuPy" in str(error.value)
        client.ping()  # the connection and the daemon carry on


def test_a_negative_offset_into_a_device_allocation_is_refused(daemon) -> None:
    layout = harness.make_layout("page-first", 8)
    namespace = harness.namespace_for(layout, "device-negative")
    with daemon.client("device-test") as client:
        with pytest.raises(DaemonReplyError) as error:
            client._call(m.RegisterPool(client._next_id(),
                                        m.NamespaceSpec(**harness.namespace_spec(namespace)), "",
                                        m.LayoutSpec(**harness.layout_spec(layout)),
                                        cuda_ipc_handle=bytes(64), size_bytes=layout.span_bytes,
                                        cuda_ipc_offset=-4096))
        assert error.value.code == "bad_request"
        assert "offset" in str(error.value) and "negative" in str(error.value)
        client.ping()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["page-first", "layer-first"])
def test_device_pool_store_and_recall_are_byte_identical(daemon, cupy, kind: str) -> None:
    from kvtier.device_pools import DeviceMemory

    layout = harness.make_layout(kind, 32)
    namespace = harness.namespace_for(layout, f"device-{kind}", kind)
    memory = DeviceMemory.allocate(layout)
    pages = memory.pages(layout)
    rng = np.random.default_rng(7)
    source = rng.integers(0, 256, (16, *pages.shape[1:]), dtype=np.uint8)
    pages[:16] = cupy.asarray(source)
    cupy.cuda.get_current_stream().synchronize()  # landed before the daemon reads the pool
    keys = harness.random_keys(rng, 16)
    with daemon.client("device-test") as client:
        handle = client.register_device_pool(namespace, memory, layout)
        assert client.store(handle, keys, range(16)).result().ok
        assert client.recall(handle, keys, range(16, 32)).result().ok
        np.testing.assert_array_equal(cupy.asnumpy(pages[16:32]), source)
        np.testing.assert_array_equal(cupy.asnumpy(pages[:16]), source)  # source untouched
        assert client.check(verify_bytes=True) == []


@pytest.mark.gpu
def test_a_pool_inside_a_larger_allocation_is_found_at_its_offset(daemon, cupy) -> None:
    """A CUDA IPC handle maps the whole allocation holding a buffer: a pool that starts inside
    one (as one carved from an engine's own memory does) travels with its offset."""
    from kvtier.device_pools import DeviceMemory

    layout = harness.make_layout("layer-first", 16)
    namespace = harness.namespace_for(layout, "device-offset", "layer-first")
    lead_bytes = 3 << 12
    allocation = cupy.zeros(lead_bytes + layout.span_bytes, dtype=cupy.uint8)
    memory = DeviceMemory(cupy, allocation[lead_bytes:], 0)
    assert memory.ipc_offset >= lead_bytes
    pages = memory.pages(layout)
    rng = np.random.default_rng(11)
    source = rng.integers(0, 256, (8, *pages.shape[1:]), dtype=np.uint8)
    pages[:8] = cupy.asarray(source)
    cupy.cuda.get_current_stream().synchronize()
    keys = harness.random_keys(rng, 8)
    with daemon.client("device-offset") as client:
        handle = client.register_device_pool(namespace, memory, layout)
        assert client.store(handle, keys, range(8)).result().ok
        assert client.recall(handle, keys, range(8, 16)).result().ok
        np.testing.assert_array_equal(cupy.asnumpy(pages[8:16]), source)
        assert not cupy.asnumpy(allocation[:lead_bytes]).any()  # nothing before the pool written
        assert client.check(verify_bytes=True) == []


@pytest.mark.gpu
def test_a_pool_claiming_more_than_its_allocation_is_refused(daemon, cupy) -> None:
    from kvtier.device_pools import DeviceMemory

    layout = harness.make_layout("page-first", 8)
    namespace = harness.namespace_for(layout, "device-too-big")
    memory = DeviceMemory.allocate(layout)
    with daemon.client("device-test") as client:
        with pytest.raises(DaemonReplyError) as error:
            client._call(m.RegisterPool(client._next_id(),
                                        m.NamespaceSpec(**harness.namespace_spec(namespace)), "",
                                        m.LayoutSpec(**harness.layout_spec(layout)),
                                        cuda_ipc_handle=memory.ipc_handle,
                                        size_bytes=layout.span_bytes,
                                        cuda_ipc_offset=64 << 20))
        assert error.value.code == "bad_request"
        assert "runs past" in str(error.value)
        client.ping()  # the daemon carries on


@pytest.mark.gpu
def test_a_pool_on_a_gpu_the_daemon_does_not_see_is_refused(daemon, cupy) -> None:
    """Engines pinned to one GPU count it as device 0 whatever it is: the daemon finds the GPU
    by its PCI address, and says so when it has none there."""
    from kvtier.device_pools import DeviceMemory

    layout = harness.make_layout("page-first", 8)
    namespace = harness.namespace_for(layout, "device-elsewhere")
    memory = DeviceMemory.allocate(layout)
    assert memory.pci_bus_id  # sent with every device pool
    with daemon.client("device-test") as client:
        with pytest.raises(DaemonReplyError) as error:
            client._call(m.RegisterPool(client._next_id(),
                                        m.NamespaceSpec(**harness.namespace_spec(namespace)), "",
                                        m.LayoutSpec(**harness.layout_spec(layout)),
                                        cuda_ipc_handle=memory.ipc_handle,
                                        size_bytes=layout.span_bytes,
                                        cuda_pci_bus_id="0000:ff:1f.0"))
        assert error.value.code == "bad_request"
        assert "no GPU at PCI address" in str(error.value)
        client.ping()
