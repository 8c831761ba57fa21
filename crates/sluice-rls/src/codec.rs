//! The service's codec: protobuf (prost) as tonic's, with the request's bounds
//! read off its wire form before anything is decoded. A request of more than
//! [`MAX_DESCRIPTORS`] descriptors, or a descriptor of more than
//! [`MAX_ENTRIES`] entries, is refused with `RESOURCE_EXHAUSTED` after a scan
//! that allocates nothing and stops at the first descriptor past the bound: a
//! 4 MiB message of 250,000 descriptors costs its bytes' arrival and a look at
//! the first 1,025, never 250,000 decoded descriptors (each a few allocations)
//! or their matching.
//!
//! A request is decoded as [`WireRequest`]: each descriptor entry's key and
//! value as bytes, checked for UTF-8 as they become the engine's strings (see
//! [`crate::call_of_wire`]), so that a request whose header bytes are not
//! UTF-8 is answered, never failed.

use prost::Message as _;
use sluice_edge::descriptors::{MAX_DESCRIPTORS, MAX_ENTRIES};
use tonic::Status;
use tonic::codec::{Codec, DecodeBuf, Decoder};

use crate::proto::RateLimitResponse;
use crate::proto::rate_limit_descriptor::RateLimitOverride;

/// Encodes answers as tonic's prost codec does; decodes requests within the
/// bounds.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct RlsCodec;

impl Codec for RlsCodec {
    type Encode = RateLimitResponse;
    type Decode = WireRequest;
    type Encoder = tonic_prost::ProstEncoder<RateLimitResponse>;
    type Decoder = RequestDecoder;

    fn encoder(&mut self) -> Self::Encoder {
        tonic_prost::ProstEncoder::default()
    }

    fn decoder(&mut self) -> Self::Decoder {
        RequestDecoder
    }
}

/// Decodes a request within the bounds (see the module docs).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct RequestDecoder;

impl Decoder for RequestDecoder {
    type Item = WireRequest;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<WireRequest>, Status> {
        use bytes::Buf as _;
        // tonic hands a decoder the whole message in one contiguous buffer.
        if buf.chunk().len() < buf.remaining() {
            return Err(Status::internal("a request message in pieces"));
        }
        if let Some(past) = past_bounds(buf.chunk()) {
            metrics::counter!("sluice_rls_refused_total", "reason" => past.reason()).increment(1);
            return Err(Status::resource_exhausted(past.to_string()));
        }
        WireRequest::decode(buf)
            .map(Some)
            .map_err(|error| Status::internal(error.to_string()))
    }
}

/// `envoy.service.ratelimit.v3.RateLimitRequest` as the service decodes it:
/// [`crate::proto::RateLimitRequest`]'s fields and numbers, but each
/// descriptor entry's key and value read as bytes. Protobuf's `string` and
/// `bytes` share one wire form, so this reads every message the generated type
/// reads, and also one whose key or value is not UTF-8, which the generated
/// type fails (`INTERNAL`: an error Envoy's `failure_mode_deny: false` lets
/// through). The check prost made while decoding is made when the bytes become
/// the engine's strings (`String::from_utf8`, which keeps the buffer): the same
/// work, no copy.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct WireRequest {
    /// `domain` (set by Envoy's configuration, never by a client's request).
    #[prost(string, tag = "1")]
    pub(crate) domain: String,
    /// `descriptors`.
    #[prost(message, repeated, tag = "2")]
    pub(crate) descriptors: Vec<WireDescriptor>,
    /// `hits_addend`.
    #[prost(uint32, tag = "3")]
    pub(crate) hits_addend: u32,
}

/// `envoy.extensions.common.ratelimit.v3.RateLimitDescriptor`, its entries
/// read as bytes.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct WireDescriptor {
    /// `entries`.
    #[prost(message, repeated, tag = "1")]
    pub(crate) entries: Vec<WireEntry>,
    /// `limit`.
    #[prost(message, optional, tag = "2")]
    pub(crate) limit: Option<RateLimitOverride>,
    /// `hits_addend` (a `google.protobuf.UInt64Value`).
    #[prost(message, optional, tag = "3")]
    pub(crate) hits_addend: Option<u64>,
}

