//! Test doubles: an in-memory `FakeDriver` with settable failures.
