"""The SDK's surface beyond the core verbs (issue #16), unmodified SDK 0.1.19 and its LangChain
and OpenAI Agents adapters with their default settings, against a live sandboxd with real VMs.

Run by `tests/sdk_surface_e2e.rs`: sandboxd on loopback with a `base` pool and an `rt` pool.

Usage: python3 surface.py <host:port> <root token>
Prints `sdk surface ok` as its last line when every check passed; any failure raises.
"""

import asyncio
import http.client
import io
import json
import socket
import urllib.parse
import sys
import time
from pathlib import Path

from checks import expect_status, request, step, wait_until
from cocoonsandbox import APIError, Client, SilkdError

addr, root = sys.argv[1], sys.argv[2]
host, port = addr.rsplit(":", 1)
client = Client(addr, api_token=root, timeout=120)






def raw(method, path, body=None, token=root):
    return request(http.client.HTTPConnection(host, int(port), timeout=60), method, path, token, body)


def new(template, **kw):
    """client.new, waiting out a warm miss (429) while the pool refills behind earlier claims
    (under load a refill can take longer than the script between two claims)."""
    until = time.monotonic() + 180
    while True:
        try:
            return client.new(template, **kw)
        except APIError as exc:
            if exc.status != 429 or time.monotonic() > until:
                raise
            time.sleep(0.5)


def pool_warm(template):
    """Whether a pool of `template` (any net and size) has a warm VM."""
    return any(p["key"]["template"] == template and p["warm"] >= 1 for p in raw("GET", "/v1/info")[1]["pools"])


def expect_silkd(kind, text, fn):
    try:
        fn()
    except SilkdError as exc:
        assert exc.kind == kind and text in str(exc), f"want {kind} with {text!r}, got {exc.kind}: {exc}"
        return
    raise AssertionError(f"want SilkdError {kind}")




def sandbox_rows():
    status, body = raw("GET", "/v1/sandboxes")
    assert status == 200, body
    return body["sandboxes"]


step("1. template names as users write them")
for name in ["rt:24.04", "ghcr.io/cocoonstack/sandbox/rt:24.04"]:
    with new(name, ttl_seconds=120) as sb:
        row = next(r for r in sandbox_rows() if r["id"] == sb.id)
        assert row["key"]["template"] == "rt", row
        assert sb.exec("python3", "-c", "print(6 * 7)").strip() == "42"
for name in ["rt:23.10", "sandbox/rt:24.04", "nginx:latest"]:
    expect_status(404, lambda: new(name, ttl_seconds=60))

step("2. fork: children start from the parent's memory and disk, then diverge")
with new("rt:24.04", ttl_seconds=300) as parent:
    parent.write_file("/srv/state.txt", b"before the fork\n")
    parent.exec("sh", "-c", "echo 41 > /tmp/counter")
    # A running process is memory state: the children inherit it, still running.
    sleeper = parent.spawn("sleep", "1000")
    children = parent.fork(2, ttl_seconds=120)
    assert len(children) == 2, children
    try:
        for i, child in enumerate(children):
            assert child.id != parent.id
            assert child.read_file("/srv/state.txt") == b"before the fork\n"
            assert child.read_file("/tmp/counter") == b"41\n"
            procs = {p["pid"]: p for p in child.ps()}
            assert procs.get(sleeper, {}).get("state") == "running", procs
            child.write_file("/srv/state.txt", f"child {i}\n".encode())
        assert [c.read_file("/srv/state.txt") for c in children] == [b"child 0\n", b"child 1\n"]
        assert parent.read_file("/srv/state.txt") == b"before the fork\n", "the parent keeps running, untouched"
        parent.write_file("/srv/after.txt", b"parent only\n")
        expect_silkd("not_found", "", lambda: children[0].read_file("/srv/after.txt"))
        # Bad input: a count of 0 or over max_fork_count, and another sandbox's token.
        for count in (0, 17):
            exc = expect_status(400, lambda: parent.fork(count))
            assert "max_fork_count" in str(exc), exc
        status, body = raw("POST", f"/v1/sandboxes/{parent.id}/fork", {"token": children[0].token, "count": 1})
        assert status == 404, (status, body)
    finally:
        for child in children:
            child.close()

