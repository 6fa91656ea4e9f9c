//! Cluster membership: a shared secret proves, by mutual challenge–response, that both
//! ends of a master RPC connection or a transfer-engine connection belong to the
//! cluster. The secret never crosses the wire.
//!
//! Before any protocol byte, the connecting side (the client) and the accepting side
//! (the server) exchange:
//!
//! ```text
//! client → server  hello    := "MCAUTH1\0" | channel u8 | 0 u8 x7 | client nonce [32]
//! server → client  challenge := server nonce [32] | HMAC(secret, "server" ‖ channel ‖ nonces) [32]
//! client → server  proof     := HMAC(secret, "client" ‖ channel ‖ nonces) [32]
//! server → client  verdict   := 0 (accepted) | 1 (refused, then the server closes)
//! ```
//!
//! HMAC is HMAC-SHA256; `nonces` is the client nonce followed by the server nonce, so a
//! proof is good for one connection only, and the role label keeps a server's answer
//! from being replayed as a client's proof. The client checks the server's proof before
//! it sends its own, so neither side learns anything from a peer without the secret.
//! The exchange runs once per connection; requests after it cost nothing extra.
//!
//! Where the secret comes from: `--cluster_secret_file` (or `MOONCAKE_CLUSTER_SECRET_FILE`)
//! on every master and node of a cluster; on a single node, the real client that serves
//! its embedded master over loopback writes a fresh secret to a file only its user can
//! read ([`local_master_secret_path`]), which local processes of that user pick up.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::flags::{FlagSpec, ParsedFlags};

/// The flag (and environment variable) that names the cluster secret, shared by
/// `mooncake_master` and `mooncake_client`.
pub static AUTH_FLAGS: &[FlagSpec] = &[FlagSpec::value(
    "cluster_secret_file",
    None,
    "file holding the cluster secret (at least 16 bytes, readable only by its owner): every master and transfer connection then proves membership with it",
)
.env("MOONCAKE_CLUSTER_SECRET_FILE")
.ours()];

/// Shortest secret accepted, in bytes.
pub const MIN_SECRET_LEN: usize = 16;
/// Longest secret file read.
pub const MAX_SECRET_LEN: usize = 4096;
/// Longest time the whole exchange may take on either side.
pub const AUTH_DEADLINE: Duration = Duration::from_secs(5);

const MAGIC: [u8; 8] = *b"MCAUTH1\0";
const NONCE_LEN: usize = 32;
const MAC_LEN: usize = 32;
/// Bytes of the client's hello.
pub const HELLO_LEN: usize = 16 + NONCE_LEN;
/// Bytes of the server's challenge.
pub const CHALLENGE_LEN: usize = NONCE_LEN + MAC_LEN;
/// Bytes of the client's proof.
pub const PROOF_LEN: usize = MAC_LEN;
const ACCEPTED: u8 = 0;
const REFUSED: u8 = 1;

/// Which protocol a connection will carry once authenticated; part of every proof, so
/// a proof for one protocol is worthless on the other.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Channel {
    /// Master RPC (tarpc).
    Master = 1,
    /// The transfer engine.
    Transfer = 2,
}

/// The shared secret of a cluster, ready to sign.
#[derive(Clone)]
pub struct ClusterSecret {
    key: hmac::Key,
    /// Where it came from, for log lines (never the secret).
    origin: String,
}

impl std::fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterSecret")
            .field("origin", &self.origin)
            .finish_non_exhaustive()
    }
}

/// Why a secret could not be read or created.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    /// The file could not be read.
    #[error("cannot read the cluster secret {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// Other users may read the file: the secret is no secret.
    #[error(
        "the cluster secret {path} may be read by other users (mode {mode:o}); run `chmod 600 {path}`"
    )]
    Exposed {
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// Too short (or too long) to be a secret.
    #[error(
        "the cluster secret {path} holds {len} bytes; it needs {MIN_SECRET_LEN} to {MAX_SECRET_LEN} (for example `head -c 32 /dev/urandom | base64 > {path}`)"
    )]
    BadLength {
        /// The file.
        path: PathBuf,
        /// Bytes it holds (after trimming white space).
        len: usize,
    },
    /// A local master secret could not be written.
    #[error("cannot write the local master secret {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// No entropy for a fresh secret.
    #[error("no random source for a fresh secret")]
    NoRandom,
}

