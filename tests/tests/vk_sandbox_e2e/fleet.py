"""The public SDK (unmodified) pointed at box A of a two-box fleet whose pool base/none/medium is
warm only on box B: the claim is redirected to B, runs commands there, and a lookup from A finds
it on B.

Usage: python3 fleet.py <A host:port> <B host:port> <node token>
"""

import sys

from cocoonsandbox import Client

a, b, token = sys.argv[1], sys.argv[2], sys.argv[3]
client = Client(a, api_token=token, timeout=120)

peers = client.info().get("peers") or []
assert b in peers, f"A lists no peer {b}: {peers}"

sb = client.new("base", size="medium", ttl_seconds=300, claim_ref="fleet-sdk")
assert sb.owner == b, f"the claim was served by {sb.owner}, not redirected to {b}"
assert sb.exec("echo", "from-b") == "from-b\n"

found = Client(a, api_token=token, timeout=60).lookup(sb.id, sb.token)
assert found.owner == b, f"lookup from A found {found.owner}, want {b}"
assert found.exec("echo", "again") == "again\n"
sb.close()
print("fleet sdk ok")
