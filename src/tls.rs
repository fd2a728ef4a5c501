//! TLS with rustls: the inbound certificate (reloadable without dropping
//! connections) and the client configuration used towards `https://`
//! upstreams. Owns reading PEM files and root stores; does not accept
//! connections (the server does).

mod postgres;

pub use postgres::{PostgresTls, postgres_config};

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, RootCertStore, ServerConfig};

/// Why TLS material could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A PEM file could not be read or parsed.
    #[error("{field}: {path}: {message}")]
    Pem {
        /// The setting that names the file.
        field: &'static str,
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// The certificate and key do not form a usable pair.
    #[error("tls.cert_file and tls.key_file: {0}")]
    Pair(String),
    /// No trusted roots could be loaded.
    #[error("{0}")]
    Roots(String),
}

/// Why an `https://` upstream without `upstream.ca_file` cannot be verified
/// on a system without a CA bundle (a bare container image).
pub const NO_SYSTEM_ROOTS: &str = "upstream.url: an https upstream, but upstream.ca_file is not set and the system has no trusted root certificates to verify it against; set upstream.ca_file";

/// Selects the process-wide rustls crypto provider (ring); later calls are
/// no-ops.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// The inbound certificate, swappable while the server runs: each new
/// handshake uses the current pair, open connections keep theirs.
#[derive(Debug)]
pub struct CertificateReloader {
    cert_file: PathBuf,
    key_file: PathBuf,
    current: RwLock<Arc<CertifiedKey>>,
}

impl CertificateReloader {
    /// Loads the pair once; fails if it is unusable.
    pub fn load(cert_file: &Path, key_file: &Path) -> Result<Arc<Self>, TlsError> {
        let current = certified_key(cert_file, key_file)?;
        Ok(Arc::new(Self {
            cert_file: cert_file.to_owned(),
            key_file: key_file.to_owned(),
            current: RwLock::new(current),
        }))
    }

    /// Reads the files anew, without putting the pair in use.
    pub fn read(&self) -> Result<Arc<CertifiedKey>, TlsError> {
        certified_key(&self.cert_file, &self.key_file)
    }

    /// Puts a pair [`read`](Self::read) in use for new handshakes.
    pub fn install(&self, fresh: Arc<CertifiedKey>) {
        *self
            .current
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = fresh;
    }

    /// A server configuration that always presents the current pair.
    pub fn server_config(self: &Arc<Self>) -> Arc<ServerConfig> {
        let mut config = ServerConfig::builder()
            .with_no_client_auth()
            .with_cert_resolver(Arc::clone(self) as Arc<dyn ResolvesServerCert>);
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Arc::new(config)
    }
}

impl ResolvesServerCert for CertificateReloader {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(Arc::clone(
            &self
                .current
                .read()
                .unwrap_or_else(|poisoned| poisoned.into_inner()),
        ))
    }
}

fn certified_key(cert_file: &Path, key_file: &Path) -> Result<Arc<CertifiedKey>, TlsError> {
    let chain = certificates(cert_file, "tls.cert_file")?;
    let key = PrivateKeyDer::from_pem_file(key_file).map_err(|error| TlsError::Pem {
        field: "tls.key_file",
        path: key_file.to_owned(),
        message: match pem_kind(key_file) {
            PemKind::Encrypted => "the private key is encrypted, which is not supported: give it decrypted (`openssl pkey -in KEY -out PLAIN`)".into(),
            PemKind::NotPem => "no PEM private key (`-----BEGIN … PRIVATE KEY-----`) in it; a DER key converts with `openssl pkey -inform DER`".into(),
            PemKind::Pem => format!("no usable private key: {error}"),
        },
    })?;
    let provider = rustls::crypto::ring::default_provider();
    let certified = CertifiedKey::from_der(chain, key, &provider).map_err(|error| {
        TlsError::Pair(match error {
            rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch) => {
                "the key is not the certificate's (the server's own certificate must come first in tls.cert_file, its intermediates after it)".into()
            }
            error => error.to_string(),
        })
    })?;
    Ok(Arc::new(certified))
}

/// What a file that yielded no usable PEM item holds, to say why.
enum PemKind {
    Encrypted,
    NotPem,
    Pem,
}

fn pem_kind(path: &Path) -> PemKind {
    // Read a second time, so a regular file only: a FIFO would wait for a
    // writer that has already come and gone.
    if !std::fs::metadata(path).is_ok_and(|metadata| metadata.is_file()) {
        return PemKind::Pem;
    }
    match std::fs::read(path) {
        Ok(bytes) if bytes.windows(9).any(|w| w == b"ENCRYPTED") => PemKind::Encrypted,
        Ok(bytes) if !bytes.windows(11).any(|w| w == b"-----BEGIN ") => PemKind::NotPem,
        _ => PemKind::Pem,
    }
}

fn certificates(
    path: &Path,
    field: &'static str,
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem_error = |message: String| TlsError::Pem {
        field,
        path: path.to_owned(),
        message,
    };
    let chain = CertificateDer::pem_file_iter(path)
        .map_err(|error| pem_error(error.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|error| pem_error(error.to_string()))?;
    if chain.is_empty() {
        return Err(pem_error(match pem_kind(path) {
            PemKind::NotPem => "no PEM certificate (`-----BEGIN CERTIFICATE-----`) in it; a DER certificate converts with `openssl x509 -inform DER`".into(),
            PemKind::Encrypted | PemKind::Pem => "no certificate found".into(),
        }));
    }
    Ok(chain)
}

/// Trusted roots: the certificates in `ca_file` (named by the setting
/// `field`), or the system's.
pub fn root_store(ca_file: Option<&Path>, field: &'static str) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    match ca_file {
        Some(path) => {
            for certificate in certificates(path, field)? {
                roots.add(certificate).map_err(|error| TlsError::Pem {
                    field,
                    path: path.to_owned(),
                    message: error.to_string(),
                })?;
            }
        }
        None => {
            let native = rustls_native_certs::load_native_certs();
            for certificate in native.certs {
                // Some systems ship certificates rustls cannot parse; skip them.
                let _ = roots.add(certificate);
            }
        }
    }
    Ok(roots)
}

/// A client configuration verifying `https://` upstreams against
/// `upstream.ca_file`, or the system's roots.
pub fn client_config(ca_file: Option<&Path>) -> Result<ClientConfig, TlsError> {
    let roots = root_store(ca_file, "upstream.ca_file")?;
    if roots.is_empty() {
        return Err(TlsError::Roots(NO_SYSTEM_ROOTS.into()));
    }
    Ok(ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth())
}