impl ClusterSecret {
    /// A secret from raw bytes (at least [`MIN_SECRET_LEN`]); `origin` names it in logs.
    pub fn from_bytes(bytes: &[u8], origin: impl Into<String>) -> Self {
        ClusterSecret {
            key: hmac::Key::new(hmac::HMAC_SHA256, bytes),
            origin: origin.into(),
        }
    }

    /// Reads a secret file: readable only by its owner, 16 to 4096 bytes once leading
    /// and trailing white space is trimmed.
    pub fn read(path: &Path) -> Result<Self, SecretError> {
        use std::os::unix::fs::PermissionsExt;
        let read_error = |source| SecretError::Read {
            path: path.to_path_buf(),
            source,
        };
        let metadata = std::fs::metadata(path).map_err(read_error)?;
        let mode = metadata.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(SecretError::Exposed {
                path: path.to_path_buf(),
                mode,
            });
        }
        let mut bytes = Vec::new();
        std::fs::File::open(path)
            .and_then(|file| file.take(MAX_SECRET_LEN as u64 + 1).read_to_end(&mut bytes))
            .map_err(read_error)?;
        let trimmed = bytes.trim_ascii();
        if !(MIN_SECRET_LEN..=MAX_SECRET_LEN).contains(&trimmed.len()) {
            return Err(SecretError::BadLength {
                path: path.to_path_buf(),
                len: trimmed.len(),
            });
        }
        Ok(Self::from_bytes(trimmed, path.display().to_string()))
    }

    /// The secret named by `--cluster_secret_file`, if any.
    pub fn from_flags(flags: &ParsedFlags) -> Result<Option<Self>, SecretError> {
        match flags.string("cluster_secret_file") {
            Some(path) if !path.trim().is_empty() => Self::read(Path::new(path.trim())).map(Some),
            _ => Ok(None),
        }
    }

    /// A fresh random secret that exists only in this process (nobody else can prove
    /// membership with it).
    pub fn random(origin: impl Into<String>) -> Result<Self, SecretError> {
        let bytes = random_bytes::<32>()?;
        Ok(Self::from_bytes(&bytes, origin))
    }

    /// Where the secret came from (a path, or a description), for log lines.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// The MAC of the concatenation of `parts` (each caller starts with its own label).
    pub(crate) fn mac(&self, parts: &[&[u8]]) -> hmac::Tag {
        let mut context = hmac::Context::with_key(&self.key);
        for part in parts {
            context.update(part);
        }
        context.sign()
    }

    /// True when `mac` is the MAC of the concatenation of `parts` (compared in constant
    /// time).
    pub(crate) fn verify_mac(&self, parts: &[&[u8]], mac: &[u8]) -> bool {
        hmac::verify(&self.key, &parts.concat(), mac).is_ok()
    }

    fn sign(&self, role: &[u8], channel: u8, client: &[u8], server: &[u8]) -> hmac::Tag {
        self.mac(&[b"mooncake-auth-v1 ", role, &[channel], client, server])
    }

    fn verify(&self, role: &[u8], channel: u8, client: &[u8], server: &[u8], mac: &[u8]) -> bool {
        self.verify_mac(
            &[b"mooncake-auth-v1 ", role, &[channel], client, server],
            mac,
        )
    }
}

fn random_bytes<const N: usize>() -> Result<[u8; N], SecretError> {
    let mut bytes = [0u8; N];
    SystemRandom::new()
        .fill(&mut bytes)
        .map_err(|_| SecretError::NoRandom)?;
    Ok(bytes)
}

