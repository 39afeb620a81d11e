//! `fs_watch {path, recursive?}` → `ready`, then `event{kind, path}`… until disconnect.
//!
//! Backed by inotify through the `notify` crate. `ready` is sent only after every watch
//! is armed (for `recursive`, on every existing subdirectory), so any change made after
//! the client sees `ready` is reported. Directories created later under a recursive watch
//! are added as they appear (changes inside a new directory in the instant before its
//! watch is armed can be missed — an inotify limitation).
//!
//! Event mapping (`path` is absolute): create → `created`; delete → `deleted`; write,
//! truncate, chmod/chown/touch → `modified`; each side of a rename (and the watched path
//! itself moving) → `renamed`. Opens/closes/reads are not reported.
//!
//! The stream ends when the client goes away (input ends or the reply channel closes).
//! If the input ends but the connection is still open (the client sent its next request),
//! a `done` is sent so the RPC ends cleanly. Overflow — the kernel's inotify queue
//! (`IN_Q_OVERFLOW`) or our own [`QUEUE`] of events waiting for a slow client — fails the
//! op (`internal "fs_watch: event queue overflow…"`) rather than silently dropping events.

use super::{blocking, display, io_err, resolve};
use crate::error::OpError;
use crate::rpc::Rpc;
use notify::event::{EventKind as NEvent, ModifyKind, RenameMode};
use notify::{RecursiveMode, Watcher};
use std::sync::Arc;
use tokio::sync::{mpsc, Notify};
use wire::{EventKind, Response};

const OP: &str = "fs_watch";

/// Events buffered between inotify and a slow client before we call it an overflow.
pub(crate) const QUEUE: usize = 16 * 1024;

/// Streams events under `path` until the client leaves.
pub async fn fs_watch(rpc: &mut Rpc, path: String, recursive: bool) -> Result<(), OpError> {
    let path = resolve(OP, &path)?;
    let (tx, mut rx) = mpsc::channel::<notify::Result<notify::Event>>(QUEUE);
    let overflow = Arc::new(Notify::new());
    let flag = overflow.clone();
    let handler = move |ev: notify::Result<notify::Event>| {
        if let Err(mpsc::error::TrySendError::Full(_)) = tx.try_send(ev) {
            flag.notify_one();
        }
    };
    let _watcher = blocking(OP, move || {
        std::fs::symlink_metadata(&path).map_err(|e| io_err(OP, &path, &e))?;
        let mut w = notify::recommended_watcher(handler).map_err(|e| watch_err(&e))?;
        let mode = if recursive { RecursiveMode::Recursive } else { RecursiveMode::NonRecursive };
        w.watch(&path, mode).map_err(|e| match &e.kind {
            notify::ErrorKind::PathNotFound => OpError::not_found(format!("{OP}: {}: {e}", display(&path))),
            _ => watch_err(&e),
        })?;
        Ok(w)
    })
    .await?;
    rpc.send(Response::Ready).await?;

    // Frames go out through a sender handle so the loop can await `rpc.input()` meanwhile.
    let out = rpc.sender();
    loop {
        tokio::select! {
            ev = rx.recv() => {
                let ev = match ev {
                    Some(Ok(ev)) => ev,
                    Some(Err(e)) => return Err(watch_err(&e)),
                    None => return Err(OpError::internal(format!("{OP}: watcher stopped"))),
                };
                if ev.need_rescan() {
                    return Err(OpError::internal(format!("{OP}: event queue overflow (inotify)")));
                }
                let Some(kind) = map_kind(&ev.kind) else { continue };
                for p in &ev.paths {
                    // A client too slow to take this frame must not stall overflow detection.
                    tokio::select! {
                        sent = out.send(Response::Event { kind, path: display(p) }) => {
                            if sent.is_err() {
                                return Ok(()); // client gone
                            }
                        }
                        () = overflow.notified() => return Err(queue_overflow()),
                    }
                }
            }
            () = overflow.notified() => return Err(queue_overflow()),
            input = rpc.input() => {
                if input.is_none() {
                    // Hung up, or its next request ended this RPC's input: end cleanly.
                    let _ = out.send(Response::Done).await;
                    return Ok(());
                }
                // Stray continuation frames are ignored.
            }
            () = out.closed() => return Ok(()),
        }
    }
}