/// `RateLimitDescriptor.Entry`: its key and value as the client's bytes.
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub(crate) struct WireEntry {
    /// `key`.
    #[prost(bytes = "vec", tag = "1")]
    pub(crate) key: Vec<u8>,
    /// `value`.
    #[prost(bytes = "vec", tag = "2")]
    pub(crate) value: Vec<u8>,
}

/// Which bound a request passes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum PastBounds {
    /// More descriptors than [`MAX_DESCRIPTORS`].
    #[error(
        "a request of more than {MAX_DESCRIPTORS} descriptors: the rate-limit service reads at most {MAX_DESCRIPTORS}"
    )]
    Descriptors,
    /// A descriptor of more entries than [`MAX_ENTRIES`].
    #[error(
        "a descriptor of more than {MAX_ENTRIES} entries: the rate-limit service reads at most {MAX_ENTRIES}"
    )]
    Entries,
}

impl PastBounds {
    /// `sluice_rls_refused_total`'s `reason`.
    pub(crate) fn reason(self) -> &'static str {
        match self {
            PastBounds::Descriptors => "too_many_descriptors",
            PastBounds::Entries => "too_many_entries",
        }
    }
}

/// The bound a `RateLimitRequest` in wire form passes, if any. Counts its
/// descriptors (field 2) and each one's entries (field 1), stopping at the
/// first past its bound. A message it cannot read is left to the decoder,
/// which refuses it: every field before the unreadable one was counted, and
/// nothing after it is decoded.
pub(crate) fn past_bounds(message: &[u8]) -> Option<PastBounds> {
    let mut descriptors = 0;
    for (field, value) in Fields::new(message) {
        if let (2, Some(descriptor)) = (field, value) {
            descriptors += 1;
            if descriptors > MAX_DESCRIPTORS {
                return Some(PastBounds::Descriptors);
            }
            let entries = Fields::new(descriptor)
                .filter(|&(field, value)| field == 1 && value.is_some())
                .take(MAX_ENTRIES + 1)
                .count();
            if entries > MAX_ENTRIES {
                return Some(PastBounds::Entries);
            }
        }
    }
    None
}

/// The top-level fields of a protobuf message in wire form: each field's
/// number, and its bytes when it is length-delimited. Fields inside a group
/// (a deprecated wire type prost skips) are not top-level and are passed
/// over; the walk ends where the message cannot be read.
struct Fields<'m> {
    rest: &'m [u8],
    /// Groups open around the current field.
    depth: usize,
}

impl<'m> Fields<'m> {
    fn new(message: &'m [u8]) -> Self {
        Fields {
            rest: message,
            depth: 0,
        }
    }

    /// The next varint, or `None` at the end or past ten bytes.
    fn varint(&mut self) -> Option<u64> {
        let mut value = 0_u64;
        for i in 0..10 {
            let (&byte, rest) = self.rest.split_first()?;
            self.rest = rest;
            value |= u64::from(byte & 0x7f) << (7 * i);
            if byte & 0x80 == 0 {
                return Some(value);
            }
        }
        None
    }

    /// Passes over `n` bytes, returning them.
    fn take(&mut self, n: u64) -> Option<&'m [u8]> {
        let n = usize::try_from(n).ok()?;
        if n > self.rest.len() {
            return None;
        }
        let (taken, rest) = self.rest.split_at(n);
        self.rest = rest;
        Some(taken)
    }
}

