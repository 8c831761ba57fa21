//! TLS to an https upstream: rustls over the workspace's one crypto provider
//! (aws-lc-rs), TLS 1.2 or 1.3, ALPN `http/1.1`, SNI the upstream's host name, and the
//! upstream's certificate verified against the system's roots or against the
//! certificates of a PEM file given instead.

use std::fmt;
use std::sync::Arc;

use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject as _;
use rustls::{ClientConfig, RootCertStore};

/// The roots an https upstream's certificate is verified against, and the client
/// settings built over them. Cheap to clone: clones share the settings.
#[derive(Clone)]
pub struct UpstreamTls {
    config: Arc<ClientConfig>,
    /// How many roots are trusted (for `Debug`).
    roots: usize,
}

impl UpstreamTls {
    /// Trusts the system's root certificates (as `rustls-native-certs` finds them:
    /// `SSL_CERT_FILE` / `SSL_CERT_DIR`, else the platform's store).
    ///
    /// # Errors
    /// A message when the system has no usable root certificate.
    pub fn system_roots() -> Result<Self, String> {
        let found = rustls_native_certs::load_native_certs();
        let mut roots = RootCertStore::empty();
        let (_added, _ignored) = roots.add_parsable_certificates(found.certs);
        if roots.is_empty() {
            let why = found
                .errors
                .first()
                .map_or_else(String::new, |e| format!(" ({e})"));
            return Err(format!(
                "no trusted root certificates found on this system to verify the https \
                 upstream with{why}: install them (ca-certificates) or give --upstream-ca FILE"
            ));
        }
        Self::over(roots)
    }

    /// Trusts exactly the certificates of the PEM bundle `pem` (the system's roots
    /// are not consulted).
    ///
    /// # Errors
    /// A message when `pem` holds no certificate, or one that cannot be read or used
    /// as a root.
    pub fn from_pem(pem: &[u8]) -> Result<Self, String> {
        let mut roots = RootCertStore::empty();
        for (i, cert) in CertificateDer::pem_slice_iter(pem).enumerate() {
            let cert = cert.map_err(|e| format!("certificate {}: not valid PEM ({e})", i + 1))?;
            roots
                .add(cert)
                .map_err(|e| format!("certificate {}: not usable as a root ({e})", i + 1))?;
        }
        if roots.is_empty() {
            return Err(
                "no PEM certificate in it (expected -----BEGIN CERTIFICATE----- blocks)".into(),
            );
        }
        Self::over(roots)
    }

    fn over(roots: RootCertStore) -> Result<Self, String> {
        let count = roots.len();
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let mut config = ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
            .map_err(|e| format!("TLS settings: {e}"))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        // The upstream pool speaks HTTP/1.1 on every connection.
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(UpstreamTls {
            config: Arc::new(config),
            roots: count,
        })
    }

    /// A connector over these settings.
    pub(crate) fn connector(&self) -> tokio_rustls::TlsConnector {
        tokio_rustls::TlsConnector::from(Arc::clone(&self.config))
    }
}

impl fmt::Debug for UpstreamTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UpstreamTls")
            .field("roots", &self.roots)
            .finish_non_exhaustive()
    }
}

impl PartialEq for UpstreamTls {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.config, &other.config)
    }
}

impl Eq for UpstreamTls {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn t0_a_ca_file_must_hold_pem_certificates() {
        let err = UpstreamTls::from_pem(b"not a certificate").expect_err("no PEM");
        assert!(err.contains("no PEM certificate"), "{err}");
        let err = UpstreamTls::from_pem(
            b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
        )
        .expect_err("not a certificate");
        assert!(err.starts_with("certificate 1:"), "{err}");
    }
}
