//! TLS for the router's HTTP listener (`--tls-cert`, `--tls-key`): rustls with the ring
//! provider, the same rustls that tonic uses towards the control plane.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context as _;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject as _;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// The acceptor for `--tls-cert` / `--tls-key`; errors name the file.
pub(crate) fn acceptor(cert: &Path, key: &Path) -> anyhow::Result<tokio_rustls::TlsAcceptor> {
    let certs = CertificateDer::pem_file_iter(cert)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .with_context(|| {
            format!(
                "--tls-cert {}: cannot read a PEM certificate chain",
                cert.display()
            )
        })?;
    if certs.is_empty() {
        anyhow::bail!("--tls-cert {}: no certificate in the file", cert.display());
    }
    let key = PrivateKeyDer::from_pem_file(key)
        .with_context(|| format!("--tls-key {}: cannot read a PEM private key", key.display()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .context("--tls-cert and --tls-key do not form a usable certificate and key")?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

/// The first byte of a TLS connection (a handshake record).
pub(crate) const HANDSHAKE: u8 = 0x16;

/// What a plaintext HTTP client gets from a TLS listener: a readable answer instead of a reset.
pub(crate) fn plaintext_refusal() -> Vec<u8> {
    let body = r#"{"error":{"message":"this port serves HTTPS: use an https:// URL","type":"invalid_request_error"}}"#;
    format!(
        "HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}
