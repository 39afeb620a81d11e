//! SPDY/3 name/value header blocks (SPDY Protocol Draft 3, section 2.6.10): the block's layout
//! and its zlib compression, one compression context per direction for the whole connection,
//! primed with [`HEADER_DICTIONARY`] and sync-flushed after every block.
//!
//! The Go peer is `github.com/moby/spdystream/spdy` (`write.go` `writeHeaderValueBlock`,
//! `read.go` `parseHeaderValueBlock`).

use flate2::{Compress, Compression, Decompress, FlushCompress, FlushDecompress, Status};

use super::dictionary::HEADER_DICTIONARY;
use super::SpdyError;

/// Separates the values of a header sent more than once.
const VALUE_SEPARATOR: char = '\0';

/// A stream's headers, names lower-case (SPDY/3 requires it on the wire).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Headers(Vec<(String, String)>);

impl Headers {
    /// No headers.
    pub fn new() -> Headers {
        Headers::default()
    }

    /// Sets `name` (lower-cased) to `value`, replacing any earlier value.
    pub fn insert(&mut self, name: &str, value: &str) {
        let name = name.to_ascii_lowercase();
        match self.0.iter_mut().find(|(n, _)| *n == name) {
            Some(entry) => entry.1 = value.to_owned(),
            None => self.0.push((name, value.to_owned())),
        }
    }

    /// The first value of `name` (any case).
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).and_then(|(_, v)| v.split(VALUE_SEPARATOR).next())
    }

    /// All entries, in order; a value sent several times holds its values NUL-separated.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(n, v)| (n.as_str(), v.as_str()))
    }

    /// Lays the block out uncompressed: a count, then length-prefixed names and values.
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        put_len(&mut out, self.0.len());
        for (name, value) in &self.0 {
            put_len(&mut out, name.len());
            out.extend_from_slice(name.as_bytes());
            put_len(&mut out, value.len());
            out.extend_from_slice(value.as_bytes());
        }
        out
    }

    /// Reads an uncompressed block; names must be non-empty, lower-case and unique.
    fn decode(block: &[u8]) -> Result<Headers, SpdyError> {
        let mut rest = block;
        let count = take_len(&mut rest)?;
        let mut headers = Headers::new();
        for _ in 0..count {
            let name = take_string(&mut rest)?;
            let value = take_string(&mut rest)?;
            if name.is_empty() || name.bytes().any(|b| b.is_ascii_uppercase()) {
                return Err(SpdyError::BadHeaderBlock("header name empty or not lower-case"));
            }
            if headers.0.iter().any(|(n, _)| *n == name) {
                return Err(SpdyError::BadHeaderBlock("header name repeated"));
            }
            headers.0.push((name, value));
        }
        if !rest.is_empty() {
            return Err(SpdyError::BadHeaderBlock("bytes after the last header"));
        }
        Ok(headers)
    }
}

fn put_len(out: &mut Vec<u8>, len: usize) {
    // Our own headers are a few short strings; a length over u32 cannot occur.
    out.extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_be_bytes());
}

fn take_len(rest: &mut &[u8]) -> Result<usize, SpdyError> {
    let (len, tail) = rest.split_first_chunk::<4>().ok_or(SpdyError::BadHeaderBlock("truncated length"))?;
    *rest = tail;
    Ok(u32::from_be_bytes(*len) as usize)
}

fn take_string(rest: &mut &[u8]) -> Result<String, SpdyError> {
    let len = take_len(rest)?;
    if len > rest.len() {
        return Err(SpdyError::BadHeaderBlock("truncated string"));
    }
    let (bytes, tail) = rest.split_at(len);
    *rest = tail;
    String::from_utf8(bytes.to_vec()).map_err(|_| SpdyError::BadHeaderBlock("header not UTF-8"))
}

/// Our outbound compression context.
pub(crate) struct HeaderCompressor {
    zlib: Compress,
}

impl HeaderCompressor {
    pub(crate) fn new() -> Result<HeaderCompressor, SpdyError> {
        let mut zlib = Compress::new(Compression::default(), true);
        zlib.set_dictionary(&HEADER_DICTIONARY).map_err(|e| SpdyError::Compress(e.to_string()))?;
        Ok(HeaderCompressor { zlib })
    }

    /// The compressed block of `headers`, sync-flushed so the peer can decode it now.
    pub(crate) fn compress(&mut self, headers: &Headers) -> Result<Vec<u8>, SpdyError> {
        let input = headers.encode();
        let mut out = Vec::with_capacity(input.len() + 64);
        let start = self.zlib.total_in();
        loop {
            let consumed = usize::try_from(self.zlib.total_in() - start).unwrap_or(usize::MAX);
            let written = out.len();
            self.zlib
                .compress_vec(&input[consumed..], &mut out, FlushCompress::Sync)
                .map_err(|e| SpdyError::Compress(e.to_string()))?;
            let consumed = usize::try_from(self.zlib.total_in() - start).unwrap_or(usize::MAX);
            // Done once all input went in and the flush left room in the buffer.
            if consumed == input.len() && out.len() < out.capacity() {
                return Ok(out);
            }
            if out.len() == out.capacity() {
                out.reserve(256);
            } else if out.len() == written && consumed < input.len() {
                return Err(SpdyError::Compress("no progress in header block".into()));
            }
        }
    }
}

