"""Firecracker backend, written against Firecracker's documented HTTP API on a Unix socket: PUT
/machine-config, /boot-source, /drives/{id}, /vsock, /actions InstanceStart; PATCH /vm {"state": "Paused" |
"Resumed"}; PUT /snapshot/create (paused VM only) and /snapshot/load (fresh process, before any boot config).
`FakeFirecracker` is an in-process API server enforcing that call order and those request shapes; it is what the
tests drive here. Real VMs need the `firecracker` binary, a guest kernel and rootfs (K3_FC_KERNEL, K3_FC_ROOTFS)
and a guest that actually boots; where any is missing the backend reports "backend unavailable: reason"."""
from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import socketserver
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path

from k3.agentenv.api import Backend, SandboxError, SandboxSpec, Snapshot


class FirecrackerAPIError(SandboxError):
    def __init__(self, status: int, method: str, path: str, fault: str):
        super().__init__(f"firecracker {method} {path} -> {status}: {fault}")
        self.status, self.fault = status, fault


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float = 10.0):
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.unix_path)


class FirecrackerClient:
    """A thin client of one Firecracker process's API socket."""

    def __init__(self, socket_path: str | Path, timeout: float = 10.0):
        self.socket_path, self.timeout = str(socket_path), timeout

    def request(self, method: str, path: str, body: dict | None = None) -> dict | None:
        conn = _UnixHTTPConnection(self.socket_path, self.timeout)
        try:
            data = json.dumps(body).encode() if body is not None else None
            conn.request(method, path, body=data, headers={"Content-Type": "application/json",
                                                            "Accept": "application/json"})
            resp = conn.getresponse()
            raw = resp.read()
        finally:
            conn.close()
        if resp.status >= 300:
            try:
                fault = json.loads(raw).get("fault_message", raw.decode())
            except ValueError:
                fault = raw.decode(errors="replace")
            raise FirecrackerAPIError(resp.status, method, path, fault)
        return json.loads(raw) if raw else None

    # the documented calls, one method each
    def machine_config(self, vcpus: int, mem_mib: int, smt: bool = False) -> None:
        self.request("PUT", "/machine-config", {"vcpu_count": vcpus, "mem_size_mib": mem_mib, "smt": smt})

    def boot_source(self, kernel: str, boot_args: str = "console=ttyS0 reboot=k panic=1 pci=off") -> None:
        self.request("PUT", "/boot-source", {"kernel_image_path": kernel, "boot_args": boot_args})

    def drive(self, drive_id: str, path: str, root: bool, read_only: bool) -> None:
        self.request("PUT", f"/drives/{drive_id}", {"drive_id": drive_id, "path_on_host": path,
                                                    "is_root_device": root, "is_read_only": read_only})

    def vsock(self, guest_cid: int, uds_path: str) -> None:
        self.request("PUT", "/vsock", {"guest_cid": guest_cid, "uds_path": uds_path})

    def start(self) -> None:
        self.request("PUT", "/actions", {"action_type": "InstanceStart"})

    def pause(self) -> None:
        self.request("PATCH", "/vm", {"state": "Paused"})

    def resume(self) -> None:
        self.request("PATCH", "/vm", {"state": "Resumed"})

    def snapshot_create(self, snapshot_path: str, mem_file_path: str) -> None:
        self.request("PUT", "/snapshot/create", {"snapshot_type": "Full", "snapshot_path": snapshot_path,
                                                 "mem_file_path": mem_file_path})

    def snapshot_load(self, snapshot_path: str, mem_file_path: str, resume: bool = True) -> None:
        self.request("PUT", "/snapshot/load", {"snapshot_path": snapshot_path,
                                               "mem_backend": {"backend_type": "File", "backend_path": mem_file_path},
                                               "resume_vm": resume})

    def describe(self) -> dict:
        return self.request("GET", "/")

    def boot(self, kernel: str, rootfs: str, workspace: str, vcpus: int, mem_mib: int, vsock_uds: str) -> None:
        """The documented order: machine config, boot source, drives, vsock, then InstanceStart."""
        self.machine_config(vcpus, mem_mib)
        self.boot_source(kernel)
        self.drive("rootfs", rootfs, root=True, read_only=True)
        self.drive("workspace", workspace, root=False, read_only=False)
        self.vsock(3, vsock_uds)
        self.start()


