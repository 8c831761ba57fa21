//! TLS on a listener of sluice's own (SPEC O5): rustls over the workspace's one crypto
//! provider (aws-lc-rs), TLS 1.2 and 1.3 only, ALPN `h2` and `http/1.1`, the
//! certificate chain and key read from PEM files and read again when they change.
//!
//! A certificate is taken only whole: a chain that does not parse, a key that does not
//! match the chain's first certificate or a certificate past its `notAfter` is refused
//! — at start [`ListenerTls::load`] fails with a message naming the file; on a reload
//! the certificate in use stays, the refusal is logged at error level, counted in
//! `sluice_tls_certificate_reloads_total{outcome="refused"}` and shown by
//! `sluice_tls_certificate_stale` (1 until a good pair is read) and
//! [`ListenerTls::status`]. Connections already open keep their session: a reload
//! changes only what the next handshake presents.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use rustls::ServerConfig;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

use crate::file_watch::{Cue, FileWatch, Stamp};

/// The ALPN protocols a TLS listener offers, most preferred first.
pub const ALPN: [&[u8]; 2] = [b"h2", b"http/1.1"];

/// A TLS listener's certificate, its files and the settings handshakes use. Cheap to
/// clone: clones share the certificate in use.
#[derive(Clone)]
pub struct ListenerTls {
    inner: Arc<Inner>,
}

struct Inner {
    /// Which listener (`gateway` or `admin`), for logs and metric labels.
    listener: &'static str,
    cert: PathBuf,
    key: PathBuf,
    provider: Arc<CryptoProvider>,
    /// The certificate handshakes present.
    current: Arc<Current>,
    config: Arc<ServerConfig>,
    state: Mutex<State>,
}

/// What [`ListenerTls::status`] reports.
#[derive(Clone, Debug, Default)]
struct State {
    /// When the certificate in use expires (seconds since the epoch).
    not_after: i64,
    /// Why the files were last refused, while the certificate in use is older than them.
    refused: Option<String>,
    reloads: u64,
}

/// The certificate in use, swapped whole by a reload.
#[derive(Debug)]
struct Current(ArcSwap<CertifiedKey>);

impl ResolvesServerCert for Current {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.load_full())
    }
}

impl std::fmt::Debug for ListenerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ListenerTls")
            .field("listener", &self.inner.listener)
            .field("cert", &self.inner.cert)
            .field("key", &self.inner.key)
            .finish_non_exhaustive()
    }
}

impl ListenerTls {
    /// Reads the PEM certificate chain at `cert` and the PEM private key at `key` for
    /// the listener named `listener` (`gateway`, offering ALPN `h2` and `http/1.1`, or
    /// `admin`, offering `http/1.1` only).
    ///
    /// # Errors
    /// A message naming the file and what is wrong with it: unreadable, no PEM
    /// certificate or key in it, a key that does not match the certificate, a
    /// certificate that has expired.
    pub fn load(listener: &'static str, cert: &Path, key: &Path) -> Result<Self, String> {
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let (certified, not_after) = read_pair(cert, key, &provider, SystemTime::now())?;
        let current = Arc::new(Current(ArcSwap::from_pointee(certified)));
        let mut config = ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
            .map_err(|e| format!("TLS settings: {e}"))?
            .with_no_client_auth()
            .with_cert_resolver(Arc::clone(&current) as Arc<dyn ResolvesServerCert>);
        // The admin listener serves HTTP/1.1 only.
        let alpn: &[&[u8]] = if listener == "admin" {
            &ALPN[1..]
        } else {
            &ALPN
        };
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        let tls = ListenerTls {
            inner: Arc::new(Inner {
                listener,
                cert: cert.to_owned(),
                key: key.to_owned(),
                provider,
                current,
                config: Arc::new(config),
                state: Mutex::new(State {
                    not_after,
                    refused: None,
                    reloads: 0,
                }),
            }),
        };
        tls.publish();
        Ok(tls)
    }