/// Why a connection was not authenticated.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// The socket failed or timed out.
    #[error("the connection failed during authentication: {0}")]
    Io(#[from] std::io::Error),
    /// The exchange took longer than [`AUTH_DEADLINE`].
    #[error("the peer did not finish authenticating within {AUTH_DEADLINE:?}")]
    Timeout,
    /// The client did not start with a hello: it runs without a cluster secret, or is
    /// not a mooncake peer.
    #[error(
        "the peer sent no authentication hello: it runs without the cluster secret, or is not a mooncake process"
    )]
    NoHello,
    /// A hello for the other protocol.
    #[error("the peer asked to authenticate for another protocol")]
    WrongChannel,
    /// The peer's proof does not match our secret.
    #[error("the peer's proof does not match our cluster secret: it holds a different secret")]
    BadProof,
    /// The server refused our proof.
    #[error("the peer refused our proof: it holds a different cluster secret")]
    Refused,
    /// The server answered with something that is not a verdict.
    #[error("the peer answered with an unknown verdict")]
    BadVerdict,
}

/// The client's side of the exchange, between its hello and the verdict.
#[derive(Debug)]
pub struct ClientExchange {
    channel: Channel,
    nonce: [u8; NONCE_LEN],
}

impl ClientExchange {
    /// Starts an exchange: the hello to send.
    pub fn start(channel: Channel) -> Result<(Self, [u8; HELLO_LEN]), SecretError> {
        let nonce = random_bytes::<NONCE_LEN>()?;
        let mut hello = [0u8; HELLO_LEN];
        hello[..8].copy_from_slice(&MAGIC);
        hello[8] = channel as u8;
        hello[16..].copy_from_slice(&nonce);
        Ok((ClientExchange { channel, nonce }, hello))
    }

    /// Checks the server's challenge; the proof to send when the server holds the secret.
    pub fn answer(
        &self,
        secret: &ClusterSecret,
        challenge: &[u8; CHALLENGE_LEN],
    ) -> Result<[u8; PROOF_LEN], AuthError> {
        let (server_nonce, server_mac) = challenge.split_at(NONCE_LEN);
        let channel = self.channel as u8;
        if !secret.verify(b"server", channel, &self.nonce, server_nonce, server_mac) {
            return Err(AuthError::BadProof);
        }
        let mut proof = [0u8; PROOF_LEN];
        proof.copy_from_slice(
            secret
                .sign(b"client", channel, &self.nonce, server_nonce)
                .as_ref(),
        );
        Ok(proof)
    }
}

/// Reads the server's verdict byte.
pub fn read_verdict(verdict: u8) -> Result<(), AuthError> {
    match verdict {
        ACCEPTED => Ok(()),
        REFUSED => Err(AuthError::Refused),
        _ => Err(AuthError::BadVerdict),
    }
}

/// The server's side of the exchange, between its challenge and the client's proof.
#[derive(Debug)]
pub struct ServerExchange {
    channel: Channel,
    client_nonce: [u8; NONCE_LEN],
    server_nonce: [u8; NONCE_LEN],
}

impl ServerExchange {
    /// Checks a client's hello for `channel`; the challenge to send.
    pub fn challenge(
        secret: &ClusterSecret,
        channel: Channel,
        hello: &[u8; HELLO_LEN],
    ) -> Result<(Self, [u8; CHALLENGE_LEN]), AuthError> {
        if hello[..8] != MAGIC || hello[9..16].iter().any(|&b| b != 0) {
            return Err(AuthError::NoHello);
        }
        if hello[8] != channel as u8 {
            return Err(AuthError::WrongChannel);
        }
        let mut client_nonce = [0u8; NONCE_LEN];
        client_nonce.copy_from_slice(&hello[16..]);
        let server_nonce = random_bytes::<NONCE_LEN>()
            .map_err(|_| AuthError::Io(std::io::Error::other("no random source for a nonce")))?;
        let mut challenge = [0u8; CHALLENGE_LEN];
        challenge[..NONCE_LEN].copy_from_slice(&server_nonce);
        challenge[NONCE_LEN..].copy_from_slice(
            secret
                .sign(b"server", channel as u8, &client_nonce, &server_nonce)
                .as_ref(),
        );
        let exchange = ServerExchange {
            channel,
            client_nonce,
            server_nonce,
        };
        Ok((exchange, challenge))
    }

