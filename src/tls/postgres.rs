//! TLS towards PostgreSQL with libpq's `sslmode` semantics, which
//! tokio-postgres only partly understands: `disable`, `prefer` and `require`
//! encrypt without verifying the server (as libpq does), `verify-ca` checks
//! the chain, `verify-full` the chain and the host name. `sslrootcert=FILE`
//! names the trusted roots (the system's otherwise); with `require` it turns
//! on chain verification, as in libpq.

use std::path::PathBuf;
use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, SignatureScheme};
use tokio_postgres::config::SslMode;
use tokio_postgres::tls::MakeTlsConnect;
use tokio_postgres_rustls::MakeRustlsConnect;

use super::{TlsError, root_store};

/// How much of the server's certificate is checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verification {
    None,
    Chain,
    Full,
}

/// A PostgreSQL URL split into the driver's configuration and the TLS
/// connector its `sslmode` and `sslrootcert` call for.
pub fn postgres_config(url: &str) -> Result<(tokio_postgres::Config, PostgresTls), String> {
    let (url, sslmode, rootcert) = take_tls_parameters(url)?;
    let mut config: tokio_postgres::Config = url.parse().map_err(|e| crate::error_chain(&e))?;
    let verification = match sslmode.as_deref() {
        None | Some("prefer") => {
            config.ssl_mode(SslMode::Prefer);
            Verification::None
        }
        Some("disable") => {
            config.ssl_mode(SslMode::Disable);
            Verification::None
        }
        // libpq's `allow` tries plain text first; encrypting whenever the
        // server offers it, as `prefer` does, is never weaker.
        Some("allow") => {
            config.ssl_mode(SslMode::Prefer);
            Verification::None
        }
        Some("require") => {
            config.ssl_mode(SslMode::Require);
            if rootcert.is_some() {
                Verification::Chain
            } else {
                Verification::None
            }
        }
        Some("verify-ca") => {
            config.ssl_mode(SslMode::Require);
            Verification::Chain
        }
        Some("verify-full") => {
            config.ssl_mode(SslMode::Require);
            Verification::Full
        }
        Some(other) => {
            return Err(format!(
                "sslmode `{other}` is not one of disable, allow, prefer, require, verify-ca, verify-full"
            ));
        }
    };
    let tls = client_config(verification, rootcert).map_err(|e| e.to_string())?;
    Ok((config, PostgresTls(MakeRustlsConnect::new(tls))))
}

/// The rustls connector, usable with Unix-socket hosts too: tokio-postgres
/// asks for a connector even for a socket, which has no host name to verify.
#[derive(Clone)]
pub struct PostgresTls(MakeRustlsConnect);

impl<S> MakeTlsConnect<S> for PostgresTls
where
    MakeRustlsConnect: MakeTlsConnect<S>,
{
    type Stream = <MakeRustlsConnect as MakeTlsConnect<S>>::Stream;
    type TlsConnect = <MakeRustlsConnect as MakeTlsConnect<S>>::TlsConnect;
    type Error = <MakeRustlsConnect as MakeTlsConnect<S>>::Error;

    fn make_tls_connect(&mut self, domain: &str) -> Result<Self::TlsConnect, Self::Error> {
        let domain = if domain.is_empty() {
            "localhost"
        } else {
            domain
        };
        self.0.make_tls_connect(domain)
    }
}

type TlsParameters = (String, Option<String>, Option<PathBuf>);

/// Removes `sslmode` and `sslrootcert` from the query string, returning
/// them percent-decoded, as libpq reads every URL parameter.
fn take_tls_parameters(url: &str) -> Result<TlsParameters, String> {
    let Some((base, query)) = url.split_once('?') else {
        return Ok((url.to_owned(), None, None));
    };
    let decoded = |name: &str, value: &str| {
        percent_encoding::percent_decode_str(value)
            .decode_utf8()
            .map(|value| value.into_owned())
            .map_err(|_| format!("{name}: percent-encoded bytes that are not UTF-8"))
    };
    let (mut sslmode, mut rootcert, mut kept) = (None, None, Vec::new());
    for pair in query.split('&') {
        match pair.split_once('=') {
            Some(("sslmode", value)) => sslmode = Some(decoded("sslmode", value)?),
            Some(("sslrootcert", value)) => {
                rootcert = Some(PathBuf::from(decoded("sslrootcert", value)?));
            }
            _ => kept.push(pair),
        }
    }
    let url = if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    Ok((url, sslmode, rootcert))
}

