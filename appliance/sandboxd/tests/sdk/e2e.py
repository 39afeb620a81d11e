"""The public SDK (cocoonstack-sandbox 0.1.19, unmodified) against a live sandboxd with real VMs.

Run by `tests/e2e.rs` (feature `e2e`): the Rust test starts the real `sandboxd` binary with a
`base` pool and runs this script with `CHRYSALIS_PYTHON`.

Usage: python3 e2e.py <host:port | https://host:port> <root token> [CA file]
With an https origin the SDK runs over TLS (`ssl_context` trusting the CA file, ALPN http/1.1),
and so do this script's raw HTTP calls and raw `/ports` upgrades.
Prints `sdk e2e ok` as its last line when every check passed; any failure raises (exit != 0).
"""

import http.client
import io
import socket
import ssl
import sys
import tarfile
import time
import urllib.parse

from checks import expect_status, request, step, wait_until
from cocoonsandbox import APIError, Client, ExitError, SilkdError

addr, root = sys.argv[1], sys.argv[2]
cafile = sys.argv[3] if len(sys.argv) > 3 else None
origin = urllib.parse.urlsplit(addr if "://" in addr else f"http://{addr}")
tls = origin.scheme == "https"
node_host, node_port = origin.hostname, origin.port


def ssl_context():
    """A dedicated context per client (the SDK sets ALPN on it), trusting only the node's CA."""
    if not tls:
        return None
    return ssl.create_default_context(cafile=cafile)


def new_client(token=root):
    return Client(addr, api_token=token, timeout=60, ssl_context=ssl_context())


client = new_client()
print(f"-- over {'TLS' if tls else 'plain HTTP'}: {addr}", flush=True)








def raw(method, path, token, body=None):
    """A plain HTTP(S) call (routes the SDK does not use): returns (status, decoded JSON body)."""
    if tls:
        c = http.client.HTTPSConnection(node_host, node_port, timeout=60, context=ssl_context())
    else:
        c = http.client.HTTPConnection(node_host, node_port, timeout=60)
    return request(c, method, path, token, body)


def port_upgrade(sandbox, port, payload):
    """GET .../ports/{port} with Upgrade: tcp, then echo payload through the raw relay."""
    s = socket.create_connection((node_host, node_port), timeout=20)
    if tls:
        s = ssl_context().wrap_socket(s, server_hostname=node_host)
    with s:
        s.sendall(
            f"GET /v1/sandboxes/{sandbox.id}/ports/{port} HTTP/1.1\r\nHost: {origin.netloc}\r\n"
            f"Authorization: Bearer {sandbox.token}\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n\r\n".encode()
        )
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = s.recv(1)
            assert chunk, f"relay closed during the head: {head!r}"
            head += chunk
        assert head.startswith(b"HTTP/1.1 101 "), head
        s.sendall(payload)
        got = b""
        while len(got) < len(payload):
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
        s.shutdown(socket.SHUT_WR)
        return got


def warm(template="base"):
    for p in client.info()["pools"]:
        if p["key"]["template"] == template:
            return p["warm"]
    return 0


step("claim")
wait_until("a warm base VM", lambda: warm() > 0)
sb = client.new("base", ttl_seconds=600, claim_ref="e2e")
assert sb.id.startswith("sb_") and len(sb.id) == 19, sb.id
assert len(sb.token) == 32, sb.token

step("exec")
assert sb.exec("echo", "hi") == "hi\n"
assert sb.exec("sh", "-c", "echo $FOO", env={"FOO": "bar"}) == "bar\n"
assert sb.exec("pwd", cwd="/tmp") == "/tmp\n"
try:
    sb.exec("sh", "-c", "echo oops >&2; exit 3")
    raise AssertionError("want ExitError")
except ExitError as exc:
    assert (exc.code, exc.stderr) == (3, "oops\n"), exc

step("run with stdin")
out = bytearray()
payload = bytes(range(256)) * 512  # 128 KiB, every byte value
assert sb.run(["cat"], stdin=payload, on_stdout=out.extend) == 0
assert bytes(out) == payload, len(out)
assert sb.exec("wc", "-c", stdin=b"abcde").split() == ["5"]

step("files")
sb.mkdir("/tmp/e2e/sub/deeper", parents=True)
sb.write_file("/tmp/e2e/a.txt", b"hello world\n", mode=0o640)
assert sb.read_file("/tmp/e2e/a.txt") == b"hello world\n"
st = sb.stat("/tmp/e2e/a.txt")
assert st["kind"] == "file" and st["size"] == 12, st
assert st["mode"] & 0o777 == 0o640, st
assert sb.stat("/tmp/e2e/sub")["kind"] == "dir"
names = sorted(e["name"] for e in sb.list_dir("/tmp/e2e"))
assert names == ["a.txt", "sub"], names
sb.rename("/tmp/e2e/a.txt", "/tmp/e2e/b.txt")
assert sb.read_file("/tmp/e2e/b.txt") == b"hello world\n"
try:
    sb.read_file("/tmp/e2e/a.txt")
    raise AssertionError("want not_found")