fn queue_overflow() -> OpError {
    OpError::internal(format!("{OP}: event queue overflow ({QUEUE} events pending for a slow client)"))
}

fn watch_err(e: &notify::Error) -> OpError {
    match &e.kind {
        notify::ErrorKind::MaxFilesWatch => OpError::internal(format!("{OP}: inotify watch limit reached: {e}")),
        _ => OpError::internal(format!("{OP}: {e}")),
    }
}

/// The protocol kind for a notify event, or `None` for events we do not report.
fn map_kind(kind: &NEvent) -> Option<EventKind> {
    match kind {
        NEvent::Create(_) => Some(EventKind::Created),
        NEvent::Remove(_) => Some(EventKind::Deleted),
        // `Both` repeats the `From` and `To` events already reported.
        NEvent::Modify(ModifyKind::Name(RenameMode::Both)) => None,
        NEvent::Modify(ModifyKind::Name(_)) => Some(EventKind::Renamed),
        NEvent::Modify(_) => Some(EventKind::Modified),
        NEvent::Access(_) | NEvent::Any | NEvent::Other => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rpc::{Input, RpcPeer};
    use std::fs;
    use std::path::Path;
    use std::time::Duration;

    struct Watch {
        peer: RpcPeer,
        task: tokio::task::JoinHandle<Result<(), OpError>>,
    }

    async fn start(path: &Path, recursive: bool) -> Result<Watch, Response> {
        let (mut rpc, mut peer) = Rpc::pair(64);
        let path = path.to_string_lossy().into_owned();
        let task = tokio::spawn(async move { fs_watch(&mut rpc, path, recursive).await });
        match peer.out.recv().await {
            Some(Response::Ready) => Ok(Watch { peer, task }),
            Some(other) => Err(other),
            None => match task.await {
                Ok(Err(e)) => Err(e.to_frame()),
                other => panic!("watch ended without a reply: {other:?}"),
            },
        }
    }

    impl Watch {
        /// Waits for an event of `kind` on `path`, skipping others.
        async fn expect(&mut self, kind: EventKind, path: &Path) {
            let want = Response::Event { kind, path: display(path) };
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            let mut seen = Vec::new();
            loop {
                match tokio::time::timeout_at(deadline, self.peer.out.recv()).await {
                    Ok(Some(f)) if f == want => return,
                    Ok(Some(f)) => seen.push(f),
                    other => panic!("no {want:?}: got {other:?} after {seen:?}"),
                }
            }
        }
    }

    #[tokio::test]
    async fn reports_create_modify_rename_delete() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut w = start(dir.path(), false).await.expect("ready");
        let f = dir.path().join("f.txt");
        fs::write(&f, b"1").expect("write");
        w.expect(EventKind::Created, &f).await;
        fs::write(&f, b"22").expect("write");
        w.expect(EventKind::Modified, &f).await;
        let g = dir.path().join("g.txt");
        fs::rename(&f, &g).expect("rename");
        w.expect(EventKind::Renamed, &f).await;
        w.expect(EventKind::Renamed, &g).await;
        fs::remove_file(&g).expect("rm");
        w.expect(EventKind::Deleted, &g).await;

        // A hang-up ends the op cleanly.
        drop(w.peer);
        let r = tokio::time::timeout(Duration::from_secs(10), w.task).await;
        assert!(matches!(r, Ok(Ok(Ok(())))), "{r:?}");
    }

    #[tokio::test]
    async fn recursive_sees_existing_and_new_subdirs_and_ends_with_done_on_next_request() {
        let dir = tempfile::tempdir().expect("tempdir");
        fs::create_dir(dir.path().join("old")).expect("mkdir");
        let mut w = start(dir.path(), true).await.expect("ready");
        let a = dir.path().join("old/a");
        fs::write(&a, b"x").expect("write");
        w.expect(EventKind::Created, &a).await;
        let new = dir.path().join("new");
        fs::create_dir(&new).expect("mkdir");
        w.expect(EventKind::Created, &new).await;
        // Give notify a moment to arm the new directory's watch.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let b = new.join("b");
        fs::write(&b, b"x").expect("write");
        w.expect(EventKind::Created, &b).await;

        // A stray data frame is ignored; the input ending (next request) sends done.
        w.peer.input.send(Input::Data(b"x".to_vec())).await.expect("send");
        let RpcPeer { mut out, input } = w.peer;
        drop(input);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            match tokio::time::timeout_at(deadline, out.recv()).await {
                Ok(Some(Response::Done)) => break,
                Ok(Some(Response::Event { .. })) => continue,
                other => panic!("expected done, got {other:?}"),
            }
        }
        assert!(matches!(w.task.await, Ok(Ok(()))));
    }

    #[tokio::test]
    async fn non_recursive_ignores_subdirs_and_missing_path_is_not_found() {
        let dir = tempfile::tempdir().expect("tempdir");
        fs::create_dir(dir.path().join("sub")).expect("mkdir");
        let mut w = start(dir.path(), false).await.expect("ready");
        fs::write(dir.path().join("sub/inner"), b"x").expect("write");
        let top = dir.path().join("top");
        fs::write(&top, b"x").expect("write");
        // The first event after the inner write is about `top`, not `inner`.
        let first = tokio::time::timeout(Duration::from_secs(10), w.peer.out.recv()).await;
        assert_eq!(first.ok().flatten(), Some(Response::Event { kind: EventKind::Created, path: display(&top) }));

        match start(&dir.path().join("missing"), false).await {
            Err(Response::Error { kind, .. }) => assert_eq!(kind, wire::ErrorKind::NotFound),
            Err(other) => panic!("{other:?}"),
            Ok(_) => panic!("watch on a missing path armed"),
        }
    }

    #[tokio::test]
    async fn a_client_that_stops_reading_overflows_the_queue() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut rpc, mut peer) = Rpc::pair(1);
        let path = dir.path().to_string_lossy().into_owned();
        let task = tokio::spawn(async move { fs_watch(&mut rpc, path, false).await });
        assert_eq!(peer.out.recv().await, Some(Response::Ready));
        // Never read again: generate more events than the queue holds (creates + modifies).
        let root = dir.path().to_path_buf();
        tokio::task::spawn_blocking(move || {
            for i in 0..(QUEUE / 2 + 100) {
                let _ = fs::write(root.join(format!("f{i}")), b"x");
            }
        })
        .await
        .expect("writer");
        let r = tokio::time::timeout(Duration::from_secs(30), task).await;
        match r {
            Ok(Ok(Err(e))) => {
                assert_eq!(e.kind, wire::ErrorKind::Internal);
                assert!(e.message.contains("overflow"), "{}", e.message);
            }
            other => panic!("expected an overflow error, got {other:?}"),
        }
        drop(peer);
    }

    #[test]
    fn kinds_map() {
        use notify::event::{AccessKind, CreateKind, DataChange, MetadataKind, RemoveKind};
        assert_eq!(map_kind(&NEvent::Create(CreateKind::File)), Some(EventKind::Created));
        assert_eq!(map_kind(&NEvent::Remove(RemoveKind::Any)), Some(EventKind::Deleted));
        assert_eq!(map_kind(&NEvent::Modify(ModifyKind::Data(DataChange::Any))), Some(EventKind::Modified));
        assert_eq!(map_kind(&NEvent::Modify(ModifyKind::Metadata(MetadataKind::Any))), Some(EventKind::Modified));
        assert_eq!(map_kind(&NEvent::Modify(ModifyKind::Name(RenameMode::From))), Some(EventKind::Renamed));
        assert_eq!(map_kind(&NEvent::Modify(ModifyKind::Name(RenameMode::Both))), None);
        assert_eq!(map_kind(&NEvent::Access(AccessKind::Any)), None);
    }
}
