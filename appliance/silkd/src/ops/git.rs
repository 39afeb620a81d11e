//! `git_*` ops: the SDK's git verbs, run with the guest's own `git` binary.
//!
//! - `git_clone {url, path, branch?, depth?, auth?}`, `git_add {path, files}`,
//!   `git_push`/`git_pull {path, auth?}` → `done`; `git_status {path}` →
//!   `git_status_result`; `git_commit {path, message, author}` → `git_commit_result{hash}`;
//!   `git_branch {path, action, name?}` → `git_branches{current, branches}` for `list`, else
//!   `done`.
//! - A guest without `git` (the `base` template) answers `unimplemented`, naming the tool.
//! - Network: on a lane without a NIC, clone/push/pull of a remote URL answer `unimplemented`
//!   (the spec's none-lane rule); a local path or `file://` URL works on every lane.
//! - `auth` is a token (`x-access-token:<token>`) or `user:password`, sent as an HTTP basic
//!   `Authorization` header through git's environment config, never on the command line and
//!   never in an error message. git never prompts (`GIT_TERMINAL_PROMPT=0`), and only the
//!   `file`, `git`, `http`, `https` and `ssh` transports are allowed.
//! - `push` sets the upstream of the current branch on its remote (`origin` by default);
//!   `pull` fast-forwards only (a diverged branch is refused: merge through `exec`).
//! - `create` makes a branch at `HEAD` without switching to it; `checkout` switches; `delete`
//!   deletes even when unmerged (the current branch cannot be deleted).
//! - A failing git command is `bad_request` with git's own message (at most
//!   [`STDERR_KEEP`] bytes of it); a path that does not exist is `not_found`; a git that runs
//!   past [`GIT_TIMEOUT`] is killed (`internal`). Output is capped at [`OUTPUT_CAP`] and a
//!   status lists at most [`MAX_STATUS_FILES`] files (then `truncated`).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use tokio::io::{AsyncRead, AsyncReadExt as _};
use wire::{GitBranchAction, GitFileStatus, Response};

use super::fs::resolve;
use crate::error::OpError;
use crate::rpc::Rpc;
use crate::sys;

/// The most of git's stdout read (status and branch listings).
pub const OUTPUT_CAP: usize = 4 << 20;
/// The most of git's stderr kept for an error message.
pub const STDERR_KEEP: usize = 4096;
/// The most files one `git_status_result` lists.
pub const MAX_STATUS_FILES: usize = 10_000;
/// How long one git command may run (a clone of a large repository included).
pub const GIT_TIMEOUT: Duration = Duration::from_secs(600);

/// The transports git may use.
const ALLOWED_PROTOCOLS: &str = "file:git:http:https:ssh";

/// One git invocation's context: the op (for messages), the repository directory and the
/// extra environment (auth, identity).
struct Git {
    op: &'static str,
    git: PathBuf,
    dir: PathBuf,
    env: Vec<(String, String)>,
}

impl Git {
    /// For `op` in the repository (or parent directory, for a clone) `dir`, which must exist.
    fn new(op: &'static str, dir: &str) -> Result<Self, OpError> {
        let git = find_git().ok_or_else(|| {
            OpError::unimplemented(format!(
                "{op}: this guest has no git (the base template ships none): claim a template that has it, \
                 such as rt, or run your own tool through exec"
            ))
        })?;
        let dir = resolve(op, dir)?;
        if !dir.is_dir() {
            return Err(OpError::not_found(format!("{op}: {}: no such directory", dir.display())));
        }
        Ok(Self { op, git, dir, env: Vec::new() })
    }

    /// Sends `auth` as an HTTP basic `Authorization` header (environment config, not argv).
    fn with_auth(mut self, auth: Option<&str>) -> Self {
        if let Some(auth) = auth.filter(|a| !a.is_empty()) {
            let pair = if auth.contains(':') { auth.to_string() } else { format!("x-access-token:{auth}") };
            self.env.extend([
                ("GIT_CONFIG_COUNT".into(), "1".into()),
                ("GIT_CONFIG_KEY_0".into(), "http.extraHeader".into()),
                ("GIT_CONFIG_VALUE_0".into(), format!("Authorization: Basic {}", STANDARD.encode(pair))),
            ]);
        }
        self
    }