# ---- the fake API server ----------------------------------------------------------------------------------
_SHAPES = {
    "/machine-config": ({"vcpu_count": int, "mem_size_mib": int}, {"smt": bool, "track_dirty_pages": bool}),
    "/boot-source": ({"kernel_image_path": str}, {"boot_args": str, "initrd_path": str}),
    "/drives/": ({"drive_id": str, "path_on_host": str, "is_root_device": bool, "is_read_only": bool}, {}),
    "/vsock": ({"guest_cid": int, "uds_path": str}, {"vsock_id": str}),
    "/actions": ({"action_type": str}, {}),
    "/vm": ({"state": str}, {}),
    "/snapshot/create": ({"snapshot_path": str, "mem_file_path": str}, {"snapshot_type": str, "version": str}),
    "/snapshot/load": ({"snapshot_path": str}, {"mem_backend": dict, "mem_file_path": str, "resume_vm": bool,
                                                 "enable_diff_snapshots": bool}),
}


def _check_shape(key: str, body) -> str | None:
    need, optional = _SHAPES[key]
    if not isinstance(body, dict):
        return "request body must be a JSON object"
    for k, t in need.items():
        if k not in body:
            return f"missing field {k!r}"
        if not isinstance(body[k], t) or (t is int and isinstance(body[k], bool)):
            return f"field {k!r} must be {t.__name__}"
    for k in body:
        if k not in need and k not in optional:
            return f"unknown field {k!r}"
        if k in optional and not isinstance(body[k], optional[k]):
            return f"field {k!r} must be {optional[k].__name__}"
    return None


