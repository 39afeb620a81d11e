//! Test helpers: drive an op through [`Rpc::pair`] the way the connection engine would.

use crate::error::OpError;
use crate::rpc::{Input, Rpc, RpcPeer};
use std::future::Future;
use std::path::Path;
use wire::{ErrorKind, Response};

/// A path as the request string.
pub(crate) fn p(path: &Path) -> String {
    path.to_string_lossy().into_owned()
}

/// Runs `op` with `inputs` fed as continuation frames (the input ends after the last one)
/// and returns every frame it sent, plus the engine's `error` frame if it failed.
pub(crate) async fn drive<F, Fut>(inputs: Vec<Input>, op: F) -> Vec<Response>
where
    F: FnOnce(Rpc) -> Fut,
    Fut: Future<Output = Result<(), OpError>> + Send + 'static,
{
    let (rpc, peer) = Rpc::pair(4);
    let RpcPeer { mut out, input } = peer;
    let task = tokio::spawn(op(rpc));
    let feeder = tokio::spawn(async move {
        for i in inputs {
            if input.send(i).await.is_err() {
                break;
            }
        }
    });
    let mut frames = Vec::new();
    while let Some(f) = out.recv().await {
        frames.push(f);
    }
    let r = task.await.expect("op task panicked");
    feeder.abort();
    if let Err(e) = r {
        frames.push(e.to_frame());
    }
    frames
}

/// The kind of the final `error` frame, if the op failed.
pub(crate) fn kind_of_err(frames: &[Response]) -> Option<ErrorKind> {
    match frames.last() {
        Some(Response::Error { kind, .. }) => Some(*kind),
        _ => None,
    }
}

/// The sorted names in `dir`.
pub(crate) fn entries_named(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .expect("read_dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// Concatenates the payloads of `data` frames; panics on any frame but `data`/`done`.
pub(crate) fn data_of(frames: &[Response]) -> Vec<u8> {
    let mut out = Vec::new();
    for f in frames {
        match f {
            Response::Data { data } => out.extend_from_slice(&data.0),
            Response::Done => {}
            other => panic!("unexpected frame {other:?}"),
        }
    }
    out
}
