//! The `git_*` ops against the host's `git`, over the protocol: a clone of a local bare
//! repository, status, add, commit, push, pull into a second clone, branches, and the bad
//! inputs (a missing directory, a directory that is no repository, an option smuggled in as a
//! URL or a branch name, a bad author, an empty message, deleting the current branch), each a
//! typed error after which the connection goes on.

mod common;

use common::{ty, Server};
use serde_json::{json, Value};
use std::path::Path;

fn git(dir: &Path, args: &[&str]) -> String {
    let out = std::process::Command::new("git").arg("-C").arg(dir).args(args).output().expect("run git");
    assert!(out.status.success(), "git {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

fn done(f: &Value) {
    assert_eq!(ty(f), "done", "{f}");
}

fn error(f: &Value, kind: &str, has: &str) {
    assert_eq!((ty(f), f["kind"].as_str()), ("error", Some(kind)), "{f}");
    assert!(f["message"].as_str().unwrap_or("").contains(has), "{f} lacks {has:?}");
}

#[tokio::test]
async fn git_ops_clone_commit_push_pull_and_branch() {
    let server = Server::start().await;
    let mut c = server.connect().await;
    let tmp = tempfile::tempdir().expect("tempdir");
    let (remote, work, other) = (tmp.path().join("remote.git"), tmp.path().join("work"), tmp.path().join("other"));
    std::fs::create_dir(&remote).expect("mkdir");
    git(&remote, &["init", "--quiet", "--bare", "-b", "main"]);
    let s = |p: &Path| p.display().to_string();

    done(&c.call("git_clone", json!({"url": s(&remote), "path": s(&work)})).await);
    std::fs::write(work.join("a.txt"), "one\n").expect("write");
    let st = c.call("git_status", json!({"path": s(&work)})).await;
    assert_eq!(ty(&st), "git_status_result", "{st}");
    assert_eq!(st["branch"], "main");
    assert_eq!(st["files"], json!([{"path": "a.txt", "staged": "?", "unstaged": "?"}]));
    assert!(st.get("truncated").is_none(), "{st}");

    done(&c.call("git_add", json!({"path": s(&work), "files": ["a.txt"]})).await);
    let st = c.call("git_status", json!({"path": s(&work)})).await;
    assert_eq!(st["files"], json!([{"path": "a.txt", "staged": "A", "unstaged": " "}]));
    error(
        &c.call("git_commit", json!({"path": s(&work), "message": "m", "author": "nobody"})).await,
        "bad_request",
        "Name <email>",
    );
    error(
        &c.call("git_commit", json!({"path": s(&work), "message": " ", "author": "A <a@b>"})).await,
        "bad_request",
        "message",
    );
    let r =
        c.call("git_commit", json!({"path": s(&work), "message": "first", "author": "Ada <ada@example.com>"})).await;
    assert_eq!(ty(&r), "git_commit_result", "{r}");
    let hash = r["hash"].as_str().expect("hash").to_string();
    assert_eq!(hash.len(), 40, "{hash}");
    assert_eq!(git(&work, &["log", "-1", "--format=%an <%ae>|%cn|%s"]), "Ada <ada@example.com>|Ada|first");

    done(&c.call("git_push", json!({"path": s(&work)})).await);
    assert_eq!(git(&remote, &["rev-parse", "main"]), hash);
    let st = c.call("git_status", json!({"path": s(&work)})).await;
    assert_eq!(
        (st["branch"].as_str(), st["ahead"].as_u64(), st["files"].as_array().map(Vec::len)),
        (Some("main"), Some(0), Some(0))
    );

    // A second clone pulls what the first pushes next.
    done(&c.call("git_clone", json!({"url": s(&remote), "path": s(&other), "branch": "main", "depth": 1})).await);
    std::fs::write(work.join("b.txt"), "two\n").expect("write");
    done(&c.call("git_add", json!({"path": s(&work), "files": []})).await);
    c.call("git_commit", json!({"path": s(&work), "message": "second", "author": "Ada <ada@example.com>"})).await;
    let st = c.call("git_status", json!({"path": s(&work)})).await;
    assert_eq!(st["ahead"], 1, "{st}");
    done(&c.call("git_push", json!({"path": s(&work)})).await);
    done(&c.call("git_pull", json!({"path": s(&other)})).await);
    assert_eq!(std::fs::read_to_string(other.join("b.txt")).expect("pulled"), "two\n");

    // Branches.
    let b = c.call("git_branch", json!({"path": s(&work), "action": "create", "name": "feature"})).await;
    done(&b);
    let l = c.call("git_branch", json!({"path": s(&work), "action": "list"})).await;
    assert_eq!(l, json!({"type": "git_branches", "current": "main", "branches": ["feature", "main"]}));
    done(&c.call("git_branch", json!({"path": s(&work), "action": "checkout", "name": "feature"})).await);
    assert_eq!(c.call("git_branch", json!({"path": s(&work), "action": "list"})).await["current"], "feature");
    error(
        &c.call("git_branch", json!({"path": s(&work), "action": "delete", "name": "feature"})).await,
        "bad_request",
        "git branch failed",
    );
    done(&c.call("git_branch", json!({"path": s(&work), "action": "checkout", "name": "main"})).await);
    done(&c.call("git_branch", json!({"path": s(&work), "action": "delete", "name": "feature"})).await);
    error(&c.call("git_branch", json!({"path": s(&work), "action": "create"})).await, "bad_request", "branch name");
    error(
        &c.call("git_branch", json!({"path": s(&work), "action": "checkout", "name": "nope"})).await,
        "bad_request",
        "nope",
    );

    // Bad places and smuggled options.
    error(
        &c.call("git_status", json!({"path": s(&tmp.path().join("missing"))})).await,
        "not_found",
        "no such directory",
    );
    error(&c.call("git_status", json!({"path": s(tmp.path())})).await, "bad_request", "not a git repository");
    let marker = tmp.path().join("pwned");
    let url = format!("--upload-pack=touch {}", marker.display());
    error(
        &c.call("git_clone", json!({"url": url, "path": s(&tmp.path().join("x"))})).await,
        "bad_request",
        "start with '-'",
    );
    error(
        &c.call("git_clone", json!({"url": s(&remote), "path": s(&tmp.path().join("y")), "branch": "--foo"})).await,
        "bad_request",
        "start with '-'",
    );
    error(
        &c.call("git_clone", json!({"url": "ext::sh -c touch% /tmp/pwned-ext", "path": s(&tmp.path().join("z"))}))
            .await,
        "bad_request",
        "git clone failed",
    );
    assert!(!marker.exists() && !Path::new("/tmp/pwned-ext").exists());
    error(&c.call("git_pull", json!({"path": s(&tmp.path().join("missing"))})).await, "not_found", "no such directory");
    // The connection is still good.
    assert_eq!(ty(&c.call("info", json!({})).await), "info");
}