step("3. checkpoints: create, list, claim from (twice), delete")
with new("rt:24.04", ttl_seconds=300) as sb:
    sb.write_file("/srv/setup.txt", b"prepared\n")
    ck = sb.checkpoint("after-setup")
    assert ck.id.startswith("ck_") and ck.name == "after-setup" and ck.sandbox_id == sb.id, vars(ck)
    sb.write_file("/srv/setup.txt", b"changed after the checkpoint\n")
    listed = [c for c in client.checkpoints() if c.id == ck.id]
    assert len(listed) == 1 and listed[0].name == "after-setup", [vars(c) for c in client.checkpoints()]
    status, info = raw("GET", "/v1/info")
    assert info["checkpoints"] >= 1 and info["checkpoint_disk_bytes"] > 0, info
    for _ in range(2):
        with ck.new(ttl_seconds=120) as branch:
            assert branch.from_checkpoint == ck.id
            assert branch.read_file("/srv/setup.txt") == b"prepared\n"
            branch.write_file("/srv/setup.txt", b"branched\n")
    # A handle made from the id alone (another process) claims from it too.
    with client.checkpoint(ck.id).new() as again:
        assert again.read_file("/srv/setup.txt") == b"prepared\n"
    status, body = raw("POST", f"/v1/sandboxes/{sb.id}/checkpoint", {"token": "0" * 32})
    assert status == 404, (status, body)
    ck.delete()
    assert not any(c.id == ck.id for c in client.checkpoints())
    expect_status(404, lambda: ck.new())
    expect_status(404, lambda: ck.delete())

step("4. hibernate and wake: explicit, on the next call, and after idle_hibernate_seconds")


def row_of(sid):
    return next(r for r in sandbox_rows() if r["id"] == sid)


with new("rt:24.04", ttl_seconds=300) as sb:
    sb.write_file("/srv/keep.txt", b"kept across hibernation\n")
    pid = sb.spawn("sleep", "1000")
    deadline = row_of(sb.id)["deadline"]
    sb.hibernate()
    assert row_of(sb.id)["hibernated"] is True
    status, info = raw("GET", "/v1/info")
    assert info["hibernated"] >= 1 and info["claimed"] >= 1, info
    # A plain (non-upgrade) request never wakes it.
    status, body = raw("GET", f"/v1/sandboxes/{sb.id}/agent", token=sb.token)
    assert status == 426 and row_of(sb.id)["hibernated"] is True, (status, body)
    # The next guest call wakes it, with its memory and disk.
    assert sb.read_file("/srv/keep.txt") == b"kept across hibernation\n"
    assert row_of(sb.id)["hibernated"] is False
    assert any(p["pid"] == pid and p["state"] == "running" for p in sb.ps()), sb.ps()
    assert row_of(sb.id)["deadline"] == deadline, "the lease is kept"
    # Explicit wake; and a hibernated sandbox cannot be forked.
    sb.hibernate()
    exc = expect_status(409, lambda: sb.fork(1))
    assert "hibernated" in str(exc), exc
    status, _ = raw("POST", f"/v1/sandboxes/{sb.id}/wake", token=sb.token)
    assert status == 204 and row_of(sb.id)["hibernated"] is False


def medium_warm():
    pools = raw("GET", "/v1/info")[1]["pools"]
    return any(p["key"]["size"] == "medium" and p["warm"] >= 1 for p in pools)