    /// Checks the client's proof.
    pub fn check(&self, secret: &ClusterSecret, proof: &[u8; PROOF_LEN]) -> Result<(), AuthError> {
        let channel = self.channel as u8;
        if secret.verify(
            b"client",
            channel,
            &self.client_nonce,
            &self.server_nonce,
            proof,
        ) {
            Ok(())
        } else {
            Err(AuthError::BadProof)
        }
    }
}

/// Authenticates a blocking stream as the connecting side. The caller sets the
/// socket's timeouts (at most [`AUTH_DEADLINE`]).
pub fn authenticate_client(
    stream: &mut (impl Read + Write),
    secret: &ClusterSecret,
    channel: Channel,
) -> Result<(), AuthError> {
    let (exchange, hello) = ClientExchange::start(channel).map_err(no_random)?;
    stream.write_all(&hello)?;
    let mut challenge = [0u8; CHALLENGE_LEN];
    stream.read_exact(&mut challenge)?;
    let proof = exchange.answer(secret, &challenge)?;
    stream.write_all(&proof)?;
    let mut verdict = [0u8; 1];
    stream.read_exact(&mut verdict)?;
    read_verdict(verdict[0])
}

/// Authenticates a blocking stream as the accepting side. The caller sets the socket's
/// timeouts (at most [`AUTH_DEADLINE`]).
pub fn authenticate_server(
    stream: &mut (impl Read + Write),
    secret: &ClusterSecret,
    channel: Channel,
) -> Result<(), AuthError> {
    let mut hello = [0u8; HELLO_LEN];
    stream.read_exact(&mut hello)?;
    let (exchange, challenge) = ServerExchange::challenge(secret, channel, &hello)?;
    stream.write_all(&challenge)?;
    let mut proof = [0u8; PROOF_LEN];
    stream.read_exact(&mut proof)?;
    let checked = exchange.check(secret, &proof);
    let verdict = if checked.is_ok() { ACCEPTED } else { REFUSED };
    stream.write_all(&[verdict])?;
    checked
}

/// [`authenticate_client`] on an async stream, within [`AUTH_DEADLINE`].
pub async fn authenticate_client_async(
    stream: &mut (impl AsyncRead + AsyncWrite + Unpin),
    secret: &ClusterSecret,
    channel: Channel,
) -> Result<(), AuthError> {
    let exchange = async {
        let (exchange, hello) = ClientExchange::start(channel).map_err(no_random)?;
        stream.write_all(&hello).await?;
        let mut challenge = [0u8; CHALLENGE_LEN];
        stream.read_exact(&mut challenge).await?;
        let proof = exchange.answer(secret, &challenge)?;
        stream.write_all(&proof).await?;
        read_verdict(stream.read_u8().await?)
    };
    tokio::time::timeout(AUTH_DEADLINE, exchange)
        .await
        .map_err(|_| AuthError::Timeout)?
}

/// [`authenticate_server`] on an async stream, within [`AUTH_DEADLINE`].
pub async fn authenticate_server_async(
    stream: &mut (impl AsyncRead + AsyncWrite + Unpin),
    secret: &ClusterSecret,
    channel: Channel,
) -> Result<(), AuthError> {
    let exchange = async {
        let mut hello = [0u8; HELLO_LEN];
        stream.read_exact(&mut hello).await?;
        let (exchange, challenge) = ServerExchange::challenge(secret, channel, &hello)?;
        stream.write_all(&challenge).await?;
        let mut proof = [0u8; PROOF_LEN];
        stream.read_exact(&mut proof).await?;
        let checked = exchange.check(secret, &proof);
        let verdict = if checked.is_ok() { ACCEPTED } else { REFUSED };
        stream.write_all(&[verdict]).await?;
        checked
    };
    tokio::time::timeout(AUTH_DEADLINE, exchange)
        .await
        .map_err(|_| AuthError::Timeout)?
}

