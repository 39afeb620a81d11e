//! Fuzzes the decoder: arbitrary bytes through the frame splitter and both frame parsers.
//! Nothing may panic, no frame may exceed the cap, and every request that decodes must
//! re-encode and decode to the same value.
#![no_main]

use libfuzzer_sys::fuzz_target;
use wire::codec::{decode_request, decode_response, encode_request, encode_response, FrameSplitter, MAX_FRAME};

fuzz_target!(|data: &[u8]| {
    let mut splitter = FrameSplitter::new();
    // Feed in uneven pieces so frames straddle pushes.
    for piece in data.chunks(7) {
        splitter.push(piece);
        while let Some(frame) = splitter.next_frame() {
            let Ok(frame) = frame else { continue };
            assert!(frame.len() < MAX_FRAME);
            if let Ok(req) = decode_request(&frame) {
                let bytes = encode_request(&req).expect("a decoded request re-encodes");
                assert_eq!(decode_request(&bytes).expect("re-decodes"), req);
            }
            if let Ok(resp) = decode_response(&frame) {
                let bytes = encode_response(&resp).expect("a decoded response re-encodes");
                assert_eq!(decode_response(&bytes).expect("re-decodes"), resp);
            }
        }
        assert!(splitter.buffered() <= MAX_FRAME);
    }
});