    /// An acceptor presenting the certificate in use at each handshake.
    pub(crate) fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(Arc::clone(&self.inner.config))
    }

    /// The rustls settings (for a server that does its own accepting).
    pub fn server_config(&self) -> Arc<ServerConfig> {
        Arc::clone(&self.inner.config)
    }

    /// Reads the two files again; a good pair replaces the certificate in use, a bad
    /// one leaves it (logged loudly, counted, and shown by [`ListenerTls::status`]).
    ///
    /// # Errors
    /// Why the files were refused.
    pub fn reload(&self) -> Result<(), String> {
        let inner = &self.inner;
        match read_pair(&inner.cert, &inner.key, &inner.provider, SystemTime::now()) {
            Ok((certified, not_after)) => {
                inner.current.0.store(Arc::new(certified));
                {
                    let mut state = inner.state.lock();
                    state.not_after = not_after;
                    state.refused = None;
                    state.reloads += 1;
                }
                metrics::counter!("sluice_tls_certificate_reloads_total",
                    "listener" => inner.listener, "outcome" => "taken")
                .increment(1);
                tracing::info!(
                    target: "sluice::tls",
                    "{} listener: certificate {} taken (expires at {not_after} s since the epoch)",
                    inner.listener,
                    inner.cert.display()
                );
                self.publish();
                Ok(())
            }
            Err(why) => {
                inner.state.lock().refused = Some(why.clone());
                metrics::counter!("sluice_tls_certificate_reloads_total",
                    "listener" => inner.listener, "outcome" => "refused")
                .increment(1);
                tracing::error!(
                    target: "sluice::tls",
                    "{} listener: the changed certificate files are REFUSED, the previous \
                     certificate stays in use: {why}",
                    inner.listener
                );
                self.publish();
                Err(why)
            }
        }
    }

    /// The certificate's state as JSON: its files, when the one in use expires, how
    /// often it was replaced, and why the files on disk were refused (`null` when the
    /// certificate in use is what they hold).
    pub fn status(&self) -> serde_json::Value {
        let state = self.inner.state.lock().clone();
        serde_json::json!({
            "cert": self.inner.cert.display().to_string(),
            "key": self.inner.key.display().to_string(),
            "not_after_unix": state.not_after,
            "reloads": state.reloads,
            "refused": state.refused,
        })
    }

    fn publish(&self) {
        let inner = &self.inner;
        let state = inner.state.lock();
        metrics::gauge!("sluice_tls_certificate_not_after_seconds", "listener" => inner.listener)
            .set(state.not_after as f64);
        metrics::gauge!("sluice_tls_certificate_stale", "listener" => inner.listener)
            .set(if state.refused.is_some() { 1.0 } else { 0.0 });
    }

    /// Reads the files again whenever they change (inotify on their directories, a
    /// slow poll where it is not to be had; nothing at rest), until `stop` resolves.
    /// The watch begins when this is called (a change made before the returned
    /// future first runs is seen), so call it from within the runtime.
    pub fn watch(
        self,
        stop: impl Future<Output = ()> + Send + 'static,
    ) -> impl Future<Output = ()> + Send + 'static {
        let inner = Arc::clone(&self.inner);
        let mut cert_watch = FileWatch::new(&inner.cert);
        // Both in one directory: one watch sees both.
        let same_dir = inner.cert.parent() == inner.key.parent();
        let mut key_watch = (!same_dir).then(|| FileWatch::new(&inner.key));
        let stamps = move || (Stamp::of(&inner.cert).ok(), Stamp::of(&inner.key).ok());
        let mut seen = stamps();
        async move {
            tokio::pin!(stop);
            loop {
                let cue = tokio::select! {
                    () = &mut stop => return,
                    cue = cert_watch.next() => cue,
                    cue = async {
                        match key_watch.as_mut() {
                            Some(watch) => watch.next().await,
                            None => std::future::pending().await,
                        }
                    } => cue,
                };
                let now = stamps();
                if now == seen {
                    continue;
                }
                if cue == Cue::Poll {
                    let at = SystemTime::now();
                    let settled = |s: &Option<Stamp>| s.as_ref().is_some_and(|s| s.settled(at));
                    if !(settled(&now.0) && settled(&now.1)) {
                        continue;
                    }
                }
                seen = now;
                let _ = self.reload();
            }
        }
    }
}