impl<'m> Iterator for Fields<'m> {
    type Item = (u64, Option<&'m [u8]>);

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if self.rest.is_empty() {
                return None;
            }
            let key = self.varint()?;
            let field = key >> 3;
            let value = match key & 7 {
                0 => self.varint().map(|_| None)?,
                1 => self.take(8).map(|_| None)?,
                2 => {
                    let len = self.varint()?;
                    Some(self.take(len)?)
                }
                3 => {
                    self.depth += 1;
                    continue;
                }
                4 => {
                    self.depth = self.depth.checked_sub(1)?;
                    continue;
                }
                5 => self.take(4).map(|_| None)?,
                _ => return None,
            };
            if self.depth == 0 {
                return Some((field, value));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::rate_limit_descriptor::Entry;
    use crate::proto::{RateLimitDescriptor, RateLimitRequest};

    fn request(descriptors: usize, entries: usize) -> Vec<u8> {
        let descriptor = RateLimitDescriptor {
            entries: (0..entries)
                .map(|i| Entry {
                    key: format!("k{i}"),
                    value: "v".to_owned(),
                })
                .collect(),
            limit: None,
            hits_addend: Some(1),
        };
        RateLimitRequest {
            domain: "api".to_owned(),
            descriptors: vec![descriptor; descriptors],
            hits_addend: 3,
        }
        .encode_to_vec()
    }

    #[test]
    fn r1_bounds_descriptors_and_entries_are_counted_on_the_wire() {
        assert_eq!(past_bounds(&request(MAX_DESCRIPTORS, MAX_ENTRIES)), None);
        assert_eq!(
            past_bounds(&request(MAX_DESCRIPTORS + 1, 1)),
            Some(PastBounds::Descriptors)
        );
        assert_eq!(
            past_bounds(&request(1, MAX_ENTRIES + 1)),
            Some(PastBounds::Entries)
        );
        assert_eq!(past_bounds(&[]), None, "an empty request");
    }

    /// R1: the service's request type reads every message Envoy's generated
    /// type reads, into the same call, and also one whose key or value is not
    /// UTF-8, which the generated type fails (`INTERNAL`, let through by
    /// Envoy's `failure_mode_deny: false`): that one is `NotUtf8`.
    #[test]
    fn r1_a_request_is_read_as_the_generated_type_reads_it_and_not_utf8_too() {
        use crate::proto::rate_limit_descriptor::RateLimitOverride;
        let mut generated = RateLimitRequest::decode(&request(2, 3)[..]).expect("decodes");
        generated.descriptors[1].limit = Some(RateLimitOverride {
            requests_per_unit: 5,
            unit: 2,
        });
        let message = generated.encode_to_vec();
        let wire = WireRequest::decode(&message[..]).expect("decodes");
        let call = crate::call_of_wire(wire).expect("UTF-8");
        assert_eq!(call, crate::call_of(generated));
        assert_eq!(
            call.descriptors[1].entries[2],
            ("k2".to_owned(), "v".to_owned())
        );

        for (key, value) in [(&b"user"[..], &b"caf\xe9"[..]), (b"\xff", b"v")] {
            let bad = WireRequest {
                domain: "api".to_owned(),
                descriptors: vec![WireDescriptor {
                    entries: vec![WireEntry {
                        key: key.to_vec(),
                        value: value.to_vec(),
                    }],
                    limit: None,
                    hits_addend: None,
                }],
                hits_addend: 0,
            }
            .encode_to_vec();
            assert!(
                RateLimitRequest::decode(&bad[..]).is_err(),
                "prost's string fails it"
            );
            let wire = WireRequest::decode(&bad[..]).expect("read as bytes");
            let refused = crate::call_of_wire(wire).expect_err("not UTF-8");
            assert_eq!((refused.domain.as_str(), refused.descriptors), ("api", 1));
        }
    }

    /// A group (wire types 3 and 4) around descriptor fields hides nothing:
    /// what is inside it is not a descriptor (prost skips it), and what comes
    /// after it is counted.
    #[test]
    fn r1_bounds_a_group_does_not_hide_what_follows_it() {
        let mut message = vec![(9 << 3) | 3];
        message.extend(request(5, 1));
        message.push((9 << 3) | 4);
        assert_eq!(past_bounds(&message), None, "five inside a group");
        message.extend(request(MAX_DESCRIPTORS + 1, 1));
        assert_eq!(past_bounds(&message), Some(PastBounds::Descriptors));
        let decoded = RateLimitRequest::decode(&request(3, 2)[..]).expect("decodes");
        assert_eq!(decoded.descriptors.len(), 3);
    }
}