wait_until("the medium base pool to fill", medium_warm, timeout=300)
with new("base", size="medium", ttl_seconds=300) as idle:
    # Used once, then idle: it hibernates 2 s after its last byte, although the SDK keeps the
    # relay of that call parked for reuse (hibernation cuts it; the SDK dials again and wakes it).
    assert idle.exec("echo", "once").strip() == "once"
    wait_until("the idle sandbox to hibernate", lambda: row_of(idle.id)["hibernated"], timeout=60)
    assert idle.exec("echo", "awake").strip() == "awake"
    assert row_of(idle.id)["hibernated"] is False

step("5. promote: a prepared sandbox becomes a template a pool keeps warm")
with new("rt:24.04", ttl_seconds=300) as sb:
    sb.write_file("/srv/prepared.txt", b"ready\n")
    tpl = sb.promote("agent-ready")
    assert tpl.name == "agent-ready" and tpl.content_digest.startswith("sha256:"), vars(tpl)
    exc = expect_status(409, lambda: sb.promote("base"))
    assert "catalog" in str(exc), exc
status, pools = raw("GET", "/v1/pools")
assert status == 200, pools
with_promoted = {"pools": pools["pools"] + [{"template": "agent-ready", "warm": 1}]}
status, body = raw("PUT", "/v1/pools", with_promoted)
assert status == 200, body


def promoted_warm():
    return any(p["key"]["template"] == "agent-ready" and p["warm"] >= 1 for p in raw("GET", "/v1/info")[1]["pools"])


wait_until("the promoted pool to fill", promoted_warm, timeout=300)
with tpl.new(ttl_seconds=120) as from_tpl:
    assert from_tpl.template_digest == tpl.content_digest, (from_tpl.template_digest, tpl.content_digest)
    assert from_tpl.read_file("/srv/prepared.txt") == b"ready\n"
status, body = raw("POST", "/v1/claim", {"template": "base", "require_promoted": True})
assert status == 404, (status, body)
expect_status(409, lambda: tpl.delete())
status, body = raw("PUT", "/v1/pools", {"pools": pools["pools"]})
assert status == 200, body
tpl.delete()
expect_status(404, lambda: tpl.delete())

step("6. volumes: the catalog, rw at claim time, ro shared, set and patch, refusals")
from cocoonsandbox import ExitError, VolumeError


def catalog_entry(name):
    return {v["name"]: v for v in client.volumes()}[name]


assert catalog_entry("datasets") == {"name": "datasets", "size_bytes": 32 << 20, "holders": 0, "held_rw": False}
# rw at claim time: mounted where asked, writable, and exclusive.
with new("base", ttl_seconds=300, volumes=[{"name": "datasets", "mount": "/data", "mode": "rw"}]) as w:
    assert w.volumes == [{"name": "datasets", "mount": "/data", "mode": "rw"}], w.volumes
    w.exec("sh", "-c", "echo kept > /data/hello.txt && sync")
    assert w.exec("cat", "/data/hello.txt") == "kept\n"
    assert catalog_entry("datasets")["holders"] == 1 and catalog_entry("datasets")["held_rw"] is True
    rows = [r for r in sandbox_rows() if r["id"] == w.id]
    assert rows[0]["volumes"] == w.volumes, rows
    expect_status(409, lambda: new("base", ttl_seconds=60, volumes=["datasets"]))
    # A snapshot cannot carry a plugged disk: fork, checkpoint, promote and hibernate refuse.
    for verb in (lambda: w.checkpoint(), lambda: w.fork(1), lambda: w.hibernate(), lambda: w.promote("with-vol")):
        assert "holds volumes" in expect_status(409, verb).message
    view = w.get_volumes()
    assert view["states"] == [{"name": "datasets", "state": "attached"}] and view["converging"] is False, view
    # PUT [] detaches: the mount and the disk leave the guest.
    view = w.set_volumes([])
    assert view["volumes"] == [] and view["volumes_want"] == [] and view["states"] == [], view
    assert "/data" not in w.exec("cat", "/proc/mounts")
    assert "sd" not in w.exec("ls", "/sys/block")
    w.checkpoint().delete()