except SilkdError as exc:
    assert exc.kind == "not_found", exc
big = bytes(i % 251 for i in range(3 * 1024 * 1024 + 17))  # several chunks
sb.write_file("/tmp/e2e/big.bin", big)
assert sb.read_file("/tmp/e2e/big.bin") == big
assert sb.exec("md5sum", "/tmp/e2e/big.bin").split()[0] == __import__("hashlib").md5(big).hexdigest()
sb.remove("/tmp/e2e/big.bin")
sb.remove("/tmp/e2e/sub", recursive=True)
names = sorted(e["name"] for e in sb.list_dir("/tmp/e2e"))
assert names == ["b.txt"], names

step("push/pull tar")
buf = io.BytesIO()
with tarfile.open(fileobj=buf, mode="w") as tf:
    for name, data in [("proj/main.py", b"print('needle')\n"), ("proj/lib/util.py", b"x = 'needle'\ny = 1\n")]:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        info.mode = 0o644
        tf.addfile(info, io.BytesIO(data))
sb.push("/tmp/up", buf.getvalue())
assert sb.read_file("/tmp/up/proj/lib/util.py") == b"x = 'needle'\ny = 1\n"
pulled = sb.pull("/tmp/up/proj")
with tarfile.open(fileobj=io.BytesIO(pulled)) as tf:
    files = {m.name.lstrip("./"): tf.extractfile(m).read() for m in tf.getmembers() if m.isfile()}
assert any(k.endswith("main.py") and v == b"print('needle')\n" for k, v in files.items()), files
assert any(k.endswith("lib/util.py") for k in files), files

step("find/replace")
matches = sb.find("/tmp/up", "needle")
paths = sorted(m["file"] for m in matches)
assert len(paths) == 2 and paths[0].endswith("lib/util.py") and paths[1].endswith("main.py"), matches
assert all(m["line"] == 1 and "needle" in m["content"] for m in matches), matches
only_main = sb.find("/tmp/up", "needle", glob="main.*")
assert len(only_main) == 1 and only_main[0]["file"].endswith("main.py"), only_main
replaced = sb.replace(["/tmp/up/proj/main.py", "/tmp/up/proj/lib/util.py"], "needle", "thread")
assert sorted(r["replacements"] for r in replaced) == [1, 1], replaced
assert sb.read_file("/tmp/up/proj/main.py") == b"print('thread')\n"

step("spawn/ps/logs/kill")
done_pid = sb.spawn("sh", "-c", "echo spawned-out; echo spawned-err >&2")
so, se = bytearray(), bytearray()
code = wait_until("spawned process to exit", lambda: sb.logs(done_pid, so.extend, se.extend) is not None or None)
so.clear()
se.clear()
assert sb.logs(done_pid, so.extend, se.extend) == 0
assert bytes(so) == b"spawned-out\n" and bytes(se) == b"spawned-err\n", (so, se)
sleeper = sb.spawn("sleep", "300")
rows = {p["pid"]: p for p in sb.ps()}
assert rows[sleeper]["state"] == "running" and rows[sleeper]["detached"], rows
assert rows[sleeper]["argv"] == ["sleep", "300"], rows
assert sb.logs(sleeper) is None  # still running
sb.kill(sleeper)
wait_until("killed process to show as exited", lambda: {p["pid"]: p for p in sb.ps()}[sleeper]["state"] != "running")
sb.kill(sleeper)  # already exited: no-op success

step("session")
with sb.session(cwd="/tmp") as sess:
    sess.exec("cd", "/tmp/up")
    sess.exec("export", "GREETING=howdy")
    assert sess.exec("pwd") == "/tmp/up\n"
    assert sess.exec("sh", "-c", "echo $GREETING") == "howdy\n"
    assert sess.id in sb.sessions()
assert sb.exec("pwd") != "/tmp/up\n"

step("pty")
pty = sb.open_pty(cols=100, rows=30)
pty.write(b"echo hi-from-$((40+2))\n")
seen = bytearray()
until = time.monotonic() + 30
while b"hi-from-42" not in seen:
    assert time.monotonic() < until, f"pty output never showed the echo: {bytes(seen)!r}"
    chunk = pty.read()
    assert chunk, f"pty closed early: {bytes(seen)!r}"
    seen.extend(chunk)
pty.resize(120, 40)
pty.write(b"exit 7\n")
while pty.read():
    pass
assert pty.exit_code == 7, pty.exit_code
pty.close()

