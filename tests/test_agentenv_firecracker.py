"""The Firecracker API client against a fake API server that enforces the documented call order and request
shapes (no VM boots here: the real-VM path reports 'backend unavailable' with its reason)."""
import pytest

from k3.agentenv.backends.firecracker import (FakeFirecracker, FirecrackerAPIError, FirecrackerBackend,
                                              FirecrackerClient)


@pytest.fixture
def fc(tmp_path):
    fake = FakeFirecracker(tmp_path / "fc.sock")
    yield fake, FirecrackerClient(fake.socket_path), tmp_path
    fake.close()


def test_documented_lifecycle_in_order(fc):
    fake, c, d = fc
    c.boot("/k/vmlinux", "/k/rootfs.ext4", "/k/ws.ext4", vcpus=1, mem_mib=128, vsock_uds=str(d / "v.sock"))
    assert c.describe()["state"] == "Running"
    c.pause()
    c.snapshot_create(str(d / "snap"), str(d / "mem"))
    c.resume()
    paths = [p for _, p, _ in fake.calls]
    assert paths == ["/machine-config", "/boot-source", "/drives/rootfs", "/drives/workspace", "/vsock", "/actions",
                     "/vm", "/snapshot/create", "/vm"]
    # a fresh process loads the snapshot and runs
    fresh = FakeFirecracker(d / "fc2.sock")
    try:
        FirecrackerClient(fresh.socket_path).snapshot_load(str(d / "snap"), str(d / "mem"), resume=True)
        assert fresh.state == "Running"
    finally:
        fresh.close()


@pytest.mark.parametrize("bad", ["start_first", "snapshot_running", "config_after_boot", "load_after_config",
                                 "pause_unbooted", "two_roots"])
def test_out_of_order_calls_rejected(fc, bad):
    fake, c, d = fc
    with pytest.raises(FirecrackerAPIError) as e:
        if bad == "start_first":
            c.machine_config(1, 128)
            c.start()  # no boot source, no root drive
        elif bad == "snapshot_running":
            c.boot("/k", "/r", "/w", 1, 128, str(d / "v"))
            c.snapshot_create(str(d / "s"), str(d / "m"))
        elif bad == "config_after_boot":
            c.boot("/k", "/r", "/w", 1, 128, str(d / "v"))
            c.machine_config(2, 256)
        elif bad == "load_after_config":
            c.machine_config(1, 128)
            c.snapshot_load(str(d / "s"), str(d / "m"))
        elif bad == "pause_unbooted":
            c.pause()
        elif bad == "two_roots":
            c.drive("a", "/r", root=True, read_only=True)
            c.drive("b", "/r2", root=True, read_only=True)
    assert e.value.status == 400 and e.value.fault


@pytest.mark.parametrize("body", [{"vcpu_count": "1", "mem_size_mib": 128}, {"vcpu_count": 1},
                                  {"vcpu_count": 1, "mem_size_mib": 128, "bogus": 1}, [1, 2]])
def test_bad_shapes_rejected(fc, body):
    fake, c, _ = fc
    with pytest.raises(FirecrackerAPIError, match="400"):
        c.request("PUT", "/machine-config", body)
    assert fake.calls == []


def test_real_backend_says_why_unavailable():
    ok, reason = FirecrackerBackend().available()
    assert not ok and reason
    with pytest.raises(Exception, match="backend unavailable: firecracker"):
        FirecrackerBackend().create()
