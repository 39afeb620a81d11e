//! Shared helpers for the integration suites (test_infra).