    /// Runs `git args…` in the directory; its stdout, or git's message as `bad_request`.
    async fn run(&self, args: &[&str]) -> Result<Vec<u8>, OpError> {
        let mut cmd = tokio::process::Command::new(&self.git);
        cmd.args(args)
            .current_dir(&self.dir)
            .env_clear()
            .envs(sys::child_env(None, None))
            .env("GIT_TERMINAL_PROMPT", "0")
            .env("GIT_ALLOW_PROTOCOL", ALLOWED_PROTOCOLS)
            .env("HOME", "/root")
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut child = cmd.spawn().map_err(|e| OpError::internal(format!("{}: starting git: {e}", self.op)))?;
        let (stdout, stderr) = (child.stdout.take(), child.stderr.take());
        let work = async {
            let (out, err) = tokio::join!(read_capped(stdout, OUTPUT_CAP), read_capped(stderr, STDERR_KEEP));
            (child.wait().await, out, err)
        };
        let (status, (out, out_over), (err, _)) = tokio::time::timeout(GIT_TIMEOUT, work)
            .await
            .map_err(|_| OpError::internal(format!("{}: git ran past {GIT_TIMEOUT:?} and was killed", self.op)))?;
        let status = status.map_err(|e| OpError::internal(format!("{}: waiting for git: {e}", self.op)))?;
        if !status.success() {
            let msg = String::from_utf8_lossy(&err);
            let msg = msg.trim();
            let sub = args.first().copied().unwrap_or("git");
            return Err(OpError::bad_request(format!(
                "{}: git {sub} failed (exit {}): {}",
                self.op,
                sys::exit_code(status),
                if msg.is_empty() { "no message" } else { msg }
            )));
        }
        if out_over {
            return Err(OpError::internal(format!("{}: git printed more than {OUTPUT_CAP} bytes", self.op)));
        }
        Ok(out)
    }

    /// `run`, its stdout as trimmed text.
    async fn text(&self, args: &[&str]) -> Result<String, OpError> {
        Ok(String::from_utf8_lossy(&self.run(args).await?).trim().to_string())
    }

    /// The current branch, or `HEAD` when detached.
    async fn current_branch(&self) -> Result<String, OpError> {
        match self.text(&["symbolic-ref", "--short", "-q", "HEAD"]).await {
            Ok(b) if !b.is_empty() => Ok(b),
            _ => Ok("HEAD".into()),
        }
    }

    /// The remote the current branch tracks, else `origin`.
    async fn remote(&self) -> Result<String, OpError> {
        let branch = self.current_branch().await?;
        let key = format!("branch.{branch}.remote");
        Ok(self
            .text(&["config", "--get", &key])
            .await
            .ok()
            .filter(|r| !r.is_empty())
            .unwrap_or_else(|| "origin".into()))
    }

    /// Refuses a network remote on a lane without a NIC.
    async fn check_lane(&self, remote: &str) -> Result<(), OpError> {
        let url = self.text(&["remote", "get-url", "--", remote]).await?;
        lane_allows(self.op, &url)
    }
}

/// Reads all of `r`, keeping at most `cap` bytes; `true` when more came (the rest is drained).
async fn read_capped(r: Option<impl AsyncRead + Unpin>, cap: usize) -> (Vec<u8>, bool) {
    let Some(mut r) = r else { return (Vec::new(), false) };
    let mut kept = Vec::new();
    let mut buf = [0u8; 8192];
    let mut over = false;
    loop {
        match r.read(&mut buf).await {
            Ok(0) | Err(_) => return (kept, over),
            Ok(n) => {
                let room = cap.saturating_sub(kept.len());
                kept.extend_from_slice(&buf[..n.min(room)]);
                over |= n > room;
            }
        }
    }
}