/// How long a TLS handshake may take: a client hello (and the rest of the handshake)
/// that has not finished within the head timeout is dropped, as a slow head is.
pub(crate) async fn handshake<IO>(
    acceptor: &tokio_rustls::TlsAcceptor,
    stream: IO,
    deadline: Duration,
    listener: &'static str,
) -> Option<tokio_rustls::server::TlsStream<IO>>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    // The handshake is dropped (and the connection closed) only once a timeout
    // is counted: whoever sees the close sees it counted.
    let accept = acceptor.accept(stream);
    tokio::pin!(accept);
    let finished = tokio::select! {
        finished = &mut accept => Some(finished),
        () = tokio::time::sleep(deadline) => None,
    };
    match finished {
        Some(Ok(stream)) => Some(stream),
        Some(Err(error)) => {
            metrics::counter!("sluice_tls_handshakes_failed_total",
                "listener" => listener, "reason" => "error")
            .increment(1);
            tracing::debug!(target: "sluice::tls", "{listener} listener: TLS handshake failed: {error}");
            None
        }
        None => {
            metrics::counter!("sluice_tls_handshakes_failed_total",
                "listener" => listener, "reason" => "timeout")
            .increment(1);
            metrics::counter!("sluice_slow_heads_total", "listener" => listener).increment(1);
            tracing::debug!(
                target: "sluice::tls",
                "{listener} listener: TLS handshake not finished within {} s; closed",
                deadline.as_secs()
            );
            None
        }
    }
}

/// Reads and checks a certificate chain and its key, as of `now`: the pair and when
/// the certificate expires (seconds since the epoch).
fn read_pair(
    cert: &Path,
    key: &Path,
    provider: &CryptoProvider,
    now: SystemTime,
) -> Result<(CertifiedKey, i64), String> {
    let cert_name = cert.display();
    let key_name = key.display();
    let pem = std::fs::read(cert).map_err(|e| format!("{cert_name}: {e}"))?;
    let chain = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{cert_name}: not a readable PEM certificate chain ({e})"))?;
    let Some(first) = chain.first() else {
        return Err(format!(
            "{cert_name}: no PEM certificate in it (expected -----BEGIN CERTIFICATE----- blocks)"
        ));
    };
    let (not_before, not_after) = validity(first).ok_or_else(|| {
        format!("{cert_name}: the first certificate is not a readable X.509 certificate")
    })?;
    let now = now
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
    if now > not_after {
        return Err(format!(
            "{cert_name}: the certificate expired ({} s ago)",
            now - not_after
        ));
    }
    if now < not_before {
        return Err(format!(
            "{cert_name}: the certificate is not valid yet (for {} s more)",
            not_before - now
        ));
    }
    let pem = std::fs::read(key).map_err(|e| format!("{key_name}: {e}"))?;
    let key_der = PrivateKeyDer::from_pem_slice(&pem)
        .map_err(|e| format!("{key_name}: no readable PEM private key in it ({e})"))?;
    let certified = CertifiedKey::from_der(chain, key_der, provider).map_err(|e| match e {
        rustls::Error::InconsistentKeys(_) => format!(
            "{key_name} does not match the certificate of {cert_name} (a key of another certificate)"
        ),
        e => format!("{key_name}: not a usable private key ({e})"),
    })?;
    Ok((certified, not_after))
}

