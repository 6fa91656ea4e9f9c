//! TLS for the etcd connection: the certificate authority that signed etcd's server
//! certificate, and optionally this process's client certificate and key (for an etcd
//! started with `--client-cert-auth`). Masters (`--etcd_ca_file`, `--etcd_cert_file`,
//! `--etcd_key_file`) and real clients following an `etcd://` leader take the same
//! settings, also from `MOONCAKE_ETCD_CA_FILE`, `MOONCAKE_ETCD_CERT_FILE` and
//! `MOONCAKE_ETCD_KEY_FILE`. The files are read once, at startup, so a missing or
//! unreadable file stops the process with its name instead of failing every request.

use std::path::{Path, PathBuf};

use etcd_client::{Certificate, Identity, TlsOptions};
use mooncake_core::flags::{FlagSpec, ParsedFlags};

/// Environment variable naming the CA file (when the flag is absent).
pub const CA_FILE_ENV: &str = "MOONCAKE_ETCD_CA_FILE";
/// Environment variable naming the client certificate file.
pub const CERT_FILE_ENV: &str = "MOONCAKE_ETCD_CERT_FILE";
/// Environment variable naming the client key file.
pub const KEY_FILE_ENV: &str = "MOONCAKE_ETCD_KEY_FILE";

/// The flags of the etcd connection's TLS (`mooncake_master` with `--enable_ha`,
/// `mooncake_client` with an `etcd://` master address).
pub static ETCD_TLS_FLAGS: &[FlagSpec] = &[
    FlagSpec::value(
        "etcd_ca_file",
        None,
        "PEM file of the CA that signed etcd's server certificate: etcd is reached over TLS",
    )
    .env(CA_FILE_ENV)
    .ours(),
    FlagSpec::value(
        "etcd_cert_file",
        None,
        "PEM client certificate presented to etcd (etcd --client-cert-auth); with --etcd_key_file",
    )
    .env(CERT_FILE_ENV)
    .ours(),
    FlagSpec::value("etcd_key_file", None, "PEM private key of --etcd_cert_file")
        .env(KEY_FILE_ENV)
        .ours(),
];

/// Largest certificate or key file read (a PEM chain is a few KiB).
const MAX_PEM_BYTES: u64 = 1 << 20;

/// What makes the TLS settings unusable.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EtcdTlsError {
    /// A client certificate without its key, or the other way round.
    #[error(
        "--etcd_cert_file and --etcd_key_file go together (the client certificate and its private key): give both or neither"
    )]
    HalfIdentity,
    /// A client certificate without the CA that checks etcd's certificate.
    #[error(
        "--etcd_cert_file needs --etcd_ca_file (the CA that signed etcd's server certificate; etcd's --trusted-ca-file names the CA of client certificates)"
    )]
    NoCa,
    /// A file could not be read.
    #[error("{flag} {path}: {reason}")]
    Unreadable {
        /// The flag that named it.
        flag: &'static str,
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
}

/// TLS settings of the etcd connection, the files' contents read.
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdTls {
    ca_pem: Vec<u8>,
    /// The client certificate chain and its private key (PEM).
    identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for EtcdTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdTls")
            .field("client_certificate", &self.identity.is_some())
            .finish_non_exhaustive()
    }
}

impl EtcdTls {
    /// The settings from the three files (each `None` when not given): `None` when no
    /// file is given (plain HTTP), an error when the set is incomplete or a file
    /// cannot be read.
    pub fn from_files(
        ca: Option<&Path>,
        cert: Option<&Path>,
        key: Option<&Path>,
    ) -> Result<Option<Self>, EtcdTlsError> {
        let identity = match (cert, key) {
            (None, None) => None,
            (Some(cert), Some(key)) => Some((
                read_pem("--etcd_cert_file", cert)?,
                read_pem("--etcd_key_file", key)?,
            )),
            _ => return Err(EtcdTlsError::HalfIdentity),
        };
        let Some(ca) = ca else {
            return match identity {
                Some(_) => Err(EtcdTlsError::NoCa),
                None => Ok(None),
            };
        };
        Ok(Some(EtcdTls {
            ca_pem: read_pem("--etcd_ca_file", ca)?,
            identity,
        }))
    }

