//! TLS for the ClickHouse sinks: builds the HTTP(S) client that the
//! `clickhouse` crate talks through.
//!
//! The `clickhouse` crate is used without its own TLS features; instead this
//! module builds a `hyper_util` client over a rustls connector (ring provider)
//! whose roots come from the sink's spec parameters (`enable_tls`,
//! `tls_ca_files`, `tls_ca_directory`, `tls_skip_verification`), and hands it
//! to [`clickhouse::Client::with_http_client`].

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::rt::TokioExecutor;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};

/// TCP keepalive of the connections, as the `clickhouse` crate's default client.
const TCP_KEEPALIVE: Duration = Duration::from_secs(60);

/// Idle timeout of pooled connections, as the `clickhouse` crate's default
/// client (ClickHouse closes idle keep-alive connections after 3 s).
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(2);

/// File extensions taken from `tls_ca_directory`.
const CA_EXTENSIONS: [&str; 2] = ["pem", "crt"];

/// TLS settings of a sink (from its spec parameters `enable_tls`,
/// `tls_ca_files`, `tls_ca_directory`, `tls_skip_verification`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TlsOptions {
    /// Talk HTTPS instead of HTTP.
    pub enable_tls: bool,
    /// PEM files whose certificates are trusted as roots.
    pub ca_files: Vec<PathBuf>,
    /// A directory whose `*.pem` / `*.crt` files are trusted as roots.
    pub ca_directory: Option<PathBuf>,
    /// Accept any server certificate (insecure; for tests only).
    pub skip_verification: bool,
}

/// The TLS settings of a sink with `enable_tls: true`, validated from its spec parameters
/// (`tls_ca_files`, `tls_ca_directory`, `tls_skip_verification`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TlsConfig {
    /// PEM files whose certificates are trusted as roots.
    pub ca_files: Vec<PathBuf>,
    /// A directory whose `*.pem` / `*.crt` files are trusted as roots.
    pub ca_directory: Option<PathBuf>,
    /// Accept any server certificate (insecure; for tests only).
    pub skip_verification: bool,
}

impl TlsOptions {
    /// The client options of a sink with `tls` (`None`: plain HTTP).
    pub fn from_config(tls: Option<&TlsConfig>) -> TlsOptions {
        match tls {
            None => TlsOptions::default(),
            Some(tls) => TlsOptions {
                enable_tls: true,
                ca_files: tls.ca_files.clone(),
                ca_directory: tls.ca_directory.clone(),
                skip_verification: tls.skip_verification,
            },
        }
    }
}

