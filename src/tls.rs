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
    #[error("{path}: {message}")]
    Pem {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// The certificate and key do not form a usable pair.
    #[error("certificate and key: {0}")]
    Pair(String),
    /// No trusted roots could be loaded.
    #[error("no trusted root certificates: {0}")]
    Roots(String),
}

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

    /// Re-reads the files; on failure the previous pair stays in use.
    pub fn reload(&self) -> Result<(), TlsError> {
        let fresh = certified_key(&self.cert_file, &self.key_file)?;
        *self
            .current
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = fresh;
        Ok(())
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
    let chain = certificates(cert_file)?;
    let key = PrivateKeyDer::from_pem_file(key_file).map_err(|error| TlsError::Pem {
        path: key_file.to_owned(),
        message: format!("no usable private key: {error}"),
    })?;
    let provider = rustls::crypto::ring::default_provider();
    let certified = CertifiedKey::from_der(chain, key, &provider)
        .map_err(|error| TlsError::Pair(error.to_string()))?;
    Ok(Arc::new(certified))
}

fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem_error = |message: String| TlsError::Pem {
        path: path.to_owned(),
        message,
    };
    let chain = CertificateDer::pem_file_iter(path)
        .map_err(|error| pem_error(error.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|error| pem_error(error.to_string()))?;
    if chain.is_empty() {
        return Err(pem_error("no certificate found".into()));
    }
    Ok(chain)
}

/// Trusted roots: the certificates in `ca_file`, or the system's.
pub fn root_store(ca_file: Option<&Path>) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    match ca_file {
        Some(path) => {
            for certificate in certificates(path)? {
                roots.add(certificate).map_err(|error| TlsError::Pem {
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

/// A client configuration verifying servers against `root_store(ca_file)`.
pub fn client_config(ca_file: Option<&Path>) -> Result<ClientConfig, TlsError> {
    let roots = root_store(ca_file)?;
    if roots.is_empty() {
        return Err(TlsError::Roots("the system has none; set a CA file".into()));
    }
    Ok(ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth())
}