    /// The settings of [`ETCD_TLS_FLAGS`], their files read.
    pub fn from_flags(flags: &ParsedFlags) -> Result<Option<Self>, EtcdTlsError> {
        let path = |name| {
            flags
                .string(name)
                .filter(|p| !p.trim().is_empty())
                .map(PathBuf::from)
        };
        let (ca, cert, key) = (
            path("etcd_ca_file"),
            path("etcd_cert_file"),
            path("etcd_key_file"),
        );
        Self::from_files(ca.as_deref(), cert.as_deref(), key.as_deref())
    }

    /// Whether a client certificate is presented.
    pub fn has_client_certificate(&self) -> bool {
        self.identity.is_some()
    }

    /// The options etcd-client connects with.
    pub(crate) fn options(&self) -> TlsOptions {
        let options = TlsOptions::new().ca_certificate(Certificate::from_pem(&self.ca_pem));
        match &self.identity {
            Some((cert, key)) => options.identity(Identity::from_pem(cert, key)),
            None => options,
        }
    }
}

fn read_pem(flag: &'static str, path: &Path) -> Result<Vec<u8>, EtcdTlsError> {
    let unreadable = |reason: String| EtcdTlsError::Unreadable {
        flag,
        path: path.to_path_buf(),
        reason,
    };
    let length = std::fs::metadata(path)
        .map_err(|error| unreadable(error.to_string()))?
        .len();
    if length > MAX_PEM_BYTES {
        return Err(unreadable(format!(
            "{length} bytes is no PEM file (at most {MAX_PEM_BYTES})"
        )));
    }
    let bytes = std::fs::read(path).map_err(|error| unreadable(error.to_string()))?;
    if !bytes.windows(11).any(|w| w == b"-----BEGIN ") {
        return Err(unreadable(
            "not PEM (no -----BEGIN line): give the certificate or key in PEM form".into(),
        ));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(name: &str, text: &str) -> PathBuf {
        let path = std::env::temp_dir().join(format!("etcd-tls-{}-{name}", std::process::id()));
        std::fs::write(&path, text).expect("write");
        path
    }

    #[test]
    fn no_files_mean_plain_http() {
        assert_eq!(EtcdTls::from_files(None, None, None), Ok(None));
    }

    #[test]
    fn an_incomplete_set_is_refused_with_the_missing_flag() {
        let pem = file("a.pem", "-----BEGIN CERTIFICATE-----\n");
        assert_eq!(
            EtcdTls::from_files(Some(&pem), Some(&pem), None),
            Err(EtcdTlsError::HalfIdentity)
        );
        assert_eq!(
            EtcdTls::from_files(None, Some(&pem), Some(&pem)),
            Err(EtcdTlsError::NoCa)
        );
        let tls = EtcdTls::from_files(Some(&pem), Some(&pem), Some(&pem))
            .expect("complete")
            .expect("tls");
        assert!(tls.has_client_certificate());
        let _ = std::fs::remove_file(pem);
    }

    #[test]
    fn a_missing_or_foreign_file_names_its_flag() {
        let missing = std::env::temp_dir().join("etcd-tls-none/ca.pem");
        let error = EtcdTls::from_files(Some(&missing), None, None).expect_err("missing");
        assert!(error.to_string().starts_with("--etcd_ca_file "), "{error}");
        let text = file("b.pem", "not a certificate");
        let error = EtcdTls::from_files(Some(&text), None, None).expect_err("not PEM");
        assert!(error.to_string().contains("not PEM"), "{error}");
        let _ = std::fs::remove_file(text);
    }
}