/// Why the TLS client could not be built.
#[derive(thiserror::Error, Debug)]
#[non_exhaustive]
pub enum TlsError {
    /// A CA file or the CA directory could not be read.
    #[error("cannot read TLS CA path {}: {source}", path.display())]
    CannotRead {
        /// The file or directory.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A CA file (or the CA directory) holds no PEM certificate.
    #[error("no PEM certificate found in TLS CA path {}", path.display())]
    NoCertificates {
        /// The file or directory.
        path: PathBuf,
    },
    /// A CA file holds a malformed or unusable certificate.
    #[error("bad certificate in TLS CA file {}: {source}", path.display())]
    BadCertificate {
        /// The file.
        path: PathBuf,
        /// What is wrong with it (the PEM reader's or rustls's error).
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The TLS configuration could not be built.
    #[error("TLS configuration error: {0}")]
    Config(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// The scheme to use in endpoint URLs: "https" when TLS is enabled, else "http".
pub fn scheme(options: &TlsOptions) -> &'static str {
    if options.enable_tls {
        "https"
    } else {
        "http"
    }
}

/// Builds a `clickhouse::Client` base (no URL yet) over a hyper client whose
/// connector:
///  - without TLS: plain HTTP (TCP keepalive 60 s, pool idle timeout 2 s, as
///    the crate's default client);
///  - with TLS: rustls (ring); roots are the PEM certificates of every
///    `ca_files` entry plus every `*.pem` / `*.crt` file of `ca_directory`, or
///    the system roots (the bundled webpki roots when the system has none)
///    when both are empty; `skip_verification` accepts any certificate;
///  - gives up connecting after `connect_timeout`.
///
/// The caller sets the URL (`format!("{}://{host}:{port}", scheme(options))`),
/// user, database and so on.
pub fn base_client(
    options: &TlsOptions,
    connect_timeout: Duration,
) -> Result<clickhouse::Client, TlsError> {
    let mut http = HttpConnector::new();
    http.set_keepalive(Some(TCP_KEEPALIVE));
    http.set_connect_timeout(Some(connect_timeout));

    if !options.enable_tls {
        return Ok(clickhouse::Client::with_http_client(
            HyperClient::builder(TokioExecutor::new())
                .pool_idle_timeout(POOL_IDLE_TIMEOUT)
                .build(http),
        ));
    }

    // The https connector hands `https` URIs to the inner connector.
    http.enforce_http(false);
    let config = client_config(options)?;
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(config)
        .https_only()
        .enable_http1()
        .wrap_connector(http);
    Ok(clickhouse::Client::with_http_client(
        HyperClient::builder(TokioExecutor::new())
            .pool_idle_timeout(POOL_IDLE_TIMEOUT)
            .build(https),
    ))
}

/// The rustls client configuration of `options` (TLS enabled).
fn client_config(options: &TlsOptions) -> Result<ClientConfig, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(Box::new(e)))?;

    if options.skip_verification {
        tracing::warn!(
            "ClickHouse TLS certificate verification is disabled (tls_skip_verification): \
             the connection is encrypted but the server is NOT authenticated; \
             do not use this in production"
        );
        return Ok(builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AcceptAnyCertificate { provider }))
            .with_no_client_auth());
    }

    let Some(verifier) = ConfiguredRootsVerifier::with_provider(options, provider)? else {
        let mut roots = RootCertStore::empty();
        add_system_roots(&mut roots);
        return Ok(builder.with_root_certificates(roots).with_no_client_auth());
    };
    Ok(builder
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier))
        .with_no_client_auth())
}

/// The certificates of the configured CA files and directory, each with the
/// file it comes from; `None` when neither is configured (system roots).
fn configured_certificates(
    options: &TlsOptions,
) -> Result<Option<Vec<(PathBuf, CertificateDer<'static>)>>, TlsError> {
    let mut files: Vec<PathBuf> = options.ca_files.clone();
    if let Some(dir) = &options.ca_directory {
        let found = ca_directory_files(dir)?;
        if found.is_empty() {
            return Err(TlsError::NoCertificates { path: dir.clone() });
        }
        files.extend(found);
    }
    if files.is_empty() {
        return Ok(None);
    }
    let mut certs = Vec::new();
    for file in files {
        for cert in read_pem_certificates(&file)? {
            certs.push((file.clone(), cert));
        }
    }
    Ok(Some(certs))
}