/// `git` in the children's `PATH`.
fn find_git() -> Option<PathBuf> {
    sys::DEFAULT_PATH.split(':').map(|d| Path::new(d).join("git")).find(|p| {
        use std::os::unix::fs::PermissionsExt as _;
        p.metadata().is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    })
}

/// Whether `url` is on this machine (a path or `file://`), so needs no network.
fn is_local(url: &str) -> bool {
    url.starts_with('/') || url.starts_with("file://") || url.starts_with("./") || url.starts_with("../")
}

/// `unimplemented` for a network URL on a lane without a NIC.
fn lane_allows(op: &str, url: &str) -> Result<(), OpError> {
    if is_local(url) || sys::has_nic() {
        return Ok(());
    }
    Err(OpError::unimplemented(format!(
        "{op}: this sandbox has no network (net none), so a remote repository cannot be reached: claim with \
         net egress, use a repository path inside the sandbox, or move files with fs_push and fs_pull"
    )))
}

/// Refuses a value git would read as an option.
fn not_an_option(op: &str, what: &str, v: &str) -> Result<(), OpError> {
    if v.is_empty() || v.starts_with('-') {
        return Err(OpError::bad_request(format!("{op}: {what} {v:?} must not be empty or start with '-'")));
    }
    Ok(())
}

/// `Name <email>` → (name, email).
fn parse_author(op: &str, author: &str) -> Result<(String, String), OpError> {
    let bad = || OpError::bad_request(format!("{op}: author {author:?} must be \"Name <email>\""));
    let (name, rest) = author.split_once('<').ok_or_else(bad)?;
    let email = rest.strip_suffix('>').ok_or_else(bad)?.trim();
    let name = name.trim();
    if name.is_empty() || email.is_empty() || email.contains(['<', '>']) {
        return Err(bad());
    }
    Ok((name.to_string(), email.to_string()))
}

/// Parses `git status --porcelain=v1 --branch -z`: the branch, ahead, behind, the files (at
/// most [`MAX_STATUS_FILES`]) and whether more were left out.
fn parse_status(out: &[u8]) -> (String, u32, u32, Vec<GitFileStatus>, bool) {
    let text = String::from_utf8_lossy(out);
    let mut entries = text.split('\0').filter(|e| !e.is_empty());
    let (mut branch, mut ahead, mut behind) = (String::from("HEAD"), 0, 0);
    let mut files = Vec::new();
    let mut truncated = false;
    while let Some(e) = entries.next() {
        if let Some(head) = e.strip_prefix("## ") {
            (branch, ahead, behind) = parse_branch_line(head);
            continue;
        }
        if e.len() < 4 || !e.is_char_boundary(2) || !e.is_char_boundary(3) {
            continue;
        }
        let (xy, path) = (&e[..2], &e[3..]);
        // A rename or copy is followed by its source path.
        if xy.contains(['R', 'C']) {
            entries.next();
        }
        if files.len() == MAX_STATUS_FILES {
            truncated = true;
            continue;
        }
        let mut cols = xy.chars();
        let col = |c: Option<char>| c.map(String::from).unwrap_or_default();
        files.push(GitFileStatus { path: path.to_string(), staged: col(cols.next()), unstaged: col(cols.next()) });
    }
    (branch, ahead, behind, files, truncated)
}

/// `main...origin/main [ahead 1, behind 2]`, `No commits yet on main`, `HEAD (no branch)`.
fn parse_branch_line(head: &str) -> (String, u32, u32) {
    let head =
        head.strip_prefix("No commits yet on ").or_else(|| head.strip_prefix("Initial commit on ")).unwrap_or(head);
    let (names, counts) = head.split_once(" [").unwrap_or((head, ""));
    let branch = names.split("...").next().unwrap_or(names);
    let branch = if branch.starts_with("HEAD (") { "HEAD" } else { branch };
    let count = |word: &str| {
        counts.trim_end_matches(']').split(", ").find_map(|p| p.strip_prefix(word)?.trim().parse().ok()).unwrap_or(0)
    };
    (branch.to_string(), count("ahead "), count("behind "))
}