step("dial_port")
listener = sb.spawn("nc", "-ll", "-p", "7000", "-e", "cat")


def try_echo():
    try:
        port = sb.dial_port(7000)
    except (SilkdError, APIError):
        return None
    try:
        port.send(b"ping-7000")
        got = bytearray()
        while len(got) < 9:
            chunk = port.recv()
            if not chunk:
                break
            got.extend(chunk)
        port.close_write()
        return bytes(got)
    finally:
        port.close()


assert wait_until("nc to listen on 7000", try_echo, timeout=30) == b"ping-7000"
# A local TCP listener that forwards into the guest port (proxy_port over dial_port).
lst = sb.proxy_port("127.0.0.1:0", 7000)
with socket.create_connection(lst.getsockname(), timeout=20) as s:
    s.sendall(b"via-proxy")
    got = b""
    while len(got) < 9:
        got += s.recv(64)
    assert got == b"via-proxy", got
lst.close()
assert port_upgrade(sb, 7000, b"raw-upgrade" * 1000) == b"raw-upgrade" * 1000
sb.kill(listener)
try:
    sb.dial_port(7999)
    raise AssertionError("want an error dialling a closed port")
except (SilkdError, APIError):
    pass

step("http exec")
status, body = raw("POST", f"/v1/sandboxes/{sb.id}/exec", sb.token, {"argv": ["sh", "-c", "echo out; echo err >&2; exit 5"]})
assert (status, body) == (200, {"exit_code": 5, "stdout": "out\n", "stderr": "err\n"}), (status, body)
status, body = raw("POST", f"/v1/sandboxes/{sb.id}/exec", sb.token, {"argv": ["sleep", "300"], "timeout_seconds": 1})
assert status == 504, (status, body)
# sandboxd kills the child via silkd before answering 504; silkd records the exit when it reaps it.
wait_until(
    "the timed-out exec child to be killed",
    lambda: not [p for p in sb.ps() if p["argv"] == ["sleep", "300"] and p["state"] == "running"],
    timeout=10,
)
status, body = raw("POST", f"/v1/sandboxes/{sb.id}/exec", sb.token, {"argv": []})
assert status == 400, (status, body)
status, body = raw("POST", f"/v1/sandboxes/{sb.id}/exec", "0" * 32, {"argv": ["true"]})
assert status == 404, (status, body)

step("renew")
before = sb.deadline
deadline = sb.renew(1200)
assert deadline.endswith("Z") and deadline > before, (before, deadline)
assert sb.renew().endswith("Z")  # 0 = node default (300 s)

step("sandboxes/info")
rows = client.sandboxes()
assert [r["id"] for r in rows] == [sb.id], rows
assert rows[0]["claim_ref"] == "e2e" and rows[0]["key"]["template"] == "base", rows
assert "token" not in rows[0], rows
info = client.info()
assert info["claimed"] == 1, info
assert info["pools"][0]["target"] == 2, info
assert client.lookup(sb.id, sb.token).id == sb.id

step("errors")
expect_status(401, lambda: new_client("").new("base"))  # no token at all
expect_status(401, lambda: new_client("wrong").new("base"))
expect_status(401, lambda: new_client("wrong").sandboxes())
expect_status(401, lambda: new_client("").info())
expect_status(400, lambda: client.new("base", ttl_seconds=-1))
expect_status(404, lambda: client.attach(addr, "sb_0000000000000000", "0" * 32).renew())
expect_status(404, lambda: client.attach(addr, sb.id, "0" * 32).renew())  # wrong token = unknown
expect_status(404, lambda: client.new("no-such-template"))

step("drain/uncordon")
drained = client.drain()
assert drained["draining"] is True, drained
assert all(p["warm"] == 0 for p in drained["pools"]), drained
expect_status(429, lambda: client.new("base"))
assert sb.exec("echo", "still-alive") == "still-alive\n"  # live claims run on
client.uncordon()
assert client.info()["draining"] is False
wait_until("refill after uncordon", lambda: warm() > 0)

step("second claim + close")
with client.new("base", ttl_seconds=60) as other:
    # A fresh VM: nothing from the first sandbox leaks into it.
    try:
        other.read_file("/tmp/e2e/b.txt")
        raise AssertionError("the second sandbox sees the first one's files")
    except SilkdError as exc:
        assert exc.kind == "not_found", exc
    assert other.exec("echo", "x") == "x\n"
    other_id = other.id
assert other_id not in [r["id"] for r in client.sandboxes()]
sb.close()
sb.close()  # 404 on a second release is success for the SDK
expect_status(404, lambda: client.attach(addr, sb.id, sb.token).renew())
assert client.sandboxes() == []
assert client.info()["claimed"] == 0
print("sdk e2e ok", flush=True)