/// The `*.pem` / `*.crt` files of `dir` (not recursive), sorted by name.
fn ca_directory_files(dir: &Path) -> Result<Vec<PathBuf>, TlsError> {
    let cannot_read = |source| TlsError::CannotRead {
        path: dir.to_path_buf(),
        source,
    };
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(cannot_read)? {
        let path = entry.map_err(cannot_read)?.path();
        let wanted = path
            .extension()
            .and_then(|ext| ext.to_str())
            .is_some_and(|ext| CA_EXTENSIONS.iter().any(|w| ext.eq_ignore_ascii_case(w)));
        if wanted && path.is_file() {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// The PEM certificates of `path`; at least one.
fn read_pem_certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bytes = std::fs::read(path).map_err(|source| TlsError::CannotRead {
        path: path.to_path_buf(),
        source,
    })?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::BadCertificate {
            path: path.to_path_buf(),
            source: Box::new(e),
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificates {
            path: path.to_path_buf(),
        });
    }
    Ok(certs)
}

/// Adds the operating system's roots, or the bundled webpki (Mozilla) roots
/// when none of those can be loaded.
fn add_system_roots(roots: &mut RootCertStore) {
    let native = rustls_native_certs::load_native_certs();
    for error in &native.errors {
        tracing::debug!(%error, "could not load some system TLS roots");
    }
    let (added, ignored) = roots.add_parsable_certificates(native.certs);
    if ignored > 0 {
        tracing::debug!(ignored, "ignored unparsable system TLS roots");
    }
    if added == 0 {
        tracing::debug!("no system TLS roots found; using the bundled webpki roots");
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    }
}

/// The verifier used with configured CA files: standard WebPKI verification
/// against them, plus one accommodation: a server presenting, alone, a
/// self-signed certificate that is itself one of the configured files is
/// accepted even though it is marked as a CA (`CA:TRUE`), as OpenSSL and curl
/// do. That is what `openssl req -x509` makes by default, as in ClickHouse's
/// own TLS set-up guide, and webpki refuses it (`CaUsedAsEndEntity`). The
/// certificate's validity period is checked by webpki before it reaches that
/// error, and its names are checked here.
///
/// Public so that its decisions can be checked directly (the integration tests do, on the local
/// cluster's certificate); [`base_client`] builds it itself.
#[derive(Debug)]
pub struct ConfiguredRootsVerifier {
    inner: Arc<WebPkiServerVerifier>,
    pinned: Vec<CertificateDer<'static>>,
}

impl ConfiguredRootsVerifier {
    /// The verifier [`base_client`] uses for `options` (ring provider): the certificates of the
    /// configured CA files and directory are its roots and its pinned certificates. `None` when
    /// neither is configured (the system roots are used then). `enable_tls` and
    /// `skip_verification` are not looked at.
    #[cfg(any(test, feature = "testing"))]
    pub fn from_options(options: &TlsOptions) -> Result<Option<Self>, TlsError> {
        Self::with_provider(options, Arc::new(rustls::crypto::ring::default_provider()))
    }

    /// `Self::from_options` with the given crypto provider.
    fn with_provider(
        options: &TlsOptions,
        provider: Arc<CryptoProvider>,
    ) -> Result<Option<Self>, TlsError> {
        let Some(configured) = configured_certificates(options)? else {
            return Ok(None);
        };
        let mut roots = RootCertStore::empty();
        for (path, cert) in &configured {
            roots
                .add(cert.clone())
                .map_err(|e| TlsError::BadCertificate {
                    path: path.clone(),
                    source: Box::new(e),
                })?;
        }
        let inner = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider)
            .build()
            .map_err(|e| TlsError::Config(Box::new(e)))?;
        Ok(Some(ConfiguredRootsVerifier {
            inner,
            pinned: configured.into_iter().map(|(_, cert)| cert).collect(),
        }))
    }

    /// Whether `error` is webpki's refusal of a CA certificate as the server's.
    fn is_ca_used_as_end_entity(error: &rustls::Error) -> bool {
        match error {
            rustls::Error::InvalidCertificate(rustls::CertificateError::Other(other)) => {
                matches!(
                    other.0.downcast_ref::<webpki::Error>(),
                    Some(webpki::Error::CaUsedAsEndEntity)
                )
            }
            _ => false,
        }
    }
}

impl ServerCertVerifier for ConfiguredRootsVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let error = match self.inner.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        ) {
            Ok(verified) => return Ok(verified),
            Err(error) => error,
        };
        let pinned = intermediates.is_empty()
            && self
                .pinned
                .iter()
                .any(|cert| cert.as_ref() == end_entity.as_ref());
        if !pinned || !Self::is_ca_used_as_end_entity(&error) {
            return Err(error);
        }
        let cert = webpki::EndEntityCert::try_from(end_entity).map_err(|_| error.clone())?;
        match cert.verify_is_valid_for_subject_name(server_name) {
            Ok(()) => Ok(ServerCertVerified::assertion()),
            Err(_) => Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::NotValidForName,
            )),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// A verifier that accepts any server certificate (`tls_skip_verification`).
