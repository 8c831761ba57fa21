//! Phases 1 and 2 for every transport: [`Intake`].

mod pieces;

use std::net::IpAddr;

use bytes::{Buf, Bytes, BytesMut};
use http::{HeaderMap, Method, Response, Version};
use http_body_util::Full;
use sluice_policy::Route;
use sluice_store::BudgetStore;

use crate::exchange::{BodyRead, Planned};
use crate::{BufferFull, BufferLease, Limiter, Refused, RequestId};
use pieces::{Overrun, Pieces};

/// Why a transport could not take a body whole (see [`Intake::body_refusal`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum BodyFailure {
    /// Nothing came for the transport's idle timeout, the client left, or the
    /// body broke its framing (longer than it announced, a failed frame): 400.
    Unreadable,
    /// It kept coming, but not all of it within the body deadline: 408.
    TooSlow,
    /// Holding more of it would pass the gateway's bound on buffered bytes, or
    /// its client's share of it: 503.
    Busy(BufferFull),
}

impl From<Overrun> for BodyFailure {
    fn from(overrun: Overrun) -> Self {
        match overrun {
            Overrun::Busy(full) => BodyFailure::Busy(full),
            Overrun::TooLarge | Overrun::Unreadable => BodyFailure::Unreadable,
        }
    }
}

/// One request between its head and its plan: phases 1 and 2 for every
/// transport. An intake takes a request's head (its route or refusal, its
/// peer), then its body, and owns what happens between them — the refusal order, the body bound, the buffer lease,
/// the body deadline — until it yields the request [`Planned`].
///
/// The refusal order, the same on every transport:
/// 1. the head: [`check_head`](crate::check_head), then the path's normal form,
///    then the route ([`Limiter::route_head`]) — answered at once
///    ([`Intake::refused`]), before anything of the body is read;
/// 2. a body the route is classified by, announced past the policy's
///    `limits.max_body_bytes`: decided as one call of the route's default class,
///    then answered 413 ([`Intake::too_large`]), nothing of it read;
/// 3. a body that cannot be held ([`BufferFull`]: 503), that does not come
///    whole within the [body deadline](Limiter::body_deadline) (408), or that
///    stops or breaks its framing (400): [`Intake::body_refusal`];
/// 4. then the decision ([`Planned::admit`]).
///
/// A transport does only its own I/O: it reads into [`Intake::room`] (a
/// transport with a buffer of its own, as sluice's HTTP/1.1 fast path) or hands
/// each frame to [`Intake::push`] (one that gets frames, as the tower layer).
/// The body the route asks for is where a body-aware budget reads it (JSON-RPC
/// classes, batch items, LLM token estimates); the response side is
/// [`Forward`](crate::Forward)'s, symmetric: it settles what the upstream said
/// the call cost.
pub struct Intake<'l, S> {
    limiter: &'l Limiter<S>,
    route: Result<Option<&'l Route>, Refused>,
    peer: IpAddr,
    /// `Some(max)` when the route takes its class from the body.
    bound: Option<usize>,
    lease: Option<BufferLease>,
    pieces: Option<Pieces>,
    /// The body was announced, or found, past the bound.
    too_large: bool,
    /// The whole body, once taken in pieces.
    whole: Option<Bytes>,
    /// The request's path, kept for an LLM route (its wire format's endpoints
    /// are estimated apart).
    llm_path: Option<Box<str>>,
}

impl<S: BudgetStore> Limiter<S> {
    /// Phase 1, in the one refusal order: the head ([`check_head`](crate::check_head):
    /// method, `Host` fields; with `fields`, their `Transfer-Encoding` too,
    /// [`check_transfer_coding`](crate::check_transfer_coding)), then the path's normal form (`path`, as
    /// [`Limiter::normalize_path`] or [`Limiter::normalize_target`] gave it), then
    /// the route of the method and that path — with a method-override field read
    /// from `fields` when the transport passes them (see [`Limiter::route_with`]).
    ///
    /// # Errors
    /// The first [`Refused`] of those.
    pub fn route_head<'h>(
        &self,
        method: &Method,
        version: Version,
        hosts: impl IntoIterator<Item = &'h [u8]>,
        path: Result<&str, Refused>,
        fields: Option<&HeaderMap>,
    ) -> Result<Option<&Route>, Refused> {
        crate::check_head(method, version, hosts)?;
        if let Some(fields) = fields {
            crate::check_transfer_coding(
                fields
                    .get_all(http::header::TRANSFER_ENCODING)
                    .iter()
                    .map(|v| v.as_bytes()),
            )?;
        }
        let path = path?;
        match fields {
            Some(fields) => self.route_with(method, path, fields),
            None => self.route_for(method, path),
        }
    }

    /// Phase 1 done: the intake of a request from `peer` on `route` (or its
    /// refusal) from [`Limiter::route_head`].
    pub fn intake<'l>(
        &'l self,
        route: Result<Option<&'l Route>, Refused>,
        peer: IpAddr,
    ) -> Intake<'l, S> {
        let bound = route.ok().and_then(|r| self.body_bound(r));
        Intake {
            limiter: self,
            route,
            peer,
            bound,
            lease: None,
            pieces: None,
            too_large: false,
            whole: None,
            llm_path: None,
        }
    }
}

