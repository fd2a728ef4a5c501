//! TLS towards PostgreSQL with libpq's `sslmode` semantics, which
//! tokio-postgres only partly understands: `disable`, `prefer` and `require`
//! encrypt without verifying the server (as libpq does), `verify-ca` checks
//! the chain, `verify-full` the chain and the host name. `sslrootcert=FILE`
//! names the trusted roots (the system's otherwise); with `require` it turns
//! on chain verification, as in libpq. `tcp_user_timeout` is read here too,
//! as libpq reads it (milliseconds, where tokio-postgres reads seconds): a
//! URL means what it means to `psql`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, SignatureScheme};
use tokio_postgres::config::{SslMode, TargetSessionAttrs};
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
/// connector its `sslmode` and `sslrootcert` call for; `user_timeout` is the
/// `tcp_user_timeout` of a URL that sets none.
pub fn postgres_config(
    url: &str,
    user_timeout: Option<Duration>,
) -> Result<(tokio_postgres::Config, PostgresTls), String> {
    let LibpqParameters {
        url,
        mut sslmode,
        mut rootcert,
        tcp_user_timeout,
        target_session_attrs,
    } = take_libpq_parameters(url)?;
    // libpq 16's `sslrootcert=system`: the system's roots, and nothing short
    // of verify-full, since a public CA vouches for any name it has signed.
    if rootcert.as_deref() == Some(Path::new("system")) {
        rootcert = None;
        match sslmode.as_deref() {
            None | Some("verify-full") => sslmode = Some("verify-full".into()),
            Some(other) => {
                return Err(format!(
                    "sslrootcert=system needs sslmode=verify-full, not `{other}` (as libpq has it)"
                ));
            }
        }
    }
    let mut config: tokio_postgres::Config = url.parse().map_err(|e| crate::error_chain(&e))?;
    if config.get_hosts().is_empty() && config.get_hostaddrs().is_empty() {
        return Err(
            "names no server: give a host (postgres://user@db.example:5432/app) or a socket directory (postgres://user@%2Fvar%2Frun%2Fpostgresql/app)".into(),
        );
    }
    // A standby (or a server read-only by default) would take the
    // connection and then refuse every claim; such a server is passed over
    // as it is connected to, so a URL listing several hosts finds the primary.
    config.target_session_attrs(target_session_attrs);
    // libpq: 0, or less, leaves it to the kernel.
    match tcp_user_timeout.map_or(user_timeout, |millis| {
        u64::try_from(millis)
            .ok()
            .filter(|&millis| millis > 0)
            .map(Duration::from_millis)
    }) {
        Some(timeout) => config.tcp_user_timeout(timeout),
        None => &mut config,
    };
    // As libpq: under `prefer` and `require`, a root certificate given
    // is checked against (the chain, not the name).
    let chain_if_rooted = if rootcert.is_some() {
        Verification::Chain
    } else {
        Verification::None
    };
    let verification = match sslmode.as_deref() {
        // libpq's `allow` tries plain text first; encrypting whenever the
        // server offers it, as `prefer` does, is never weaker.
        None | Some("prefer" | "allow") => {
            config.ssl_mode(SslMode::Prefer);
            chain_if_rooted
        }
        Some("disable") => {
            config.ssl_mode(SslMode::Disable);
            Verification::None
        }
        Some("require") => {
            config.ssl_mode(SslMode::Require);
            chain_if_rooted
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
    // libpq ignores sslmode on a Unix socket, which has no TLS to offer; the
    // driver would ask the server for TLS over it and, told no, fail under
    // `require` and stronger modes.
    if only_unix_sockets(&config) {
        config.ssl_mode(SslMode::Disable);
    }
    let tls = client_config(verification, rootcert).map_err(|e| e.to_string())?;
    Ok((config, PostgresTls(MakeRustlsConnect::new(tls))))
}

/// Whether every server the URL names is a Unix socket directory (a list
/// that mixes in a TCP host keeps its `sslmode` for all of them, as the
/// driver takes one mode for the whole list).
fn only_unix_sockets(config: &tokio_postgres::Config) -> bool {
    config.get_hostaddrs().is_empty()
        && config
            .get_hosts()
            .iter()
            .all(|host| matches!(host, tokio_postgres::config::Host::Unix(_)))
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

/// The parameters libpq reads otherwise than tokio-postgres does, taken out
/// of a URL, percent-decoded as libpq decodes every parameter.
#[derive(Debug)]
struct LibpqParameters {
    url: String,
    sslmode: Option<String>,
    rootcert: Option<PathBuf>,
    /// Milliseconds.
    tcp_user_timeout: Option<i64>,
    target_session_attrs: TargetSessionAttrs,
}

fn take_libpq_parameters(url: &str) -> Result<LibpqParameters, String> {
    let mut taken = LibpqParameters {
        url: url.to_owned(),
        sslmode: None,
        rootcert: None,
        tcp_user_timeout: None,
        target_session_attrs: TargetSessionAttrs::ReadWrite,
    };
    let Some(query_start) = query_start(url) else {
        return Ok(taken);
    };
    let (base, query) = (&url[..query_start], &url[query_start + 1..]);
    let decoded = |name: &str, value: &str| {
        percent_encoding::percent_decode_str(value)
            .decode_utf8()
            .map(|value| value.into_owned())
            .map_err(|_| format!("{name}: percent-encoded bytes that are not UTF-8"))
    };
    let mut kept = Vec::new();
    for pair in query.split('&') {
        match pair.split_once('=') {
            Some(("sslmode", value)) => taken.sslmode = Some(decoded("sslmode", value)?),
            Some(("sslrootcert", value)) => {
                taken.rootcert = Some(PathBuf::from(decoded("sslrootcert", value)?));
            }
            Some(("tcp_user_timeout", value)) => {
                let value = decoded("tcp_user_timeout", value)?;
                let millis = value.trim().parse::<i64>().map_err(|_| {
                    format!("tcp_user_timeout `{value}` is not a number of milliseconds")
                })?;
                // Under a second, any lost packet would cost the connection:
                // most likely seconds meant as such.
                if (1..1000).contains(&millis) {
                    return Err(format!(
                        "tcp_user_timeout={millis} is {millis} ms (it is read in milliseconds, as libpq reads it); write {}000 for {millis} s",
                        millis
                    ));
                }
                taken.tcp_user_timeout = Some(millis);
            }
            Some(("target_session_attrs", value)) => {
                taken.target_session_attrs = match decoded("target_session_attrs", value)?.as_str()
                {
                    "read-write" | "primary" => TargetSessionAttrs::ReadWrite,
                    "any" => TargetSessionAttrs::Any,
                    other => {
                        return Err(format!(
                            "target_session_attrs `{other}`: the proxy writes every claim, so it needs a server that takes writes: read-write (the default; primary is read the same way) or any"
                        ));
                    }
                };
            }
            _ => kept.push(pair),
        }
    }
    taken.url = if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    Ok(taken)
}

/// Where a PostgreSQL URL's query begins. tokio-postgres reads everything up
/// to the first `@` as user and password, `?` included (a generated password
/// often holds one unencoded), so the query is the first `?` after it.
pub(crate) fn query_start(url: &str) -> Option<usize> {
    let credentials_end = url.find('@').unwrap_or(0);
    url[credentials_end..]
        .find('?')
        .map(|at| credentials_end + at)
}

fn client_config(
    verification: Verification,
    rootcert: Option<PathBuf>,
) -> Result<ClientConfig, TlsError> {
    let builder = ClientConfig::builder();
    let config = match verification {
        Verification::Full => {
            builder.with_root_certificates(root_store(rootcert.as_deref(), "sslrootcert")?)
        }
        Verification::Chain => {
            let roots = Arc::new(root_store(rootcert.as_deref(), "sslrootcert")?);
            let webpki = WebPkiServerVerifier::builder(roots).build().map_err(|e| {
                TlsError::Roots(format!("sslrootcert: no usable root certificate: {e}"))
            })?;
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
    fn a_server_that_takes_writes_is_asked_for_unless_the_url_says_any() {
        let attrs = |url: &str| {
            postgres_config(url, None).map(|(config, _)| config.get_target_session_attrs())
        };
        for (url, wanted) in [
            ("postgres://h/db", TargetSessionAttrs::ReadWrite),
            (
                "postgres://h1,h2/db?target_session_attrs=read-write",
                TargetSessionAttrs::ReadWrite,
            ),
            (
                "postgres://h/db?target_session_attrs=primary",
                TargetSessionAttrs::ReadWrite,
            ),
            (
                "postgres://h/db?sslmode=disable&target_session_attrs=any",
                TargetSessionAttrs::Any,
            ),
        ] {
            assert_eq!(attrs(url).unwrap(), wanted, "{url}");
        }
        for refused in ["read-only", "standby", "prefer-standby", "nonsense"] {
            let error =
                attrs(&format!("postgres://h/db?target_session_attrs={refused}")).unwrap_err();
            assert!(
                error.starts_with(&format!(
                    "target_session_attrs `{refused}`: the proxy writes every claim"
                )),
                "{error}"
            );
        }
    }

    #[test]
    fn libpq_parameters_are_taken_out_of_the_url() {
        let taken = take_libpq_parameters(
            "postgres://u@db/x?sslmode=verify-full&application_name=a&sslrootcert=/ca.pem",
        )
        .unwrap();
        assert_eq!(taken.url, "postgres://u@db/x?application_name=a");
        assert_eq!(taken.sslmode.as_deref(), Some("verify-full"));
        assert_eq!(taken.rootcert, Some(PathBuf::from("/ca.pem")));
        assert_eq!(
            take_libpq_parameters("postgres://u@db/x").unwrap().url,
            "postgres://u@db/x"
        );
        let taken = take_libpq_parameters(
            "postgres://u@db/x?sslmode=verify%2Dfull&sslrootcert=%2Fetc%2Fmy%20ca.pem",
        )
        .unwrap();
        assert_eq!(taken.sslmode.as_deref(), Some("verify-full"));
        assert_eq!(taken.rootcert, Some(PathBuf::from("/etc/my ca.pem")));
    }

    #[test]
    fn tcp_user_timeout_is_read_in_milliseconds_as_libpq_reads_it() {
        crate::tls::install_crypto_provider();
        let default = Some(Duration::from_secs(30));
        let timeout = |url: &str| {
            postgres_config(url, default).map(|(config, _)| config.get_tcp_user_timeout().copied())
        };
        assert_eq!(timeout("postgres://u@db/x"), Ok(default));
        assert_eq!(
            timeout("postgres://u@db/x?tcp_user_timeout=5000"),
            Ok(Some(Duration::from_secs(5)))
        );
        assert_eq!(
            timeout("postgres://u@db/x?sslmode=disable&tcp_user_timeout=%35000"),
            Ok(Some(Duration::from_secs(5))),
            "percent-decoded"
        );
        for kernel in ["0", "-1"] {
            assert_eq!(
                timeout(&format!("postgres://u@db/x?tcp_user_timeout={kernel}")),
                Ok(None),
                "{kernel}: the kernel's own"
            );
        }
        assert!(
            timeout("postgres://u@db/x?tcp_user_timeout=5s")
                .unwrap_err()
                .contains("not a number of milliseconds")
        );
        assert!(
            timeout("postgres://u@db/x?tcp_user_timeout=30")
                .unwrap_err()
                .contains("write 30000 for 30 s"),
            "seconds written as they once were read"
        );
        assert_eq!(
            timeout("postgres://u:pa?ss@db/x?tcp_user_timeout=5000"),
            Ok(Some(Duration::from_secs(5))),
            "a `?` in the password is not the query"
        );
    }

    #[test]
    fn unix_socket_hosts_get_a_connector() {
        crate::tls::install_crypto_provider();
        let (config, mut tls) =
            postgres_config("postgres://u@%2Fvar%2Frun%2Fpostgresql/x", None).unwrap();
        assert!(matches!(
            config.get_hosts()[0],
            tokio_postgres::config::Host::Unix(_)
        ));
        assert!(MakeTlsConnect::<tokio::net::TcpStream>::make_tls_connect(&mut tls, "").is_ok());
    }

    #[test]
    fn sslmode_is_ignored_on_unix_sockets_as_libpq_ignores_it() {
        crate::tls::install_crypto_provider();
        let mode = |url: &str| postgres_config(url, None).map(|(config, _)| config.get_ssl_mode());
        for sslmode in ["require", "verify-ca", "verify-full", "prefer"] {
            assert_eq!(
                mode(&format!(
                    "postgres://u@%2Fvar%2Frun%2Fpostgresql/x?sslmode={sslmode}"
                )),
                Ok(SslMode::Disable),
                "{sslmode}"
            );
        }
        assert_eq!(
            mode("postgres://u@/x?host=/var/run/postgresql&host=db&sslmode=require"),
            Ok(SslMode::Require),
            "a list with a TCP host keeps its mode"
        );
        assert!(
            mode("postgres://u@%2Fvar%2Frun%2Fpostgresql/x?sslmode=bogus").is_err(),
            "and a bad one is still refused"
        );
    }

    #[test]
    fn sslmodes_map_to_the_driver_and_a_verifier() {
        crate::tls::install_crypto_provider();
        let mode = |url: &str| postgres_config(url, None).map(|(config, _)| config.get_ssl_mode());
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
        for unread_root in ["", "sslmode=prefer&", "sslmode=allow&", "sslmode=require&"] {
            let url = format!("postgres://u@db/x?{unread_root}sslrootcert=/nonexistent.pem");
            assert!(mode(&url).is_err(), "{url}: the root is read");
        }
        assert_eq!(
            mode("postgres://u@db/x?sslmode=disable&sslrootcert=/nonexistent.pem"),
            Ok(SslMode::Disable)
        );
        assert_eq!(
            mode("postgres://u@db/x?sslrootcert=system"),
            Ok(SslMode::Require)
        );
        assert!(
            mode("postgres://u@db/x?sslmode=require&sslrootcert=system")
                .unwrap_err()
                .contains("verify-full")
        );
    }

    #[test]
    fn a_url_without_a_server_is_refused() {
        for url in ["postgres:///app", "postgresql://user@/app?sslmode=disable"] {
            let error = postgres_config(url, None).err().expect(url);
            assert!(error.contains("names no server"), "{url}: {error}");
        }
        assert!(postgres_config("postgres://u@/app?host=/var/run/postgresql", None).is_ok());
    }

    #[test]
    fn a_url_the_driver_refuses_is_explained() {
        let error = postgres_config("postgres://u@db/x?sslmdoe=require", None)
            .err()
            .expect("an unknown parameter");
        assert!(error.contains("sslmdoe"), "{error}");
    }
}
