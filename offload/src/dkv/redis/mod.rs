//! A Redis or Valkey store, standalone or cluster, as a [`DkvClient`]
//! (`MOONCAKE_OFFLOAD_DKV_CLIENT=redis`).
//!
//! Values move over direct connections when the store is a single server reached over
//! plain TCP ([`direct`]): `SET`s of a batch written from the caller's memory with
//! gathered writes, spread over up to four connections for large batches, and `GET`
//! replies read straight into the caller's buffers. Everything else (listing, deleting,
//! existence, capacity; clusters, TLS and Unix sockets entirely) goes through the
//! `redis` crate's client on its own one-thread tokio runtime, so the SSD tier calls it
//! from any thread: pipelines of about 1 MiB, to a cluster as requests to each key's
//! node, all in flight at once ([`connection`]). The connection to a single server is
//! a `ConnectionManager`: after the server went away calls fail fast and the next call
//! reconnects, so offloading resumes by itself when the store returns (direct
//! connections reconnect the same way). Values are stored as they are given (the SSD
//! tier's records carry magic, lengths and a checksum).

mod address;
mod connection;
mod direct;

use std::future::Future;
use std::path::Path;

use redis::{Cmd, RedisError, Value};

pub use address::{Address, CA_VARIABLE, SetupError, URL_VARIABLE, hide_password};
use connection::{Connection, connect};
#[cfg(any(test, feature = "test-utils"))]
pub use connection::{Primary, read_reply};
#[cfg(any(test, feature = "test-utils"))]
pub use direct::read_replies;
use direct::{DirectPool, Target};

use super::{DkvClient, DkvError, GetInto, PutFrom, ScanPage};

/// Largest value Redis accepts with its default `proto-max-bulk-len`.
const MAX_VALUE_LEN: usize = 512 << 20;

/// Bytes of arguments per pipeline: Redis slows down sharply on pipelines of many
/// large values (a 256 MiB pipeline of 1 MiB SETs ran at a sixth of the rate of single
/// SETs), so a batch goes out as pipelines of about this size, one after the other,
/// at most two in flight (little memory held).
const PIPELINE_BYTES: usize = 1 << 20;

/// A connected Redis or Valkey client.
pub struct RedisClient {
    /// Runs the connection's I/O; `None` only while dropping.
    runtime: Option<tokio::runtime::Runtime>,
    connection: Connection,
    /// Direct connections for `SET`s and `GET`s of values, to a single server over
    /// plain TCP ([`direct`]); `None` for clusters, TLS and Unix sockets.
    direct: Option<DirectPool>,
    shown: String,
    capacity: Option<u64>,
}

impl std::fmt::Debug for RedisClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisClient")
            .field("store", &self.describe())
            .field("capacity", &self.capacity)
            .finish_non_exhaustive()
    }
}

impl RedisClient {
    /// Connects to the store named by `setting` (`MOONCAKE_OFFLOAD_DKV_URL`), trusting
    /// the CA certificates in `ca_file` for TLS when given; one round trip checks that
    /// the store answers.
    pub fn open(setting: &str, ca_file: Option<&Path>) -> Result<Self, SetupError> {
        let address = Address::parse(setting)?;
        if let (Some(path), false) = (ca_file, address.uses_tls()) {
            return Err(SetupError::CaFile {
                path: path.display().to_string(),
                reason: format!("given, but {URL_VARIABLE} does not use TLS (rediss://...)"),
            });
        }
        let certificates = ca_file.map(read_ca_file).transpose()?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("mooncake-redis")
            .enable_io()
            .enable_time()
            .build()?;
        let shown = address.shown.clone();
        let direct_target = direct_target(&address);
        let unreachable = |reason: String| SetupError::Unreachable {
            shown: shown.clone(),
            reason,
        };
        let (connection, capacity) = run_on(&runtime, connect(address, certificates))
            .ok_or_else(|| unreachable("the client's I/O thread stopped".into()))?
            .map_err(|e| unreachable(e.to_string()))?;
        let direct = match connection {
            Connection::Single(_) => direct_target.map(DirectPool::new),
            Connection::Cluster(_) => None,
        };
        Ok(RedisClient {
            runtime: Some(runtime),
            connection,
            direct,
            shown,
            capacity,
        })
    }

