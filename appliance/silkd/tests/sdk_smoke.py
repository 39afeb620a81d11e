"""Smoke check: the real cocoonsandbox SDK (unmodified) against a silkd Unix listener.

Usage: pip install cocoonstack-sandbox==0.1.19
       silkd --listen unix:/tmp/silkd.sock &
       python3 sdk_smoke.py /tmp/silkd.sock
The SDK's Sandbox is driven through a stand-in Client whose _dial returns a Conn over the
Unix socket, so every frame goes through the SDK's own Conn/frames code paths.
"""

import os
import shutil
import socket
import subprocess
import tempfile
import sys
import threading
import time

from cocoonsandbox.conn import Conn
from cocoonsandbox.errors import ExitError, SilkdError
from cocoonsandbox.sandbox import Sandbox


class FakeClient:
    keep_alive = 30.0
    timeout = 10.0

    def __init__(self, path):
        self.path = path
        self.dials = 0

    def _dial(self, owner, sandbox_id, token, deadline):
        self.dials += 1
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(self.path)
        return Conn(sock, sock.makefile("rb"))


def git_verbs(sb):
    """Every git verb of the SDK, through its own code, against the host's git."""
    root = tempfile.mkdtemp(prefix="silkd-sdk-git-")
    remote, work, other = f"{root}/remote.git", f"{root}/work", f"{root}/other"
    subprocess.run(["git", "init", "--quiet", "--bare", "-b", "main", remote], check=True)
    sb.git_clone(remote, work)
    sb.write_file(f"{work}/a.txt", b"one\n")
    st = sb.git_status(work)
    assert st["branch"] == "main" and st["files"] == [{"path": "a.txt", "staged": "?", "unstaged": "?"}], st
    sb.git_add(work, ["a.txt"])
    h = sb.git_commit(work, "first", "Ada <ada@example.com>")
    assert len(h) == 40, h
    sb.git_push(work)
    sb.git_clone(remote, other, branch="main", depth=1)
    sb.write_file(f"{work}/b.txt", b"two\n")
    sb.git_add(work, [])
    sb.git_commit(work, "second", "Ada <ada@example.com>")
    assert sb.git_status(work)["ahead"] == 1
    sb.git_push(work)
    sb.git_pull(other)
    assert sb.read_file(f"{other}/b.txt") == b"two\n"
    sb.git_create_branch(work, "feature")
    sb.git_checkout(work, "feature")
    br = sb.git_branches(work)
    assert br["current"] == "feature" and br["branches"] == ["feature", "main"], br
    sb.git_checkout(work, "main")
    sb.git_delete_branch(work, "feature")
    assert sb.git_branches(work)["branches"] == ["main"]
    try:
        sb.git_commit(work, "nothing staged", "Ada <ada@example.com>")
        raise AssertionError("expected bad_request")
    except SilkdError as e:
        assert e.kind == "bad_request" and "git commit failed" in str(e), e
    shutil.rmtree(root)


def main(path):
    client = FakeClient(path)
    sb = Sandbox(client, "sbx-test", "token", "owner")
    assert sb.exec("echo", "hello") == "hello\n"
    assert sb._proto == 2, sb._proto
    for i in range(20):
        assert sb.exec("sh", "-c", f"echo {i}") == f"{i}\n"
    assert client.dials == 1, f"keep-alive broken: {client.dials} dials"
    data = os.urandom(3 * 1024 * 1024)
    out = bytearray()
    assert sb.run(["cat"], stdin=data, on_stdout=out.extend) == 0
    assert bytes(out) == data
    try:
        sb.exec("sh", "-c", "echo bad >&2; exit 3")
        raise AssertionError("expected ExitError")
    except ExitError as e:
        assert e.args or True
    try:
        sb.exec()
        raise AssertionError("expected SilkdError")
    except SilkdError as e:
        assert e.kind == "bad_request", e.kind
    pid = sb.spawn("sh", "-c", "echo spawned; sleep 30")
    time.sleep(0.3)
    rows = {p["pid"]: p for p in sb.ps()}
    assert rows[pid]["detached"] and rows[pid]["state"] == "running", rows[pid]
    logs = bytearray()
    assert sb.logs(pid, on_stdout=logs.extend) is None
    assert bytes(logs) == b"spawned\n", logs
    got = {}

    def follow():
        buf = bytearray()
        got["code"] = sb.attach(pid, on_stdout=buf.extend)
        got["out"] = bytes(buf)

    t = threading.Thread(target=follow)
    t.start()
    time.sleep(0.3)
    sb.kill(pid)
    t.join(10)
    assert got == {"code": 137, "out": b"spawned\n"}, got
    assert sb.logs(pid) == 137
    sb.kill(pid)  # no-op once exited
    with sb.session(cwd="/") as s:
        s.exec("cd", "/tmp")
        s.exec("export", "A=1")
        assert s.exec("pwd") == "/tmp\n"
        assert s.exec("sh", "-c", "echo $A") == "1\n"
        assert s.id in sb.sessions()
    assert s.id not in sb.sessions()
    pty = sb.open_pty(cols=90, rows=30)
    pty.write(b"stty size; exit 2\n")
    seen = b""
    while True:
        chunk = pty.read()
        if not chunk:
            break
        seen += chunk
    assert b"30 90" in seen and pty.exit_code == 2, (seen, pty.exit_code)
    pty.close()
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def echo():
        c, _ = srv.accept()
        buf = b""
        while True:
            b = c.recv(65536)
            if not b:
                break
            buf += b
        c.sendall(buf[::-1])
        c.close()

    threading.Thread(target=echo, daemon=True).start()
    pc = sb.dial_port(port)
    pc.send(b"abcdef")
    pc.close_write()
    back = b""
    while True:
        chunk = pc.recv()
        if not chunk:
            break
        back += chunk
    assert back == b"fedcba", back
    pc.close()
    git_verbs(sb)
    try:
        sb.start_lsp("python")
        raise AssertionError("expected unimplemented")
    except SilkdError as e:
        assert e.kind == "unimplemented", e
    # fs ops (the fs engineer's) through the same engine
    sb.write_file("/tmp/silkd-sdk-smoke.txt", b"content")
    assert sb.read_file("/tmp/silkd-sdk-smoke.txt") == b"content"
    assert sb.stat("/tmp/silkd-sdk-smoke.txt")["size"] == 7
    sb.remove("/tmp/silkd-sdk-smoke.txt")
    print("sdk smoke OK; dials:", client.dials)


if __name__ == "__main__":
    main(sys.argv[1])