# ro, shared: two sandboxes read what the rw holder wrote, neither can write.
with new("base", ttl_seconds=300) as a, new("base", ttl_seconds=300) as b:
    view = a.patch_volumes(add=["datasets"])
    assert view["volumes"] == [{"name": "datasets", "mount": "/mnt/datasets"}], view
    b.set_volumes([{"name": "datasets", "mount": "/ro", "mode": "ro"}])
    assert a.exec("cat", "/mnt/datasets/hello.txt") == "kept\n"
    assert b.exec("cat", "/ro/hello.txt") == "kept\n"
    try:
        b.exec("sh", "-c", "echo x > /ro/new.txt")
        raise AssertionError("a read-only volume took a write")
    except ExitError as exc:
        assert "Read-only file system" in exc.stderr, exc.stderr
    assert catalog_entry("datasets")["holders"] == 2 and catalog_entry("datasets")["held_rw"] is False
    # Now rw is refused to either of them, with the whole view in the error.
    try:
        a.set_volumes([{"name": "datasets", "mode": "rw"}])
        raise AssertionError("rw granted beside another holder")
    except VolumeError as exc:
        assert exc.status == 409 and exc.response["volumes"] == [{"name": "datasets", "mount": "/mnt/datasets"}], exc.response
        assert "rw is exclusive" in exc.response["error"], exc.response
    # An unknown volume is a 404 naming the catalog; nothing changes.
    try:
        a.patch_volumes(add=["nope"])
        raise AssertionError("an unknown volume was attached")
    except VolumeError as exc:
        assert exc.status == 404 and "GET /v1/volumes" in exc.response["error"], exc.response
    view = a.patch_volumes(remove=["datasets"])
    assert view["volumes"] == [], view
# Attach-only (mount=False): the disk is linked, not mounted.
with new("base", ttl_seconds=120, volumes=["datasets"], mount=False) as c:
    assert c.volumes == [{"name": "datasets"}], c.volumes
    assert c.exec("sh", "-c", "readlink /dev/volumes/datasets").startswith("/dev/sd")
    assert "/mnt/datasets" not in c.exec("cat", "/proc/mounts")
expect_status(404, lambda: new("base", ttl_seconds=60, volumes=["nope"]))
expect_status(400, lambda: new("base", ttl_seconds=60, volumes=[{"name": "datasets", "mount": "relative"}]))
assert catalog_entry("datasets")["holders"] == 0
metrics = http.client.HTTPConnection(host, int(port), timeout=30)
metrics.request("GET", "/metrics", headers={"Authorization": f"Bearer {root}"})
samples = dict(l.rsplit(" ", 1) for l in metrics.getresponse().read().decode().splitlines() if l.startswith("sandboxd_volume"))
metrics.close()
assert float(samples["sandboxd_volume_attaches_total"]) == 4 and float(samples["sandboxd_volume_detaches_total"]) == 2, samples
assert float(samples["sandboxd_volume_failures_total"]) == 0, samples