    /// Sends `commands` without waiting for the replies.
    fn send(&self, commands: Vec<Cmd>) -> InFlight {
        let count = commands.len();
        let (done, replies) = std::sync::mpsc::sync_channel(1);
        if let Some(runtime) = &self.runtime {
            let work = self.connection.clone().each(commands);
            runtime.spawn(async move {
                let _ = done.send(work.await);
            });
        }
        InFlight { count, replies }
    }
}

/// Commands sent, their replies still to come.
struct InFlight {
    count: usize,
    replies: std::sync::mpsc::Receiver<Vec<redis::RedisResult<Value>>>,
}

impl InFlight {
    /// Waits for one reply (or error) per command.
    fn wait(self) -> Vec<Result<Value, DkvError>> {
        match self.replies.recv() {
            Ok(replies) if replies.len() == self.count => replies
                .into_iter()
                .map(|reply| reply.map_err(|e| store_error(&e)))
                .collect(),
            _ => vec![Err(stopped()); self.count],
        }
    }
}

impl Drop for RedisClient {
    fn drop(&mut self) {
        // May run inside another runtime: never block here.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// The error of a call after the client's I/O thread stopped.
fn stopped() -> DkvError {
    DkvError::Store("the Redis client's I/O thread stopped".into())
}

/// Runs `work` on `runtime` and waits (from any thread) for its output; `None` when the
/// runtime is gone.
fn run_on<T: Send + 'static>(
    runtime: &tokio::runtime::Runtime,
    work: impl Future<Output = T> + Send + 'static,
) -> Option<T> {
    let (done, output) = std::sync::mpsc::sync_channel(1);
    runtime.spawn(async move {
        let _ = done.send(work.await);
    });
    output.recv().ok()
}

/// Where direct connections go: the one node of `address` when it is reached over
/// plain TCP.
fn direct_target(address: &Address) -> Option<Target> {
    let [node] = address.nodes.as_slice() else {
        return None;
    };
    let redis::ConnectionAddr::Tcp(host, port) = node.addr() else {
        return None;
    };
    let settings = node.redis_settings();
    Some(Target {
        host: host.clone(),
        port: *port,
        username: settings.username().map(str::to_string),
        password: settings.password().map(str::to_string),
        db: settings.db(),
    })
}

/// The CA certificates of `path`, checked to be PEM certificates.
fn read_ca_file(path: &Path) -> Result<redis::TlsCertificates, SetupError> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let failed = |reason: String| SetupError::CaFile {
        path: path.display().to_string(),
        reason,
    };
    let pem = std::fs::read(path).map_err(|e| failed(e.to_string()))?;
    let certificates = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| failed(format!("not PEM: {e}")))?;
    if certificates.is_empty() {
        return Err(failed("no PEM certificate in it".into()));
    }
    Ok(redis::TlsCertificates {
        client_tls: None,
        root_cert: Some(pem),
    })
}

/// `command` weighed by the bytes of its arguments.
fn weighed(command: Cmd) -> (Cmd, usize) {
    let bytes = command
        .args_iter()
        .map(|arg| match arg {
            redis::Arg::Simple(bytes) => bytes.len(),
            _ => 0,
        })
        .sum();
    (command, bytes)
}

/// The per-key error for a failed request.
fn store_error(error: &RedisError) -> DkvError {
    if error.code() == Some("OOM") {
        DkvError::Full
    } else {
        DkvError::Store(format!("Redis: {error}"))
    }
}

/// A key the store cannot take.
fn check_key(key: &[u8]) -> Result<(), DkvError> {
    if key.is_empty() || key.len() > crate::record::MAX_KEY_LEN as usize {
        return Err(DkvError::Invalid(format!(
            "key of {} bytes (1 to {})",
            key.len(),
            crate::record::MAX_KEY_LEN
        )));
    }
    Ok(())
}

/// A value's length must be 1 to [`MAX_VALUE_LEN`] bytes.
fn check_value_len(len: usize) -> Result<(), DkvError> {
    if len == 0 || len > MAX_VALUE_LEN {
        return Err(DkvError::Invalid(format!(
            "value of {len} bytes (1 to {MAX_VALUE_LEN})"
        )));
    }
    Ok(())
}