fn no_random(_: SecretError) -> AuthError {
    AuthError::Io(std::io::Error::other("no random source for a nonce"))
}

/// The directory of this user's local secrets: `$XDG_RUNTIME_DIR/mooncake` when that
/// directory is ours, else `/tmp/mooncake-<uid>`. Created with mode 0700; refused when
/// it exists and belongs to someone else or others may enter it.
pub fn local_secret_dir() -> std::io::Result<PathBuf> {
    let uid = effective_uid();
    let dir = local_secret_dir_path(uid);
    match std::fs::create_dir(&dir) {
        Ok(()) => {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))?;
        }
        Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(error) => return Err(error),
    }
    if owned_private_dir(&dir, uid)? {
        Ok(dir)
    } else {
        Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!(
                "{} belongs to another user or others may enter it",
                dir.display()
            ),
        ))
    }
}

/// Where [`local_secret_dir`] is for `uid` (not created).
fn local_secret_dir_path(uid: u32) -> PathBuf {
    std::env::var_os("XDG_RUNTIME_DIR")
        .map(PathBuf::from)
        .filter(|dir| owned_private_dir(dir, uid).unwrap_or(false))
        .map_or_else(
            || std::env::temp_dir().join(format!("mooncake-{uid}")),
            |dir| dir.join("mooncake"),
        )
}

fn effective_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// True when `dir` is a directory (not a link) owned by `uid` that no one else may enter.
fn owned_private_dir(dir: &Path, uid: u32) -> std::io::Result<bool> {
    use std::os::unix::fs::MetadataExt;
    let metadata = std::fs::symlink_metadata(dir)?;
    Ok(metadata.is_dir() && metadata.uid() == uid && metadata.mode() & 0o077 == 0)
}

/// Where the real client serving its embedded master on loopback `port` keeps that
/// master's secret.
pub fn local_master_secret_path(port: u16) -> std::io::Result<PathBuf> {
    Ok(local_secret_dir()?.join(format!("master-{port}.secret")))
}

/// The secret another process of this user wrote for its embedded master on loopback
/// `port`, taken over with the master (`mooncake_client --takeover`): the file is
/// removed when the returned guard drops.
pub fn adopt_local_master_secret(port: u16) -> Option<(ClusterSecret, LocalSecretFile)> {
    let secret = find_local_master_secret(&format!("127.0.0.1:{port}"))?;
    let path = local_master_secret_path(port).ok()?;
    Some((secret, LocalSecretFile { path }))
}

/// A fresh secret for the embedded master on loopback `port`, written (mode 0600) where
/// local processes of this user find it. The file is removed when the guard drops.
pub fn create_local_master_secret(
    port: u16,
) -> Result<(ClusterSecret, LocalSecretFile), SecretError> {
    use std::os::unix::fs::OpenOptionsExt;
    let write_error = |path: &Path, source| SecretError::Write {
        path: path.to_path_buf(),
        source,
    };
    let path = local_master_secret_path(port)
        .map_err(|source| write_error(Path::new("<local secret directory>"), source))?;
    let bytes = random_bytes::<32>()?;
    let text: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    let temporary = path.with_extension(format!("{}.tmp", std::process::id()));
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&temporary)
        .and_then(|mut file| file.write_all(text.as_bytes()))
        .and_then(|()| std::fs::rename(&temporary, &path));
    if let Err(source) = written {
        let _ = std::fs::remove_file(&temporary);
        return Err(write_error(&path, source));
    }
    let secret = ClusterSecret::from_bytes(text.as_bytes(), path.display().to_string());
    Ok((secret, LocalSecretFile { path }))
}

/// The secret of a master on this machine's loopback `address` (`host:port`) written by
/// the real client that serves it, when there is one for this user.
pub fn find_local_master_secret(address: &str) -> Option<ClusterSecret> {
    let port = loopback_port(address)?;
    let dir = local_secret_dir_path(effective_uid());
    if !owned_private_dir(&dir, effective_uid()).unwrap_or(false) {
        return None;
    }
    let path = dir.join(format!("master-{port}.secret"));
    if !path.exists() {
        return None;
    }
    match ClusterSecret::read(&path) {
        Ok(secret) => Some(secret),
        Err(error) => {
            tracing::warn!(%error, "ignoring the local master secret");
            None
        }
    }
}