/// `git_clone`: into `path` (created by git; its parent must exist).
pub async fn git_clone(
    rpc: &mut Rpc,
    url: String,
    path: String,
    branch: Option<String>,
    depth: Option<u32>,
    auth: Option<String>,
) -> Result<(), OpError> {
    const OP: &str = "git_clone";
    not_an_option(OP, "url", &url)?;
    let dest = resolve(OP, &path)?;
    let parent = dest.parent().unwrap_or(Path::new("/")).to_string_lossy().into_owned();
    let git = Git::new(OP, &parent)?.with_auth(auth.as_deref());
    lane_allows(OP, &url)?;
    let mut args = vec!["clone".to_string(), "--quiet".into()];
    if let Some(b) = branch.filter(|b| !b.is_empty()) {
        not_an_option(OP, "branch", &b)?;
        args.extend(["--branch".into(), b]);
    }
    if let Some(d) = depth.filter(|d| *d > 0) {
        args.extend(["--depth".into(), d.to_string()]);
    }
    args.extend(["--".into(), url, dest.to_string_lossy().into_owned()]);
    git.run(&args.iter().map(String::as_str).collect::<Vec<_>>()).await?;
    rpc.send(Response::Done).await?;
    Ok(())
}

/// `git_add`: the listed files, or everything (`-A`) when none are listed.
pub async fn git_add(rpc: &mut Rpc, path: String, files: Vec<String>) -> Result<(), OpError> {
    let git = Git::new("git_add", &path)?;
    let mut args = vec!["add"];
    if files.is_empty() {
        args.push("-A");
    } else {
        args.push("--");
        args.extend(files.iter().map(String::as_str));
    }
    git.run(&args).await?;
    rpc.send(Response::Done).await?;
    Ok(())
}

/// `git_push`: the current branch to its remote, setting the upstream.
pub async fn git_push(rpc: &mut Rpc, path: String, auth: Option<String>) -> Result<(), OpError> {
    let git = Git::new("git_push", &path)?.with_auth(auth.as_deref());
    let remote = git.remote().await?;
    git.check_lane(&remote).await?;
    git.run(&["push", "--quiet", "--set-upstream", &remote, "HEAD"]).await?;
    rpc.send(Response::Done).await?;
    Ok(())
}

/// `git_pull`: fast-forward only.
pub async fn git_pull(rpc: &mut Rpc, path: String, auth: Option<String>) -> Result<(), OpError> {
    let git = Git::new("git_pull", &path)?.with_auth(auth.as_deref());
    let remote = git.remote().await?;
    git.check_lane(&remote).await?;
    git.run(&["pull", "--quiet", "--ff-only"]).await?;
    rpc.send(Response::Done).await?;
    Ok(())
}

/// `git_status` → `git_status_result`.
pub async fn git_status(rpc: &mut Rpc, path: String) -> Result<(), OpError> {
    let git = Git::new("git_status", &path)?;
    let out = git.run(&["status", "--porcelain=v1", "--branch", "-z", "--untracked-files=all"]).await?;
    let (branch, ahead, behind, files, truncated) = parse_status(&out);
    rpc.send(Response::GitStatusResult { branch, ahead, behind, files, truncated }).await?;
    Ok(())
}

/// `git_commit` → `git_commit_result{hash}`: the staged changes, as `author` (also the
/// committer).
pub async fn git_commit(rpc: &mut Rpc, path: String, message: String, author: String) -> Result<(), OpError> {
    const OP: &str = "git_commit";
    if message.trim().is_empty() {
        return Err(OpError::bad_request(format!("{OP}: message must not be empty")));
    }
    let (name, email) = parse_author(OP, &author)?;
    let mut git = Git::new(OP, &path)?;
    for who in ["AUTHOR", "COMMITTER"] {
        git.env.push((format!("GIT_{who}_NAME"), name.clone()));
        git.env.push((format!("GIT_{who}_EMAIL"), email.clone()));
    }
    git.run(&["commit", "--quiet", "-m", &message]).await?;
    let hash = git.text(&["rev-parse", "HEAD"]).await?;
    rpc.send(Response::GitCommitResult { hash }).await?;
    Ok(())
}