step("7. preview URLs: HTTP and a WebSocket-style upgrade to a guest port")
SERVER = b"""
import http.server, socketserver

class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        if self.headers.get("Upgrade", "").lower() == "echo":
            self.send_response(101)
            self.send_header("Upgrade", "echo")
            self.send_header("Connection", "Upgrade")
            self.end_headers()
            self.wfile.flush()
            data = self.rfile.read(5)
            self.wfile.write(data.upper())
            self.wfile.flush()
            self.close_connection = True
            return
        body = ("path=" + self.path).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass

socketserver.ThreadingTCPServer.allow_reuse_address = True
socketserver.ThreadingTCPServer(("127.0.0.1", 8000), H).serve_forever()
"""
with new("rt:24.04", ttl_seconds=300) as sb:
    sb.write_file("/srv/preview_server.py", SERVER)
    sb.spawn("python3", "/srv/preview_server.py")
    probe = "import socket\ntry:\n socket.create_connection(('127.0.0.1', 8000), 1); print('up')\nexcept OSError:\n print('down')"
    wait_until("the guest server to listen", lambda: sb.exec("python3", "-c", probe).strip() == "up", timeout=60)
    url = sb.preview_url(8000, ttl_seconds=120)
    parts = urllib.parse.urlsplit(url)
    assert url.endswith("/") and "/p/" in parts.path, url
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    conn.request("GET", parts.path + "hello/world?x=1")
    r = conn.getresponse()
    assert (r.status, r.read()) == (200, b"path=/hello/world?x=1"), r.status
    conn.close()
    # An upgrade passes through: the guest switches protocols and echoes in upper case.
    s = socket.create_connection((parts.hostname, parts.port), timeout=30)
    s.sendall(f"GET {parts.path}ws HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = s.recv(1)
        assert chunk, head
        head += chunk
    assert head.startswith(b"HTTP/1.1 101"), head
    s.sendall(b"hello")
    got = b""
    while len(got) < 5:
        chunk = s.recv(5 - len(got))
        assert chunk, got
        got += chunk
    assert got == b"HELLO", got
    s.close()
    # A tampered token is a 404; so is the URL once the sandbox is released.
    bad = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    bad.request("GET", parts.path[:-3] + "xx/")
    assert bad.getresponse().status == 404
    bad.close()
    exc = expect_status(400, lambda: sb.preview_url(0))
after = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
after.request("GET", parts.path)
assert after.getresponse().status == 404, "a released sandbox's preview URL is dead"
after.close()

step("8. stats: measured CPU and memory")
with new("base", ttl_seconds=120) as sb:
    sb.exec("sh", "-c", "i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done")
    status, st = raw("GET", f"/v1/sandboxes/{sb.id}/stats")
    assert status == 200, st
    assert st["id"] == sb.id and st["cpu_count"] >= 1, st
    assert st["mem_used_measured"] is True, st
    assert 0 < st["mem_used_bytes"] <= st["mem_total_bytes"], st
    assert st["cpu_usage_nanos"] > 0 and st["memory_working_set_bytes"] > 0, st
    assert st["hibernated"] is False and st["measured_at"].endswith("Z"), st
    status, body = raw("GET", f"/v1/sandboxes/{sb.id}/stats", token=sb.token)
    assert status == 401, (status, body)
assert raw("GET", "/v1/sandboxes/sb_000000000000000/stats")[0] == 404

step("9. git ops in silkd, with the guest's git")



with new("rt:24.04", ttl_seconds=300) as sb:
    sb.exec("git", "init", "--quiet", "--bare", "-b", "main", "/srv/remote.git")
    sb.git_clone("/srv/remote.git", "/srv/work")
    sb.write_file("/srv/work/hello.py", b"print('hello from git')\n")
    st = sb.git_status("/srv/work")
    assert st["branch"] == "main" and st["files"] == [{"path": "hello.py", "staged": "?", "unstaged": "?"}], st
    sb.git_add("/srv/work", ["hello.py"])
    first = sb.git_commit("/srv/work", "add hello", "Agent <agent@example.com>")
    sb.git_push("/srv/work")
    assert sb.exec("git", "--git-dir=/srv/remote.git", "rev-parse", "main").strip() == first
    sb.git_clone("file:///srv/remote.git", "/srv/other", branch="main", depth=1)
    sb.git_create_branch("/srv/work", "topic")
    sb.git_checkout("/srv/work", "topic")
    sb.write_file("/srv/work/hello.py", b"print('hello again')\n")
    sb.git_add("/srv/work", [])
    sb.git_commit("/srv/work", "change hello", "Agent <agent@example.com>")
    assert sb.git_status("/srv/work")["files"] == []
    br = sb.git_branches("/srv/work")
    assert br["current"] == "topic" and br["branches"] == ["main", "topic"], br
    sb.git_push("/srv/work")
    sb.git_checkout("/srv/work", "main")
    sb.git_delete_branch("/srv/work", "topic")
    sb.git_push("/srv/work")
    sb.git_pull("/srv/other")
    assert sb.exec("python3", "/srv/other/hello.py").strip() == "hello from git"
    # Bad input: typed errors, and the sandbox goes on.
    expect_silkd("bad_request", "Name <email>", lambda: sb.git_commit("/srv/work", "x", "anonymous"))
    expect_silkd("bad_request", "not a git repository", lambda: sb.git_status("/tmp"))
    expect_silkd("not_found", "no such directory", lambda: sb.git_status("/nowhere"))
    expect_silkd("bad_request", "start with '-'", lambda: sb.git_clone("--upload-pack=touch /tmp/p", "/srv/x"))
    expect_silkd("unimplemented", "no network", lambda: sb.git_clone("https://example.com/r.git", "/srv/y"))
    expect_silkd("unimplemented", "language servers", lambda: sb.start_lsp("python"))
    assert sb.exec("sh", "-c", "test ! -e /tmp/p && echo clean").strip() == "clean"
with new("base", ttl_seconds=60) as sb:
    expect_silkd("unimplemented", "no git", lambda: sb.git_status("/"))

step("LangChain toolkit, default settings (template rt:24.04)")
wait_until("a warm rt VM for the toolkit", lambda: pool_warm("rt"), timeout=180)
from cocoonsandbox_langchain import CocoonToolkit  # noqa: E402

with CocoonToolkit(addr, api_token=root) as kit:
    tools = {t.name: t for t in kit.get_tools()}
    out = tools["sandbox_exec"].invoke({"command": "python3 -c 'print(40 + 2)'"})
    assert out.strip() == "42", out
    out = tools["sandbox_exec"].invoke({"command": "echo oops >&2; exit 3"})
    assert "stderr: oops" in out and "exit code: 3" in out, out
    assert tools["sandbox_write_file"].invoke({"path": "/tmp/agent.txt", "content": "from langchain\n"}).startswith("wrote")
    assert tools["sandbox_read_file"].invoke({"path": "/tmp/agent.txt"}) == "from langchain\n"
    listing = json.loads(tools["sandbox_list_dir"].invoke({"path": "/tmp"}))
    assert any(e["name"] == "agent.txt" and e["kind"] == "file" for e in listing), listing
    claimed = kit.sandbox().id
    assert any(r["id"] == claimed for r in sandbox_rows())
assert not any(r["id"] == claimed for r in sandbox_rows()), "the toolkit released its sandbox"

step("OpenAI Agents sandbox session, default settings (template rt:24.04)")
wait_until("a warm rt VM for the Agents session", lambda: pool_warm("rt"), timeout=180)
from cocoonsandbox_openai import CocoonSandboxClient, CocoonSandboxClientOptions  # noqa: E402


async def agents_session():
    agents_client = CocoonSandboxClient()
    session = await agents_client.create(options=CocoonSandboxClientOptions(addr=addr, api_token=root))
    try:
        await session.start()
        await session.write(Path("notes.txt"), io.BytesIO(b"written by an agent\n"))
        got = await session.read(Path("notes.txt"))
        assert got.read() == b"written by an agent\n"
        res = await session.exec("sh", "-c", "cat /workspace/notes.txt | wc -l; python3 -c 'print(7 * 6)'")
        assert res.exit_code == 0 and res.stdout.split() == [b"1", b"42"], res
        assert await session.running()
    finally:
        await agents_client.delete(session)
    return session.state.sandbox_id


sid = asyncio.run(agents_session())
assert not any(r["id"] == sid for r in sandbox_rows()), "delete released the sandbox"

print("sdk surface ok")
