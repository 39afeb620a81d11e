"""The public SDK (unmodified) against a sandboxd served by the api test harness (fake driver).

Usage: python3 smoke.py <host:port> <root token>
"""

import sys
import time

from cocoonsandbox import APIError, Client, ExitError

addr, root = sys.argv[1], sys.argv[2]
client = Client(addr, api_token=root, timeout=10)


def expect_status(status, fn):
    try:
        fn()
    except APIError as exc:
        assert exc.status == status, f"want {status}, got {exc.status}: {exc}"
        return exc
    raise AssertionError(f"want APIError {status}")


sb = client.new("base", ttl_seconds=60, claim_ref="sdk")
assert sb.id.startswith("sb_"), sb.id
assert sb.exec("echo", "hi") == "hi\n"
out = bytearray()
assert sb.run(["cat"], stdin=b"abc" * 1000, on_stdout=out.extend) == 0
assert bytes(out) == b"abc" * 1000, len(out)
try:
    sb.exec("fail")
    raise AssertionError("want ExitError")
except ExitError as exc:
    assert (exc.code, exc.stderr) == (3, "boom"), exc
assert sb.exec("echo", "again") == "again\n"  # a parked keep-alive connection is reused
port = sb.dial_port(7)
port.send(b"ping")
assert port.recv() == b"ping"
port.close_write()
assert port.recv() == b""
port.close()
deadline = sb.renew(30)
assert deadline.endswith("Z"), deadline
rows = client.sandboxes()
assert [r["id"] for r in rows] == [sb.id], rows
assert rows[0]["claim_ref"] == "sdk"
info = client.info()
assert info["claimed"] == 1, info
assert client.lookup(sb.id, sb.token).id == sb.id

expect_status(401, lambda: Client(addr, api_token="wrong").new("base"))
expect_status(400, lambda: client.new("base", ttl_seconds=-1))
expect_status(404, lambda: client.attach(addr, "sb_0000000000000000", "x").renew())
client.drain()
expect_status(429, lambda: client.new("base"))
client.uncordon()
for _ in range(200):
    if client.info()["pools"][0]["warm"] > 0:
        break
    time.sleep(0.02)
with client.new("base") as other:
    assert other.exec("echo", "x") == "x\n"
sb.close()
sb.close()  # 404 on a second release is success for the SDK
assert client.sandboxes() == []
print("sdk smoke ok")
