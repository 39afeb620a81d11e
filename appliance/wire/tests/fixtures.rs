//! The fixture corpus (`fixtures/v1/`, one frame per file): every `req_*.json` parses and
//! re-renders to an equal JSON value, every `resp_*.json` parses and re-serializes to an
//! equal JSON value, `enums.json` pins the enums, and every op and reply type of the
//! protocol has at least one fixture.

use serde_json::Value;
use std::collections::BTreeSet;
use std::path::PathBuf;
use wire::codec::{decode_request, decode_response, encode_request, encode_response};
use wire::{ErrorKind, EventKind, FileKind, GitBranchAction, Request, Response};

fn corpus() -> Vec<(String, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/v1");
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .expect("fixture dir exists")
        .map(|e| {
            let path = e.expect("dir entry").path();
            let name = path.file_name().and_then(|n| n.to_str()).expect("utf-8 name").to_string();
            (name, std::fs::read(&path).expect("fixture readable"))
        })
        .collect();
    files.sort();
    files
}

fn json(bytes: &[u8]) -> Value {
    serde_json::from_slice(bytes).expect("fixture is JSON")
}

#[test]
fn every_request_parses_and_round_trips() {
    let mut ops = BTreeSet::new();
    let mut n = 0;
    for (name, bytes) in corpus().into_iter().filter(|(n, _)| n.starts_with("req_")) {
        let req = decode_request(bytes.trim_ascii_end()).unwrap_or_else(|e| panic!("{name}: {e}"));
        let again = encode_request(&req).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(json(&again), json(&bytes), "{name} re-renders to an equal JSON value");
        ops.insert(req.op());
        n += 1;
    }
    let missing: Vec<_> = Request::OPS.iter().filter(|op| !ops.contains(*op)).collect();
    assert!(missing.is_empty(), "ops without a request fixture: {missing:?}");
    assert!(n >= Request::OPS.len());
}

#[test]
fn every_response_parses_and_round_trips() {
    let mut types = BTreeSet::new();
    for (name, bytes) in corpus().into_iter().filter(|(n, _)| n.starts_with("resp_")) {
        let resp = decode_response(bytes.trim_ascii_end()).unwrap_or_else(|e| panic!("{name}: {e}"));
        let again = encode_response(&resp).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(json(&again), json(&bytes), "{name} re-serializes to an equal JSON value");
        assert!(again.starts_with(b"{\"type\":"), "{name}: type comes first");
        types.insert(resp.type_name());
    }
    let missing: Vec<_> = Response::TYPES.iter().filter(|t| !types.contains(*t)).collect();
    assert!(missing.is_empty(), "reply types without a fixture: {missing:?}");
}

#[test]
fn enums_file_pins_the_enums() {
    let (_, bytes) = corpus().into_iter().find(|(n, _)| n == "enums.json").expect("enums.json present");
    let pinned = json(&bytes);
    let ours = serde_json::json!({
        "error_kind": ErrorKind::ALL,
        "event_kind": EventKind::ALL,
        "file_kind": FileKind::ALL,
        "git_branch_action": GitBranchAction::ALL,
    });
    assert_eq!(pinned, ours);
}

#[test]
fn corpus_has_only_known_file_kinds() {
    for (name, _) in corpus() {
        assert!(
            name == "enums.json"
                || (name.ends_with(".json") && (name.starts_with("req_") || name.starts_with("resp_"))),
            "unexpected fixture {name}"
        );
    }
}
