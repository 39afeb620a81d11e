use super::*;
use crate::spdy::test_client::unhex;

fn headers(pairs: &[(&str, &str)]) -> Headers {
    let mut h = Headers::new();
    for (n, v) in pairs {
        h.insert(n, v);
    }
    h
}

fn round_trip(frames: Vec<Frame>) -> Result<(), SpdyError> {
    let limits = Limits::default();
    let (mut enc, mut dec) = (FrameEncoder::new()?, FrameDecoder::new(&limits));
    let mut wire = BytesMut::new();
    for frame in &frames {
        enc.encode(frame.clone(), &mut wire)?;
    }
    // Fed a byte at a time: partial frames wait for the rest.
    let mut src = BytesMut::new();
    let mut decoded = Vec::new();
    for b in wire {
        src.put_u8(b);
        if let Some(frame) = dec.decode(&mut src)? {
            decoded.push(frame);
        }
    }
    assert_eq!(decoded, frames);
    assert!(src.is_empty());
    Ok(())
}

#[test]
fn every_frame_type_round_trips() -> Result<(), SpdyError> {
    let h = headers(&[("streamtype", "data"), ("port", "80")]);
    round_trip(vec![
        Frame::SynStream {
            stream_id: 1,
            associated_to: 0,
            priority: 7,
            slot: 0,
            fin: false,
            unidirectional: true,
            headers: h.clone(),
        },
        Frame::SynStream {
            stream_id: 3,
            associated_to: 1,
            priority: 0,
            slot: 2,
            fin: true,
            unidirectional: false,
            headers: headers(&[("a", "b\0c")]),
        },
        Frame::SynReply { stream_id: 1, fin: false, headers: Headers::new() },
        Frame::SynReply { stream_id: 3, fin: true, headers: h.clone() },
        Frame::RstStream { stream_id: 5, status: rst::CANCEL },
        Frame::Settings {
            clear: true,
            entries: vec![Setting { flags: 1, id: 7, value: 65536 }, Setting { flags: 0, id: 4, value: 100 }],
        },
        Frame::Settings { clear: false, entries: vec![] },
        Frame::Ping { id: 0xdead_beef },
        Frame::GoAway { last_good_stream_id: 9, status: goaway::PROTOCOL_ERROR },
        Frame::Headers { stream_id: 1, fin: true, headers: h },
        Frame::WindowUpdate { stream_id: 1, delta: 1 << 20 },
        Frame::Data { stream_id: 1, fin: false, data: Bytes::from_static(b"hello") },
        Frame::Data { stream_id: 1, fin: true, data: Bytes::new() },
    ])
}

/// A SYN_STREAM as `github.com/moby/spdystream/spdy` (Go, v0.5.1) writes it: stream 1,
/// headers streamtype=error, port=8080, requestid=0.
#[test]
fn decodes_a_go_syn_stream() -> Result<(), SpdyError> {
    let hex = "800300010000003e0000000100000000000078f9e3c6a7c202253a48f95b044eea160616060c0c0c9c4590f8ca04a5634603704a2c294a4dcc851636aca9a0a800000000ffff";
    let wire = unhex(hex);
    let mut src = BytesMut::from(&wire[..]);
    let frame = FrameDecoder::new(&Limits::default()).decode(&mut src)?;
    let Some(Frame::SynStream { stream_id: 1, fin: false, headers, .. }) = frame else {
        panic!("not a SYN_STREAM: {frame:?}");
    };
    assert_eq!(headers.get("streamtype"), Some("error"));
    assert_eq!(headers.get("port"), Some("8080"));
    assert_eq!(headers.get("requestid"), Some("0"));
    Ok(())
}

#[test]
fn unknown_control_frames_are_skipped() -> Result<(), SpdyError> {
    let mut src = BytesMut::new();
    put_control(&mut src, 10, 0, b"credential")?;
    put_control(&mut src, TYPE_PING, 0, &7u32.to_be_bytes())?;
    let frame = FrameDecoder::new(&Limits::default()).decode(&mut src)?;
    assert_eq!(frame, Some(Frame::Ping { id: 7 }));
    Ok(())
}

#[test]
fn malformed_frames_are_refused() -> Result<(), SpdyError> {
    let limits = Limits::default();
    let mut src = BytesMut::new();
    put_control(&mut src, TYPE_PING, 0, &[0, 0, 0, 1, 2])?;
    assert!(matches!(FrameDecoder::new(&limits).decode(&mut src), Err(SpdyError::BadFrame(_))));
    let mut src = BytesMut::new();
    put_head(&mut src, 0x8000_0000 | 2 << 16 | 6, 0, &[0; 4])?;
    assert!(matches!(FrameDecoder::new(&limits).decode(&mut src), Err(SpdyError::Version(2))));
    let mut src = BytesMut::new();
    put_control(&mut src, TYPE_SETTINGS, 0, &[0, 0, 0, 2, 0, 0, 0, 1])?;
    assert!(FrameDecoder::new(&limits).decode(&mut src).is_err());
    Ok(())
}

#[test]
fn data_frame_over_the_cap_is_refused_from_its_header() -> Result<(), SpdyError> {
    let limits = Limits { max_frame_size: 16, ..Limits::default() };
    let mut src = BytesMut::new();
    put_head(&mut src, 1, 0, &[0; 17])?;
    src.truncate(HEADER_LEN);
    assert!(matches!(FrameDecoder::new(&limits).decode(&mut src), Err(SpdyError::FrameTooLarge { len: 17, cap: 16 })));
    Ok(())
}

#[test]
fn header_block_over_the_cap_is_refused() -> Result<(), SpdyError> {
    let limits = Limits { max_header_block: 32, ..Limits::default() };
    let mut src = BytesMut::new();
    put_control(&mut src, TYPE_SYN_STREAM, 0, &[0; 33])?;
    assert!(matches!(FrameDecoder::new(&limits).decode(&mut src), Err(SpdyError::FrameTooLarge { len: 33, cap: 32 })));
    Ok(())
}