/// Handshake signatures are still checked, so the session keys are bound to
/// the presented certificate, but nothing ties that certificate to the server.
#[derive(Debug)]
struct AcceptAnyCertificate {
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for AcceptAnyCertificate {
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
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TIMEOUT: Duration = Duration::from_secs(5);

    fn tls(ca_files: Vec<PathBuf>) -> TlsOptions {
        TlsOptions {
            enable_tls: true,
            ca_files,
            ..TlsOptions::default()
        }
    }

    /// The TLS error of building a client for `options`.
    fn build_error(options: &TlsOptions) -> TlsError {
        match base_client(options, TIMEOUT) {
            Ok(_) => panic!("building a client for {options:?} must fail"),
            Err(e) => e,
        }
    }

    #[test]
    fn scheme_follows_enable_tls() {
        assert_eq!(scheme(&TlsOptions::default()), "http");
        assert_eq!(scheme(&tls(Vec::new())), "https");
    }

    #[test]
    fn plain_client_builds_without_runtime_work() {
        assert!(base_client(&TlsOptions::default(), TIMEOUT).is_ok());
    }

    #[test]
    fn missing_ca_file_names_the_path() {
        let path = PathBuf::from("/nonexistent/flow/ca.pem");
        let err = build_error(&tls(vec![path.clone()]));
        match &err {
            TlsError::CannotRead { path: p, .. } => assert_eq!(p, &path),
            other => panic!("unexpected error {other:?}"),
        }
        assert!(
            err.to_string().contains("/nonexistent/flow/ca.pem"),
            "{err}"
        );
    }

    #[test]
    fn file_without_certificates_is_rejected() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("empty.pem");
        std::fs::write(&path, "just some text, no PEM here\n").expect("write");
        let err = build_error(&tls(vec![path.clone()]));
        match &err {
            TlsError::NoCertificates { path: p } => assert_eq!(p, &path),
            other => panic!("unexpected error {other:?}"),
        }
        assert!(err.to_string().contains("empty.pem"), "{err}");
    }

    #[test]
    fn malformed_certificate_is_rejected() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("bad.pem");
        std::fs::write(
            &path,
            "-----BEGIN CERTIFICATE-----\nnot base64 at all!!\n-----END CERTIFICATE-----\n",
        )
        .expect("write");
        let err = build_error(&tls(vec![path.clone()]));
        match &err {
            TlsError::BadCertificate { path: p, .. } => assert_eq!(p, &path),
            other => panic!("unexpected error {other:?}"),
        }
    }

    #[test]
    fn directory_without_ca_files_is_rejected() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("README.txt"), "not a CA file").expect("write");
        let options = TlsOptions {
            enable_tls: true,
            ca_directory: Some(dir.path().to_path_buf()),
            ..TlsOptions::default()
        };
        let err = build_error(&options);
        match &err {
            TlsError::NoCertificates { path: p } => assert_eq!(p, dir.path()),
            other => panic!("unexpected error {other:?}"),
        }
    }

    #[test]
    fn missing_ca_directory_names_the_path() {
        let options = TlsOptions {
            enable_tls: true,
            ca_directory: Some(PathBuf::from("/nonexistent/flow/cas")),
            ..TlsOptions::default()
        };
        let err = build_error(&options);
        assert!(
            matches!(&err, TlsError::CannotRead { path, .. } if path == Path::new("/nonexistent/flow/cas")),
            "{err:?}"
        );
    }

    #[test]
    fn directory_lists_only_pem_and_crt_files() {
        let dir = tempfile::tempdir().expect("tempdir");
        for name in ["b.crt", "a.PEM", "c.key", "d.txt"] {
            std::fs::write(dir.path().join(name), "x").expect("write");
        }
        std::fs::create_dir(dir.path().join("sub.pem")).expect("mkdir");
        let files = ca_directory_files(dir.path()).expect("list");
        let names: Vec<_> = files
            .iter()
            .filter_map(|p| p.file_name()?.to_str())
            .collect();
        assert_eq!(names, ["a.PEM", "b.crt"]);
    }

    #[test]
    fn system_roots_and_skip_verification_build() {
        assert!(base_client(&tls(Vec::new()), TIMEOUT).is_ok());
        let insecure = TlsOptions {
            skip_verification: true,
            ..tls(Vec::new())
        };
        assert!(base_client(&insecure, TIMEOUT).is_ok());
    }
}
