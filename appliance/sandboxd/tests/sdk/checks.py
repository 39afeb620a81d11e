"""Helpers shared by the SDK suites (`e2e.py`, `surface.py`): step banners, expected API
errors and polling."""

import json
import time

from cocoonsandbox import APIError


def step(name):
    print(f"-- {name}", flush=True)


def expect_status(status, fn):
    """Runs fn, which must raise the SDK's APIError with HTTP `status`; returns it."""
    try:
        fn()
    except APIError as exc:
        assert exc.status == status, f"want HTTP {status}, got {exc.status}: {exc}"
        return exc
    raise AssertionError(f"want APIError {status}")


def wait_until(what, fn, timeout=120.0):
    """Polls fn every 0.2 s until it returns a true value (returned), or fails after timeout."""
    until = time.monotonic() + timeout
    while True:
        v = fn()
        if v:
            return v
        if time.monotonic() > until:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def request(conn, method, path, token, body=None):
    """One call on an http.client connection (closed after): (status, decoded JSON body)."""
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Authorization": f"Bearer {token}"})
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"null")
    finally:
        conn.close()