/// The peer's compression context, mirrored.
pub(crate) struct HeaderDecompressor {
    zlib: Decompress,
    /// Largest decompressed block accepted: the cap against decompression bombs.
    max_bytes: usize,
}

impl HeaderDecompressor {
    pub(crate) fn new(max_bytes: usize) -> HeaderDecompressor {
        HeaderDecompressor { zlib: Decompress::new(true), max_bytes }
    }

    /// Decompresses and parses one block; refuses a block that inflates past `max_bytes`.
    pub(crate) fn decompress(&mut self, block: &[u8]) -> Result<Headers, SpdyError> {
        let mut out: Vec<u8> = Vec::with_capacity(self.max_bytes.min(1024) + 1);
        let mut consumed = 0;
        loop {
            let (in_before, out_before) = (self.zlib.total_in(), out.len());
            match self.zlib.decompress_vec(&block[consumed..], &mut out, FlushDecompress::Sync) {
                Ok(Status::Ok | Status::BufError) => {}
                Ok(Status::StreamEnd) => return Err(SpdyError::BadHeaderBlock("compression stream ended")),
                Err(e) if e.needs_dictionary().is_some() => {
                    self.zlib.set_dictionary(&HEADER_DICTIONARY).map_err(|e| SpdyError::Decompress(e.to_string()))?;
                }
                Err(e) => return Err(SpdyError::Decompress(e.to_string())),
            }
            consumed += usize::try_from(self.zlib.total_in() - in_before).unwrap_or(usize::MAX);
            if out.len() > self.max_bytes {
                return Err(SpdyError::HeadersTooLarge(self.max_bytes));
            }
            let full = out.len() == out.capacity();
            if consumed >= block.len() && !full {
                return Headers::decode(&out);
            }
            if full {
                // Grow towards one byte past the cap, which is enough to tell a bomb.
                let room = (out.capacity() * 2).min(self.max_bytes + 1) - out.len();
                out.reserve_exact(room.max(1));
            } else if consumed < block.len() && self.zlib.total_in() == in_before && out.len() == out_before {
                return Err(SpdyError::Decompress("no progress in header block".into()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spdy::test_client::unhex;

    fn sample() -> Headers {
        let mut h = Headers::new();
        h.insert("StreamType", "error");
        h.insert("port", "8080");
        h.insert("requestID", "0");
        h
    }

    fn sorted(h: &Headers) -> Vec<(String, String)> {
        let mut v: Vec<_> = h.iter().map(|(n, v)| (n.to_owned(), v.to_owned())).collect();
        v.sort();
        v
    }

    #[test]
    fn insert_lowercases_and_replaces() {
        let mut h = sample();
        h.insert("PORT", "9090");
        assert_eq!(h.get("Port"), Some("9090"));
        assert_eq!(h.iter().count(), 3);
        assert_eq!(h.get("streamtype"), Some("error"));
    }

    #[test]
    fn round_trip_shares_the_context_across_blocks() -> Result<(), SpdyError> {
        let (mut c, mut d) = (HeaderCompressor::new()?, HeaderDecompressor::new(4096));
        let mut second = sample();
        second.insert("streamtype", "data");
        for h in [sample(), second, Headers::new(), sample()] {
            let block = c.compress(&h)?;
            assert_eq!(d.decompress(&block)?, h);
        }
        Ok(())
    }

    /// Two SYN_STREAM header blocks written by `github.com/moby/spdystream/spdy`'s Framer (Go,
    /// v0.5.1), the second compressed in the context the first left. Go writes map order, so
    /// only the set of headers is compared.
    #[test]
    fn reads_blocks_compressed_by_the_go_framer() -> Result<(), SpdyError> {
        let first = unhex(
            "78f9e3c6a7c202253a48f95b044eea160616060c0c0c9c4590f8ca04a5634603704a2c294a4dcc851636aca9a0a800000000ffff",
        );
        let second = unhex("826a469502954389848d04000000ffff");
        let mut d = HeaderDecompressor::new(4096);
        assert_eq!(sorted(&d.decompress(&first)?), sorted(&sample()));
        let mut data = sample();
        data.insert("streamtype", "data");
        assert_eq!(sorted(&d.decompress(&second)?), sorted(&data));
        Ok(())
    }

    #[test]
    fn decompression_bomb_is_refused() -> Result<(), SpdyError> {
        let mut big = Headers::new();
        big.insert("x", &"a".repeat(100_000));
        let block = HeaderCompressor::new()?.compress(&big)?;
        assert!(block.len() < 1000, "compresses well: {}", block.len());
        let mut d = HeaderDecompressor::new(16 * 1024);
        assert!(matches!(d.decompress(&block), Err(SpdyError::HeadersTooLarge(16384))));
        Ok(())
    }

    #[test]
    fn malformed_blocks_are_refused() {
        assert!(Headers::decode(&[0, 0, 0, 1, 0, 0, 0, 9]).is_err());
        assert!(Headers::decode(&[0, 0, 0, 1, 0, 0, 0, 1, b'A', 0, 0, 0, 0]).is_err());
        assert!(Headers::decode(&[0, 0, 0, 0, 7]).is_err());
        let dup = [0, 0, 0, 2, 0, 0, 0, 1, b'a', 0, 0, 0, 0, 0, 0, 0, 1, b'a', 0, 0, 0, 0];
        assert!(Headers::decode(&dup).is_err());
        assert!(HeaderDecompressor::new(64).decompress(b"not zlib at all").is_err());
    }
}