/// The port of `address` when it names a loopback address of this machine.
pub fn loopback_port(address: &str) -> Option<u16> {
    let resolved = std::net::ToSocketAddrs::to_socket_addrs(address).ok()?;
    let addresses: Vec<_> = resolved.collect();
    let first = addresses.first()?;
    addresses
        .iter()
        .all(|a| a.ip().is_loopback())
        .then_some(first.port())
}

/// Removes the local master secret file when dropped (only if it is still ours).
#[derive(Debug)]
pub struct LocalSecretFile {
    path: PathBuf,
}

impl LocalSecretFile {
    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for LocalSecretFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(text: &str) -> ClusterSecret {
        ClusterSecret::from_bytes(text.as_bytes(), "test")
    }

    /// Runs both sides over a socket pair; the client's and the server's outcomes.
    fn exchange(
        client_secret: &ClusterSecret,
        server_secret: &ClusterSecret,
    ) -> (Result<(), AuthError>, Result<(), AuthError>) {
        let (mut a, mut b) = std::os::unix::net::UnixStream::pair().expect("pair");
        for side in [&a, &b] {
            side.set_read_timeout(Some(AUTH_DEADLINE)).expect("timeout");
        }
        let server_secret = server_secret.clone();
        let server = std::thread::spawn(move || {
            let outcome = authenticate_server(&mut b, &server_secret, Channel::Master);
            drop(b);
            outcome
        });
        let client = authenticate_client(&mut a, client_secret, Channel::Master);
        drop(a);
        (client, server.join().expect("server thread"))
    }

    #[test]
    fn members_with_the_same_secret_accept_each_other() {
        let (client, server) = exchange(
            &secret("correct horse battery staple"),
            &secret("correct horse battery staple"),
        );
        assert!(client.is_ok(), "{client:?}");
        assert!(server.is_ok(), "{server:?}");
    }

    #[test]
    fn a_different_secret_is_refused_by_both_sides() {
        let (client, server) = exchange(
            &secret("correct horse battery staple"),
            &secret("another secret of the cluster"),
        );
        assert!(matches!(client, Err(AuthError::BadProof)), "{client:?}");
        assert!(server.is_err(), "{server:?}");
    }

    #[test]
    fn a_proof_for_the_other_channel_or_a_peer_without_hello_is_refused() {
        let key = secret("correct horse battery staple");
        let (_, mut hello) = ClientExchange::start(Channel::Transfer).expect("hello");
        assert!(matches!(
            ServerExchange::challenge(&key, Channel::Master, &hello),
            Err(AuthError::WrongChannel)
        ));
        hello[0] = b'X';
        assert!(matches!(
            ServerExchange::challenge(&key, Channel::Transfer, &hello),
            Err(AuthError::NoHello)
        ));
    }

    #[test]
    fn a_server_answer_cannot_be_replayed_as_a_client_proof() {
        let key = secret("correct horse battery staple");
        let (_, hello) = ClientExchange::start(Channel::Master).expect("hello");
        let (server, challenge) =
            ServerExchange::challenge(&key, Channel::Master, &hello).expect("challenge");
        let mut replay = [0u8; PROOF_LEN];
        replay.copy_from_slice(&challenge[NONCE_LEN..]);
        assert!(matches!(
            server.check(&key, &replay),
            Err(AuthError::BadProof)
        ));
    }

    mod foreign_bytes {
        //! Every message of the exchange comes from the peer: none may panic its reader,
        //! and none but the one signed with the secret for this connection is accepted.

        use proptest::prelude::*;

        use super::*;

        fn secret() -> ClusterSecret {
            super::secret("correct horse battery staple")
        }

        fn channel() -> impl Strategy<Value = Channel> {
            prop_oneof![Just(Channel::Master), Just(Channel::Transfer)]
        }