impl<'l, S: BudgetStore> Intake<'l, S> {
    /// The route, when the head was not refused.
    pub fn route(&self) -> Option<&'l Route> {
        self.route.ok().flatten()
    }

    /// The answer to a refused head, to send at once (nothing of the body is
    /// read; a transport that cannot skip it closes the connection after it):
    /// logged as every refusal is, under `request_id`. `None` when the head
    /// was not refused.
    pub fn refused(&self, request_id: Option<&RequestId>) -> Option<Response<Full<Bytes>>> {
        let refused = self.route.err()?;
        Some(self.limiter.refuse_unplanned(refused, request_id))
    }

    /// The most body bytes the request must be read in whole before it can be
    /// planned (the policy's `limits.max_body_bytes`), or `None` when its route
    /// does not take its class from the body (it streams to the upstream).
    pub fn body_bound(&self) -> Option<usize> {
        self.bound
    }

    /// The body is announced `len` bytes long: true when it is past the bound,
    /// and not to be read (the request is then decided as one call of its
    /// route's default class and answered 413 once [`Planned::admit`] decides).
    pub fn too_large(&mut self, len: u64) -> bool {
        let past = self
            .bound
            .is_some_and(|max| usize::try_from(len).map_or(true, |len| len > max));
        self.too_large |= past;
        self.too_large
    }

    /// Leases, at once, room for a body of `announced` bytes (`None`: not
    /// announced, so the bound's worth), and for the transport's read buffer
    /// meanwhile when the body is longer than one piece: for a transport whose
    /// reads land in buffers it does not own (the tower layer under hyper).
    /// Returns the capacity leased for the body itself. The lease is charged to
    /// the client the policy reads from `headers` (see [`Limiter::buffer_holder`]).
    ///
    /// # Errors
    /// [`BodyFailure::Busy`] when the gateway's bound or the client's share is full.
    pub fn lease_whole(
        &mut self,
        announced: Option<u64>,
        headers: &HeaderMap,
    ) -> Result<usize, BodyFailure> {
        let max = self.bound.unwrap_or(0);
        let capacity = announced
            .and_then(|n| usize::try_from(n).ok())
            .unwrap_or(max)
            .min(max);
        let allowance = if capacity > crate::PIECE_BYTES {
            crate::READ_BUFFER_ALLOWANCE
        } else {
            0
        };
        let lease = self
            .limiter
            .buffers()
            .try_lease_for(
                self.limiter.buffer_holder(self.peer, headers),
                capacity.saturating_add(allowance),
            )
            .map_err(BodyFailure::Busy)?;
        self.lease = Some(lease);
        self.pieces = Some(Pieces::new(0, capacity, false));
        Ok(capacity)
    }

    /// Starts a body of `len` bytes whose first `start` bytes the transport holds
    /// in a buffer of its own: those are leased now, and each piece of the rest
    /// as it is allocated ([`Intake::room`]), so a client that stalls holds at
    /// most a piece beyond what it sent; charged as [`Intake::lease_whole`] is.
    ///
    /// # Errors
    /// [`BodyFailure::Busy`] when the gateway's bound or the client's share is full.
    pub fn lease_pieces(
        &mut self,
        start: usize,
        len: usize,
        headers: &HeaderMap,
    ) -> Result<(), BodyFailure> {
        let mut lease = self
            .limiter
            .buffers()
            .try_lease_for(self.limiter.buffer_holder(self.peer, headers), 0)
            .map_err(BodyFailure::Busy)?;
        lease.try_grow_for(start).map_err(BodyFailure::Busy)?;
        self.lease = Some(lease);
        self.pieces = Some(Pieces::new(start, len, true));
        Ok(())
    }

    /// True once the body started with [`Intake::lease_pieces`] or
    /// [`Intake::lease_whole`] is all there.
    pub fn is_whole(&self) -> bool {
        self.pieces.as_ref().is_none_or(Pieces::is_whole)
    }

    /// The buffer to read the next bytes of the body into (leased first).
    ///
    /// # Errors
    /// [`BodyFailure::Busy`] when the lease cannot hold another piece.
    pub fn room(&mut self) -> Result<&mut BytesMut, BodyFailure> {
        let (Some(pieces), Some(lease)) = (self.pieces.as_mut(), self.lease.as_mut()) else {
            return Err(BodyFailure::Unreadable);
        };
        pieces.room(lease).map_err(BodyFailure::Busy)
    }

    /// Counts `n` bytes just read into [`Intake::room`].
    pub fn filled(&mut self, n: usize) {
        if let Some(pieces) = self.pieces.as_mut() {
            pieces.filled(n);
        }
    }

    /// Takes one frame of the body (copied, and let go): a body found past the
    /// bound stops here as [`Intake::too_large`] does (`Ok(false)`: read no
    /// more); `Ok(true)` to go on.
    ///
    /// # Errors
    /// [`BodyFailure::Unreadable`] for a body longer than it announced.
    pub fn push(&mut self, data: impl Buf) -> Result<bool, BodyFailure> {
        let max = self.bound.unwrap_or(0);
        let (Some(pieces), Some(lease)) = (self.pieces.as_mut(), self.lease.as_mut()) else {
            return Err(BodyFailure::Unreadable);
        };
        match pieces.push(data, max, lease) {
            Ok(()) => Ok(true),
            Err(Overrun::TooLarge) => {
                self.too_large = true;
                self.pieces = None;
                Ok(false)
            }
            Err(other) => Err(other.into()),
        }
    }

    /// The body taken in pieces, whole, after `start` (what the transport held
    /// of it in its own buffer): in one buffer of its length, the pieces freed;
    /// it is also the body [`Intake::planned`] plans by. Empty when no body was
    /// taken in pieces.
    pub fn take_whole(&mut self, start: &[u8]) -> Bytes {
        let whole = match (self.pieces.take(), self.lease.as_mut()) {
            (Some(pieces), Some(lease)) => pieces.into_whole(start, lease),
            _ => Bytes::new(),
        };
        self.whole = Some(whole.clone());
        whole
    }

    /// When the body must be whole, asked once as its reading starts: now and
    /// the limiter's [body deadline](Limiter::body_deadline). A transport that has
    /// not read it all by then answers [`BodyFailure::TooSlow`].
    pub fn whole_by(&self) -> tokio::time::Instant {
        tokio::time::Instant::now() + self.limiter.body_deadline()
    }

    /// The body taken whole by this intake ([`Intake::take_whole`]), if any.
    pub fn whole(&self) -> Option<&[u8]> {
        self.whole.as_deref()
    }

    /// Bytes of the body held so far.
    pub fn held(&self) -> usize {
        self.pieces.as_ref().map_or(0, Pieces::len)
    }

    /// The answer to a body that could not be taken whole, the same on every
    /// transport.
    pub fn body_refusal(&self, failure: BodyFailure) -> Response<Full<Bytes>> {
        match failure {
            BodyFailure::Unreadable => crate::body_unreadable(),
            BodyFailure::TooSlow => crate::body_too_slow(self.limiter.body_deadline()),
            BodyFailure::Busy(full) => crate::buffers_refusal(full, self.limiter.buffers()),
        }
    }

    /// Phase 3: the request planned, with the fields the limiter reads in
    /// `headers`, `key` naming its caller when the transport has one (see
    /// [`Identity::keyed_caller`](sluice_policy::Identity::keyed_caller)), and
    /// `body`: the body the route asked for, held by the transport (`None`: the
    /// one taken by this intake, if any).
    pub fn planned<'b>(
        &'b self,
        headers: &HeaderMap,
        key: Option<&[u8]>,
        body: Option<&'b [u8]>,
    ) -> Planned<'l, 'b, S> {
        let read = if self.too_large {
            BodyRead::TooLarge
        } else if self.bound.is_none() {
            BodyRead::NotNeeded
        } else {
            BodyRead::Whole(body.unwrap_or(self.whole.as_deref().unwrap_or_default()))
        };
        let path = self.llm_path.as_deref().unwrap_or_default();
        self.limiter
            .planned(headers, self.peer, self.route, read, key, path)
    }

    /// The request's path (in its normal form): what an LLM route's body is
    /// estimated by (chat, responses, embeddings, …). Kept only on LLM routes.
    pub fn set_path(&mut self, path: &str) {
        if self.route().is_some_and(|r| r.llm.is_some()) {
            self.llm_path = Some(path.into());
        }
    }

    /// The request's peer.
    pub fn peer(&self) -> IpAddr {
        self.peer
    }

    /// The limiter deciding it.
    pub fn limiter(&self) -> &'l Limiter<S> {
        self.limiter
    }
}