/// `git_branch`: `list` → `git_branches{current, branches}`; `create`, `checkout`, `delete`
/// → `done`.
pub async fn git_branch(
    rpc: &mut Rpc,
    path: String,
    action: GitBranchAction,
    name: Option<String>,
) -> Result<(), OpError> {
    const OP: &str = "git_branch";
    let git = Git::new(OP, &path)?;
    let named = || -> Result<String, OpError> {
        let n = name.clone().unwrap_or_default();
        not_an_option(OP, "branch name", &n)?;
        Ok(n)
    };
    match action {
        GitBranchAction::List => {
            let current = git.current_branch().await?;
            let list = git.text(&["for-each-ref", "--format=%(refname:short)", "refs/heads/"]).await?;
            let branches = list.lines().map(str::to_string).collect();
            rpc.send(Response::GitBranches { current, branches }).await?;
            return Ok(());
        }
        GitBranchAction::Create => git.run(&["branch", &named()?]).await?,
        GitBranchAction::Checkout => git.run(&["switch", "--quiet", &named()?]).await?,
        GitBranchAction::Delete => git.run(&["branch", "-D", &named()?]).await?,
    };
    rpc.send(Response::Done).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_parses_branch_counts_renames_and_caps() {
        let out = b"## main...origin/main [ahead 2, behind 1]\0M  a.txt\0 M b.txt\0R  new.txt\0old.txt\0?? c d.txt\0";
        let (branch, ahead, behind, files, truncated) = parse_status(out);
        assert_eq!((branch.as_str(), ahead, behind, truncated), ("main", 2, 1, false));
        let rows: Vec<_> = files.iter().map(|f| (f.path.as_str(), f.staged.as_str(), f.unstaged.as_str())).collect();
        assert_eq!(rows, [("a.txt", "M", " "), ("b.txt", " ", "M"), ("new.txt", "R", " "), ("c d.txt", "?", "?")]);
        assert_eq!(parse_status(b"## No commits yet on trunk\0").0, "trunk");
        assert_eq!(parse_status(b"## HEAD (no branch)\0").0, "HEAD");
        assert_eq!(parse_status(b"## feature\0").1, 0);
        let many: Vec<u8> = (0..MAX_STATUS_FILES + 5).flat_map(|i| format!("?? f{i}\0").into_bytes()).collect();
        let (_, _, _, files, truncated) = parse_status(&many);
        assert_eq!((files.len(), truncated), (MAX_STATUS_FILES, true));
        // Garbage from a hostile repository never panics.
        for junk in [&b"\0\0"[..], b"x", b"## ", b"\xff\xfe\0\xc3", b"## a [ahead x]\0"] {
            let _ = parse_status(junk);
        }
    }

    #[tokio::test]
    async fn output_past_its_cap_is_drained_and_flagged() {
        let big = vec![b'x'; OUTPUT_CAP + 10_000];
        let (kept, over) = read_capped(Some(&big[..]), OUTPUT_CAP).await;
        assert_eq!((kept.len(), over), (OUTPUT_CAP, true));
        let (kept, over) = read_capped(Some(&b"short"[..]), STDERR_KEEP).await;
        assert_eq!((kept.as_slice(), over), (&b"short"[..], false));
    }

    #[test]
    fn authors_options_and_lanes() {
        assert_eq!(parse_author("op", "Ada <ada@example.com>").ok(), Some(("Ada".into(), "ada@example.com".into())));
        for bad in ["Ada", "<a@b>", "Ada <>", "Ada <a@b", "Ada <a<b>"] {
            assert_eq!(parse_author("op", bad).map_err(|e| e.kind).err(), Some(wire::ErrorKind::BadRequest), "{bad}");
        }
        assert!(not_an_option("op", "url", "--upload-pack=x").is_err());
        assert!(not_an_option("op", "url", "").is_err());
        assert!(not_an_option("op", "url", "https://example.com/r.git").is_ok());
        assert!(is_local("/srv/r.git") && is_local("file:///srv/r.git") && !is_local("https://x/r.git"));
    }
}