/// Each item's result: its failed check, or the next of `answers` (those of the
/// items that passed, in order).
fn merge<T>(
    checks: Vec<Result<(), DkvError>>,
    answers: Vec<Result<T, DkvError>>,
) -> Vec<Result<T, DkvError>> {
    let mut answers = answers.into_iter();
    checks
        .into_iter()
        .map(|check| match check {
            Ok(()) => answers
                .next()
                .unwrap_or_else(|| Err(DkvError::Store("no reply".into()))),
            Err(error) => Err(error),
        })
        .collect()
}

/// Sends the commands of the valid items, keeping each invalid item's error; `finish`
/// turns item `at`'s reply into its result. Commands go out in pipelines of about
/// [`PIPELINE_BYTES`] of arguments and expected replies (each command comes with its
/// weight), each built while the previous one is on its way: at most two in flight.
fn send_valid<T>(
    client: &RedisClient,
    checked: impl Iterator<Item = Result<(Cmd, usize), DkvError>>,
    mut finish: impl FnMut(usize, Value) -> Result<T, DkvError>,
) -> Vec<Result<T, DkvError>> {
    let mut results: Vec<Option<Result<T, DkvError>>> = Vec::new();
    let mut pending: Vec<(usize, Cmd)> = Vec::new();
    let mut bytes = 0usize;
    let mut in_flight: Option<(Vec<usize>, InFlight)> = None;
    let mut deliver = |(positions, sent): (Vec<usize>, InFlight), results: &mut Vec<Option<_>>| {
        for (at, reply) in positions.into_iter().zip(sent.wait()) {
            results[at] = Some(reply.and_then(|value| finish(at, value)));
        }
    };
    for (at, command) in checked.enumerate() {
        match command {
            Err(error) => results.push(Some(Err(error))),
            Ok((command, weight)) => {
                results.push(None);
                bytes = bytes.saturating_add(weight);
                pending.push((at, command));
                if bytes >= PIPELINE_BYTES {
                    let (positions, commands) = pending.drain(..).unzip();
                    let sent = (positions, client.send(commands));
                    if let Some(previous) = in_flight.replace(sent) {
                        deliver(previous, &mut results);
                    }
                    bytes = 0;
                }
            }
        }
    }
    if !pending.is_empty() {
        let (positions, commands) = pending.drain(..).unzip();
        if let Some(previous) = in_flight.replace((positions, client.send(commands))) {
            deliver(previous, &mut results);
        }
    }
    if let Some(last) = in_flight.take() {
        deliver(last, &mut results);
    }
    results
        .into_iter()
        .map(|result| result.unwrap_or_else(|| Err(DkvError::Store("no reply".into()))))
        .collect()
}

/// `<command> <key>` for each of `keys` (a bad key keeps its error).
fn on_each_key<'a>(
    command: &'a str,
    keys: &'a [&[u8]],
) -> impl Iterator<Item = Result<(Cmd, usize), DkvError>> + 'a {
    keys.iter().map(move |key| {
        check_key(key)?;
        let mut one = redis::cmd(command);
        one.arg(*key);
        Ok(weighed(one))
    })
}

fn unexpected(reply: &Value) -> DkvError {
    DkvError::Store(format!("unexpected Redis reply {reply:?}"))
}

impl DkvClient for RedisClient {
    fn describe(&self) -> String {
        let mode = match self.connection {
            Connection::Single(_) => "Redis",
            Connection::Cluster(_) => "Redis cluster",
        };
        format!("{mode} {}", self.shown)
    }

    fn batch_put(&self, items: &[(&[u8], &[u8])]) -> Vec<Result<(), DkvError>> {
        if self.direct.is_some() {
            let items: Vec<PutFrom<'_>> = items
                .iter()
                .map(|(key, value)| PutFrom {
                    key,
                    head: &[],
                    body: value,
                })
                .collect();
            return self.batch_put_from(&items);
        }
        let checked = items.iter().map(|(key, value)| {
            check_key(key)?;
            check_value_len(value.len())?;
            let mut set = redis::cmd("SET");
            set.arg(*key).arg(*value);
            Ok(weighed(set))
        });
        send_valid(self, checked, |_, reply| match reply {
            Value::Okay => Ok(()),
            other => Err(unexpected(&other)),
        })
    }

