//! Reading a request body under a size cap and a total deadline.

use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use http_body_util::{BodyExt as _, Limited};

/// Why a body could not be read.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    /// The body is larger than the cap.
    #[error("request body over {limit} bytes")]
    TooLarge {
        /// The cap.
        limit: usize,
    },
    /// The client did not send the whole body in time.
    #[error("request body not received within {} s", .limit.as_secs_f64())]
    Timeout {
        /// The deadline.
        limit: Duration,
    },
    /// The connection failed while reading.
    #[error("reading the request body")]
    Read(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// Reads `body` whole, refusing more than `limit` bytes or taking longer than `deadline` in
/// total (a body trickled byte by byte is cut off at the deadline, not kept alive by each byte).
pub async fn read_body(body: Body, limit: usize, deadline: Duration) -> Result<Bytes, BodyError> {
    let collect = Limited::new(body, limit).collect();
    match tokio::time::timeout(deadline, collect).await {
        Err(_) => Err(BodyError::Timeout { limit: deadline }),
        Ok(Ok(c)) => Ok(c.to_bytes()),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => Err(BodyError::TooLarge { limit }),
        Ok(Err(e)) => Err(BodyError::Read(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt as _;

    #[tokio::test]
    async fn cap_and_deadline() {
        let ok = read_body(Body::from("hello"), 5, Duration::from_secs(1)).await.expect("fits");
        assert_eq!(&ok[..], b"hello");
        let e = read_body(Body::from("hello!"), 5, Duration::from_secs(1)).await.expect_err("over the cap");
        assert!(matches!(e, BodyError::TooLarge { limit: 5 }), "{e:?}");
        // One byte every 50 ms for ever: the total deadline ends it.
        let trickle =
            futures::stream::repeat_with(|| Ok::<_, std::io::Error>(Bytes::from_static(b"x"))).then(|b| async move {
                tokio::time::sleep(Duration::from_millis(50)).await;
                b
            });
        let e = read_body(Body::from_stream(trickle), 1 << 20, Duration::from_millis(300)).await.expect_err("slow");
        assert!(matches!(e, BodyError::Timeout { .. }), "{e:?}");
    }
}
