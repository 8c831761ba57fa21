//! HTTP/1.1 framing for a proxy that serves the common request without building it
//! as `http` types: request and response heads parsed in place (httparse), the end
//! of a chunked body found without decoding it, the field rules every intermediary
//! applies, a connection's successive deadlines on one timer, and a socket with bytes
//! put back in front of it (to hand a connection over to hyper).
//!
//! What a request means — its route, its budgets, the head sent upstream — is the
//! gateway's; this crate only says how a message is framed, strictly enough that a
//! message it cannot frame is an error, never a guess.
//!
//! ```
//! use std::mem::MaybeUninit;
//! use sluice_h1::request::{self, Parsed, MAX_HEADERS};
//!
//! let raw = b"POST /v1/chats?x=1 HTTP/1.1\r\nhost: api\r\ncontent-length: 2\r\n\r\n{}";
//! let mut storage = [const { MaybeUninit::uninit() }; MAX_HEADERS];
//! let Parsed::Ready(head) = request::parse(raw, &mut storage) else { panic!("a complete head") };
//! assert_eq!(head.body_len, 2);
//! assert_eq!(head.path_and_query(), ("/v1/chats", "?x=1"));
//! assert_eq!(&raw[head.len..], b"{}");
//! ```

pub mod chunked;
pub mod deadline;
pub mod fields;
pub mod request;
pub mod response;
pub mod rewind;
pub mod target;