    fn batch_put_from(&self, items: &[PutFrom<'_>]) -> Vec<Result<(), DkvError>> {
        let Some(direct) = &self.direct else {
            return super::put_assembled(self, items);
        };
        let checks: Vec<Result<(), DkvError>> = items
            .iter()
            .map(|item| {
                check_key(item.key)?;
                check_value_len(item.head.len() + item.body.len())
            })
            .collect();
        let valid: Vec<PutFrom<'_>> = items
            .iter()
            .zip(&checks)
            .filter(|(_, check)| check.is_ok())
            .map(|(item, _)| *item)
            .collect();
        merge(checks, direct.put(&valid))
    }

    fn copies_values(&self) -> bool {
        self.direct.is_none()
    }

    fn batch_get(&self, items: &mut [GetInto<'_>]) -> Vec<Result<u64, DkvError>> {
        if let Some(direct) = &self.direct {
            let checks: Vec<Result<(), DkvError>> =
                items.iter().map(|item| check_key(item.key)).collect();
            let mut valid: Vec<GetInto<'_>> = items
                .iter_mut()
                .zip(&checks)
                .filter(|(_, check)| check.is_ok())
                .map(|(item, _)| GetInto::split(item.key, &mut *item.head, &mut *item.body))
                .collect();
            let answers = direct.get(&mut valid);
            return merge(checks, answers);
        }
        // Weighed by the reply expected, so large values come in pipelines of
        // about PIPELINE_BYTES as well.
        let checked: Vec<Result<(Cmd, usize), DkvError>> = items
            .iter()
            .map(|item| {
                check_key(item.key)?;
                let mut get = redis::cmd("GET");
                get.arg(item.key);
                let reply = usize::try_from(item.capacity()).unwrap_or(usize::MAX);
                Ok((get, item.key.len().saturating_add(reply)))
            })
            .collect();
        send_valid(self, checked.into_iter(), |at, reply| match reply {
            Value::BulkString(value) => items[at].fill(&value),
            Value::Nil => Err(DkvError::NotFound),
            other => Err(unexpected(&other)),
        })
    }

    fn batch_exists(&self, keys: &[&[u8]]) -> Vec<Result<bool, DkvError>> {
        send_valid(self, on_each_key("EXISTS", keys), |_, reply| match reply {
            Value::Int(count) => Ok(count > 0),
            other => Err(unexpected(&other)),
        })
    }

    fn batch_delete(&self, keys: &[&[u8]]) -> Vec<Result<(), DkvError>> {
        send_valid(self, on_each_key("UNLINK", keys), |_, reply| match reply {
            Value::Int(_) => Ok(()),
            other => Err(unexpected(&other)),
        })
    }

    fn scan(&self, prefix: &[u8], cursor: Option<u64>, page: u32) -> Result<ScanPage, DkvError> {
        let scan = self.connection.clone().scan(prefix.to_vec(), cursor, page);
        self.runtime
            .as_ref()
            .and_then(|runtime| run_on(runtime, scan))
            .ok_or_else(stopped)?
            .map_err(|e| store_error(&e))
    }

    fn capacity(&self) -> Option<u64> {
        self.capacity
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_are_weighed_by_their_arguments() {
        let mut set = redis::cmd("SET");
        set.arg("key").arg(vec![0u8; 1000]);
        assert_eq!(weighed(set).1, 3 + 3 + 1000);
    }

    #[test]
    fn a_ca_file_needs_tls_and_certificates() {
        let dir = std::env::temp_dir().join(format!("mooncake-ca-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let junk = dir.join("junk.pem");
        std::fs::write(&junk, "not a certificate").expect("write");
        let plain = RedisClient::open("redis://127.0.0.1:1/0", Some(&junk)).expect_err("plain");
        assert!(plain.to_string().contains("does not use TLS"), "{plain}");
        let bad = RedisClient::open("rediss://127.0.0.1:1/0", Some(&junk)).expect_err("junk");
        assert!(
            bad.to_string().starts_with(&format!("{CA_VARIABLE}=")),
            "{bad}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn an_unreachable_store_is_a_one_line_error_without_the_password() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("port");
        let error = RedisClient::open(&format!("redis://:hunter2@127.0.0.1:{port}/0"), None)
            .expect_err("nothing listens")
            .to_string();
        assert!(
            error.starts_with(&format!("{URL_VARIABLE}=redis://:***@127.0.0.1:{port}/0")),
            "{error}"
        );
        assert!(
            !error.contains("hunter2") && !error.contains('\n'),
            "{error}"
        );
    }
}