/// The validity (`notBefore`, `notAfter`, seconds since the epoch) of a DER X.509
/// certificate; `None` when it does not read as one.
fn validity(cert: &[u8]) -> Option<(i64, i64)> {
    let (tag, certificate, _) = der(cert)?;
    if tag != 0x30 {
        return None;
    }
    let (tag, tbs, _) = der(certificate)?;
    if tag != 0x30 {
        return None;
    }
    let mut rest = tbs;
    // [0] version (optional), serialNumber, signature, issuer, then validity.
    let (tag, _, after) = der(rest)?;
    if tag == 0xa0 {
        rest = after;
    }
    for _ in 0..3 {
        rest = der(rest)?.2;
    }
    let (tag, validity, _) = der(rest)?;
    if tag != 0x30 {
        return None;
    }
    let (tag_before, before, rest) = der(validity)?;
    let (tag_after, after, _) = der(rest)?;
    Some((time(tag_before, before)?, time(tag_after, after)?))
}

/// One DER element: its tag, its content and what follows it.
fn der(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, input) = input.split_first()?;
    let (&first, mut input) = input.split_first()?;
    let len = if first < 0x80 {
        usize::from(first)
    } else {
        let bytes = usize::from(first & 0x7f);
        if bytes == 0 || bytes > 4 || input.len() < bytes {
            return None;
        }
        let (len, rest) = input.split_at(bytes);
        input = rest;
        len.iter().fold(0usize, |n, b| (n << 8) | usize::from(*b))
    };
    if input.len() < len {
        return None;
    }
    let (content, rest) = input.split_at(len);
    Some((tag, content, rest))
}

/// An X.509 time (UTCTime `YYMMDDHHMMSSZ` or GeneralizedTime `YYYYMMDDHHMMSSZ`) as
/// seconds since the epoch.
fn time(tag: u8, text: &[u8]) -> Option<i64> {
    let text = std::str::from_utf8(text).ok()?;
    let digits = text.strip_suffix('Z')?;
    let (year, rest) = match tag {
        0x17 if digits.len() == 12 => {
            let yy: i64 = digits.get(..2)?.parse().ok()?;
            (
                if yy >= 50 { 1900 + yy } else { 2000 + yy },
                digits.get(2..)?,
            )
        }
        0x18 if digits.len() == 14 => (digits.get(..4)?.parse().ok()?, digits.get(4..)?),
        _ => return None,
    };
    if !rest.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let field = |i: usize| -> Option<i64> { rest.get(i..i + 2)?.parse().ok() };
    let (month, day, hour, minute, second) =
        (field(0)?, field(2)?, field(4)?, field(6)?, field(8)?);
    if !(1..=12).contains(&month)
        || !(1..=31).contains(&day)
        || hour > 23
        || minute > 59
        || second > 60
    {
        return None;
    }
    Some(days_from_civil(year, month, day) * 86_400 + hour * 3600 + minute * 60 + second)
}

/// Days from 1970-01-01 to the given date of the proleptic Gregorian calendar.
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn o5_x509_times_read_as_seconds_since_the_epoch() {
        assert_eq!(time(0x17, b"700101000000Z"), Some(0));
        assert_eq!(time(0x17, b"000301000000Z"), Some(951_868_800));
        assert_eq!(time(0x18, b"20261204215500Z"), Some(1_796_421_300));
        // RFC 5280's "no well-defined expiration": the last second of 9999, a
        // time like any other (never past), not an unreadable one.
        assert_eq!(time(0x18, b"99991231235959Z"), Some(253_402_300_799));
        assert_eq!(time(0x17, b"701301000000Z"), None);
        assert_eq!(time(0x17, b"7001010000Z"), None);
    }

    #[test]
    fn o5_der_lengths_past_the_input_are_refused() {
        assert_eq!(der(&[0x30, 0x05, 1, 2]), None);
        assert_eq!(der(&[0x30, 0x82, 0x01]), None);
        assert_eq!(
            der(&[0x30, 0x01, 7, 9]),
            Some((0x30, &[7u8][..], &[9u8][..]))
        );
        assert_eq!(validity(b"\x30\x00"), None);
    }
}