class FakeFirecracker:
    """Serves Firecracker's API on a Unix socket, keeping its state machine: configuration only before boot,
    InstanceStart needs machine-config, boot-source and a root drive; pause/resume only when booted;
    snapshot/create only while paused; snapshot/load only on a fresh (unconfigured, never booted) instance.
    Every accepted call is appended to `calls`; bad shapes get 400 with Firecracker's `fault_message`."""

    def __init__(self, socket_path: str | Path):
        self.socket_path = str(socket_path)
        self.calls: list[tuple[str, str, dict | None]] = []
        self.state = "Not started"
        self.config: dict = {"drives": {}}
        self.snapshots: dict[str, dict] = {}
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _reply(self, status: int, body: dict | None = None):
                data = json.dumps(body).encode() if body is not None else b""
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _body(self):
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) if n else b""
                return json.loads(raw) if raw else None

            def do_GET(self):
                if self.path == "/":
                    return self._reply(200, {"id": "fake", "state": fake.state, "vmm_version": "fake"})
                if self.path == "/machine-config" and "machine" in fake.config:
                    return self._reply(200, fake.config["machine"])
                self._reply(400, {"fault_message": f"unsupported GET {self.path}"})

            def do_PUT(self):
                self._handle("PUT")

            def do_PATCH(self):
                self._handle("PATCH")

            def _handle(self, method):
                try:
                    body = self._body()
                except ValueError:
                    return self._reply(400, {"fault_message": "body is not JSON"})
                status, fault = fake.apply(method, self.client_address, self.path, body)
                if status >= 300:
                    return self._reply(status, {"fault_message": fault})
                fake.calls.append((method, self.path, body))
                self._reply(204)

        class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
            daemon_threads = True

        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)
        self.server = Server(self.socket_path, Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def apply(self, method: str, _addr, path: str, body) -> tuple[int, str]:
        key = "/drives/" if path.startswith("/drives/") else path
        if key not in _SHAPES or method != ("PATCH" if key == "/vm" else "PUT"):
            return 400, f"invalid request: {method} {path}"
        err = _check_shape(key, body)
        if err:
            return 400, err
        booted = self.state in ("Running", "Paused")
        if key in ("/machine-config", "/boot-source", "/drives/", "/vsock"):
            if booted or self.config.get("loaded"):
                return 400, f"{path}: the operation is not allowed after boot"
            if key == "/drives/":
                if path[len("/drives/"):] != body["drive_id"]:
                    return 400, "drive_id in the path and body differ"
                if body["is_root_device"] and any(d["is_root_device"] for i, d in self.config["drives"].items()
                                                  if i != body["drive_id"]):
                    return 400, "a root drive is already configured"
                self.config["drives"][body["drive_id"]] = body
            else:
                self.config[key.strip("/")] = body
                if key == "/machine-config":
                    self.config["machine"] = body
            return 204, ""
        if key == "/actions":
            if body["action_type"] != "InstanceStart":
                return 400, f"unsupported action {body['action_type']!r}"
            if booted:
                return 400, "the instance is already started"
            missing = [k for k in ("machine-config", "boot-source") if k not in self.config]
            if not any(d["is_root_device"] for d in self.config["drives"].values()):
                missing.append("root drive")
            if missing:
                return 400, f"cannot start: missing {missing}"
            self.state = "Running"
            return 204, ""
        if key == "/vm":
            if body["state"] not in ("Paused", "Resumed"):
                return 400, f"state must be Paused or Resumed, got {body['state']!r}"
            if not booted:
                return 400, "the microVM is not running"
            self.state = "Paused" if body["state"] == "Paused" else "Running"
            return 204, ""
        if key == "/snapshot/create":
            if self.state != "Paused":
                return 400, "cannot create a snapshot: the microVM must be paused"
            self.snapshots[body["snapshot_path"]] = {"mem": body["mem_file_path"], "config": dict(self.config)}
            Path(body["snapshot_path"]).write_text(json.dumps({"fake_vmstate": True}))
            Path(body["mem_file_path"]).write_bytes(b"\0" * 16)
            return 204, ""
        if key == "/snapshot/load":
            if booted or len(self.config) > 1 or self.config["drives"]:
                return 400, "loading a snapshot is only allowed before any configuration or boot"
            if not Path(body["snapshot_path"]).is_file():
                return 400, f"snapshot file {body['snapshot_path']} not found"
            mem = body.get("mem_backend", {}).get("backend_path") or body.get("mem_file_path")
            if not mem or not Path(mem).is_file():
                return 400, "memory file not found (mem_backend.backend_path)"
            self.config["loaded"] = True
            self.state = "Running" if body.get("resume_vm") else "Paused"
            return 204, ""
        return 400, "unreachable"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)


class FirecrackerBackend(Backend):
    """Real microVMs: needs the binary, readable /dev/kvm, K3_FC_KERNEL and K3_FC_ROOTFS (a rootfs whose init
    runs the guest agent on vsock), and a guest that boots. Not creatable here; see `available()`."""
    name = "firecracker"

    def available(self) -> tuple[bool, str]:
        if not shutil.which("firecracker"):
            return False, "firecracker binary not installed (not packaged by Debian)"
        if not os.access("/dev/kvm", os.R_OK | os.W_OK):
            return False, "/dev/kvm not accessible"
        kernel, rootfs = os.environ.get("K3_FC_KERNEL"), os.environ.get("K3_FC_ROOTFS")
        if not (kernel and Path(kernel).is_file() and rootfs and Path(rootfs).is_file()):
            return False, "guest kernel/rootfs not configured (set K3_FC_KERNEL and K3_FC_ROOTFS)"
        return False, "guest boot over vsock is not implemented in this build; API client is tested on a fake"

    def create(self, spec: SandboxSpec | None = None):
        self.require()

    def restore(self, snap: Snapshot):
        self.require()