fn client_config(
    verification: Verification,
    rootcert: Option<PathBuf>,
) -> Result<ClientConfig, TlsError> {
    let builder = ClientConfig::builder();
    let config = match verification {
        Verification::Full => builder.with_root_certificates(root_store(rootcert.as_deref())?),
        Verification::Chain => {
            let roots = Arc::new(root_store(rootcert.as_deref())?);
            let webpki = WebPkiServerVerifier::builder(roots)
                .build()
                .map_err(|e| TlsError::Roots(e.to_string()))?;
            builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(ChainOnly(webpki)))
        }
        Verification::None => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(Unverified(provider()))),
    };
    Ok(config.with_no_client_auth())
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// `verify-ca`: the chain must lead to a trusted root; the name may differ.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(rustls::CertificateError::NotValidForName))
            | Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// `prefer`/`require` without a root certificate: encryption against passive
/// eavesdropping, no protection against an active man in the middle, exactly
/// as libpq behaves. The handshake signatures are still checked.
#[derive(Debug)]
struct Unverified(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for Unverified {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_parameters_are_taken_out_of_the_url() {
        let (url, mode, root) = take_tls_parameters(
            "postgres://u@db/x?sslmode=verify-full&application_name=a&sslrootcert=/ca.pem",
        )
        .unwrap();
        assert_eq!(url, "postgres://u@db/x?application_name=a");
        assert_eq!(mode.as_deref(), Some("verify-full"));
        assert_eq!(root, Some(PathBuf::from("/ca.pem")));
        assert_eq!(
            take_tls_parameters("postgres://u@db/x").unwrap().0,
            "postgres://u@db/x"
        );
        let (_, mode, root) = take_tls_parameters(
            "postgres://u@db/x?sslmode=verify%2Dfull&sslrootcert=%2Fetc%2Fmy%20ca.pem",
        )
        .unwrap();
        assert_eq!(mode.as_deref(), Some("verify-full"));
        assert_eq!(root, Some(PathBuf::from("/etc/my ca.pem")));
    }

    #[test]
    fn unix_socket_hosts_get_a_connector() {
        crate::tls::install_crypto_provider();
        let (config, mut tls) =
            postgres_config("postgres://u@%2Fvar%2Frun%2Fpostgresql/x").unwrap();
        assert!(matches!(
            config.get_hosts()[0],
            tokio_postgres::config::Host::Unix(_)
        ));
        assert!(MakeTlsConnect::<tokio::net::TcpStream>::make_tls_connect(&mut tls, "").is_ok());
    }

    #[test]
    fn sslmodes_map_to_the_driver_and_a_verifier() {
        crate::tls::install_crypto_provider();
        let mode = |url: &str| postgres_config(url).map(|(config, _)| config.get_ssl_mode());
        assert_eq!(
            mode("postgres://u@db/x?sslmode=disable"),
            Ok(SslMode::Disable)
        );
        assert_eq!(mode("postgres://u@db/x"), Ok(SslMode::Prefer));
        assert_eq!(
            mode("postgres://u@db/x?sslmode=require"),
            Ok(SslMode::Require)
        );
        assert!(
            mode("postgres://u@db/x?sslmode=bogus")
                .unwrap_err()
                .contains("bogus")
        );
        assert!(
            mode("postgres://u@db/x?sslmode=verify-full&sslrootcert=/nonexistent.pem").is_err()
        );
        assert_eq!(mode("postgres://u@db/x?sslmode=allow"), Ok(SslMode::Prefer));
    }

    #[test]
    fn a_url_the_driver_refuses_is_explained() {
        let error = postgres_config("postgres://u@db/x?sslmdoe=require")
            .err()
            .expect("an unknown parameter");
        assert!(error.contains("sslmdoe"), "{error}");
    }
}