        fn array<const N: usize>() -> impl Strategy<Value = [u8; N]> {
            proptest::collection::vec(any::<u8>(), N).prop_map(|bytes| {
                let mut array = [0u8; N];
                array.copy_from_slice(&bytes);
                array
            })
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(500))]

            #[test]
            fn no_input_panics_the_auth_message_decoders(
                channel in channel(),
                hello in array::<HELLO_LEN>(),
                challenge in array::<CHALLENGE_LEN>(),
                proof in array::<PROOF_LEN>(),
                verdict in any::<u8>(),
            ) {
                let key = secret();
                let well_formed =
                    hello[..8] == MAGIC && hello[9..16] == [0; 7] && hello[8] == channel as u8;
                let server = ServerExchange::challenge(&key, channel, &hello);
                prop_assert_eq!(server.is_ok(), well_formed);
                if let Ok((server, _)) = server {
                    prop_assert!(matches!(server.check(&key, &proof), Err(AuthError::BadProof)));
                }
                let (client, _) = ClientExchange::start(channel).expect("hello");
                prop_assert!(matches!(
                    client.answer(&key, &challenge),
                    Err(AuthError::BadProof)
                ));
                match read_verdict(verdict) {
                    Ok(()) => prop_assert_eq!(verdict, ACCEPTED),
                    Err(AuthError::Refused) => prop_assert_eq!(verdict, REFUSED),
                    Err(error) => prop_assert!(matches!(error, AuthError::BadVerdict)),
                }
            }

            #[test]
            fn only_the_signed_auth_messages_are_accepted_and_any_bit_flip_is_refused(
                channel in channel(),
                at in any::<usize>(),
                flip in 1..=255u8,
            ) {
                let key = secret();
                let (client, hello) = ClientExchange::start(channel).expect("hello");
                let (server, challenge) =
                    ServerExchange::challenge(&key, channel, &hello).expect("challenge");
                let proof = client.answer(&key, &challenge).expect("the server's proof holds");
                prop_assert!(server.check(&key, &proof).is_ok());

                let mut bad_hello = hello;
                bad_hello[at % HELLO_LEN] ^= flip;
                // The nonce is any 32 bytes; the header is fixed.
                prop_assert_eq!(
                    ServerExchange::challenge(&key, channel, &bad_hello).is_ok(),
                    at % HELLO_LEN >= 16
                );
                let mut bad_challenge = challenge;
                bad_challenge[at % CHALLENGE_LEN] ^= flip;
                prop_assert!(matches!(
                    client.answer(&key, &bad_challenge),
                    Err(AuthError::BadProof)
                ));
                let mut bad_proof = proof;
                bad_proof[at % PROOF_LEN] ^= flip;
                prop_assert!(matches!(server.check(&key, &bad_proof), Err(AuthError::BadProof)));
            }
        }
    }

    #[test]
    fn secret_files_must_be_private_and_long_enough() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("mooncake-auth-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("secret");
        std::fs::write(&path, "  0123456789abcdef0123\n").expect("write");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        assert!(matches!(
            ClusterSecret::read(&path),
            Err(SecretError::Exposed { .. })
        ));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        assert!(ClusterSecret::read(&path).is_ok());
        std::fs::write(&path, "short\n").expect("write");
        assert!(matches!(
            ClusterSecret::read(&path),
            Err(SecretError::BadLength { len: 5, .. })
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_local_master_secret_is_private_found_by_port_and_removed_with_its_guard() {
        use std::os::unix::fs::PermissionsExt;
        let port = 20000 + (std::process::id() % 20000) as u16;
        let (secret, file) = create_local_master_secret(port).expect("created");
        let mode = std::fs::metadata(file.path())
            .expect("exists")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let found = find_local_master_secret(&format!("127.0.0.1:{port}")).expect("found");
        let (client, server) = exchange(&found, &secret);
        assert!(client.is_ok() && server.is_ok());
        assert!(find_local_master_secret(&format!("10.1.2.3:{port}")).is_none());
        let path = file.path().to_path_buf();
        drop(file);
        assert!(!path.exists());
    }
}
