//! A Redis or Valkey store, standalone or cluster, as a [`DkvClient`]
//! (`MOONCAKE_OFFLOAD_DKV_CLIENT=redis`).
//!
//! The client runs on its own one-thread tokio runtime, so the SSD tier calls it from
//! any thread. A batch goes to a single server as pipelines of about 1 MiB, one after
//! the other (Redis handles huge pipelines of large values badly); in a cluster each key goes
//! to its node, all requests in flight at once (the crate pipelines per node). The
//! connection to a single server is a `ConnectionManager`: after the server went away
//! calls fail fast and the next call reconnects, so offloading resumes by itself when
//! the store returns. Values are stored as they are given (the SSD tier's records carry
//! magic, lengths and a checksum); reads are copied once, from the reply into the
//! caller's buffers.

mod address;

use std::future::Future;
use std::path::Path;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{Cmd, RedisError, RedisResult, Value};

pub use address::{Address, CA_VARIABLE, SetupError, URL_VARIABLE, hide_password};

use super::{DkvClient, DkvError, GetInto, ScanPage};

/// How long connecting to a node may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// How long one request may wait for its reply.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(10);

/// Largest value Redis accepts with its default `proto-max-bulk-len`.
const MAX_VALUE_LEN: usize = 512 << 20;

/// Bytes of arguments per pipeline: Redis slows down sharply on pipelines of many
/// large values (a 256 MiB pipeline of 1 MiB SETs ran at a sixth of the rate of single
/// SETs), so a batch goes out as pipelines of about this size, one after the other,
/// each built only when the previous one is answered (little memory in flight).
const PIPELINE_BYTES: usize = 1 << 20;

/// Bits of a cluster scan cursor that hold the node's own cursor (the rest: which
/// node).
const NODE_CURSOR_BITS: u32 = 48;

/// A connected Redis or Valkey client.
pub struct RedisClient {
    /// Runs the connection's I/O; `None` only while dropping.
    runtime: Option<tokio::runtime::Runtime>,
    connection: Connection,
    shown: String,
    capacity: Option<u64>,
}

/// The connection: to one server, or to a cluster.
#[derive(Clone)]
enum Connection {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
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
        let certificates = ca_file.map(read_ca_file).transpose()?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("mooncake-redis")
            .enable_io()
            .enable_time()
            .build()?;
        let shown = address.shown.clone();
        let unreachable = |reason: String| SetupError::Unreachable {
            shown: shown.clone(),
            reason,
        };
        let (connection, capacity) = run_on(&runtime, connect(address, certificates))
            .ok_or_else(|| unreachable("the client's I/O thread stopped".into()))?
            .map_err(|e| unreachable(e.to_string()))?;
        Ok(RedisClient {
            runtime: Some(runtime),
            connection,
            shown,
            capacity,
        })
    }

    /// Sends `commands` and waits for one reply (or error) each.
    fn each(&self, commands: Vec<Cmd>) -> Vec<Result<Value, DkvError>> {
        let count = commands.len();
        let connection = self.connection.clone();
        let replies = self
            .runtime
            .as_ref()
            .and_then(|runtime| run_on(runtime, connection.each(commands)));
        match replies {
            Some(replies) if replies.len() == count => replies
                .into_iter()
                .map(|reply| reply.map_err(|e| store_error(&e)))
                .collect(),
            _ => vec![
                Err(DkvError::Store(
                    "the Redis client's I/O thread stopped".into()
                ));
                count
            ],
        }
    }

    /// Runs `work` on the connection and waits for it.
    fn run<T: Send + 'static>(
        &self,
        work: impl FnOnce(Connection) -> std::pin::Pin<Box<dyn Future<Output = RedisResult<T>> + Send>>,
    ) -> Result<T, DkvError> {
        let future = work(self.connection.clone());
        self.runtime
            .as_ref()
            .and_then(|runtime| run_on(runtime, future))
            .ok_or_else(|| DkvError::Store("the Redis client's I/O thread stopped".into()))?
            .map_err(|e| store_error(&e))
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

fn read_ca_file(path: &Path) -> Result<redis::TlsCertificates, SetupError> {
    let pem = std::fs::read(path).map_err(|e| SetupError::CaFile {
        path: path.display().to_string(),
        reason: e.to_string(),
    })?;
    Ok(redis::TlsCertificates {
        client_tls: None,
        root_cert: Some(pem),
    })
}

/// Connects: a list of nodes is a cluster; a single URL is a cluster when the node says
/// so. Returns the connection and the store's capacity.
async fn connect(
    address: Address,
    certificates: Option<redis::TlsCertificates>,
) -> RedisResult<(Connection, Option<u64>)> {
    if !address.is_node_list() {
        let first = address.nodes[0].clone();
        let client = match &certificates {
            Some(certs) => redis::Client::build_with_tls(first, certs.clone())?,
            None => redis::Client::open(first)?,
        };
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(CONNECT_TIMEOUT))
            .set_response_timeout(Some(RESPONSE_TIMEOUT))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_millis(500));
        let mut manager = ConnectionManager::new_with_config(client, config).await?;
        let info: String = redis::cmd("INFO")
            .arg("cluster")
            .query_async(&mut manager)
            .await?;
        if info_field(&info, "cluster_enabled") != Some(1) {
            let connection = Connection::Single(manager);
            let capacity = connection.capacity().await?;
            return Ok((connection, capacity));
        }
    }
    let mut builder = redis::cluster::ClusterClient::builder(address.nodes)
        .connection_timeout(CONNECT_TIMEOUT)
        .response_timeout(RESPONSE_TIMEOUT)
        .retries(2);
    if let Some(certs) = certificates {
        builder = builder.certs(certs);
    }
    let cluster = builder.build()?.get_async_connection().await?;
    let connection = Connection::Cluster(cluster);
    let capacity = connection.capacity().await?;
    Ok((connection, capacity))
}

/// The number after `name:` in an `INFO` reply.
fn info_field(info: &str, name: &str) -> Option<u64> {
    info.lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
        .and_then(|v| v.trim().parse().ok())
}

impl Connection {
    /// Sends `commands`, one reply (or error) each: pipelined on one server,
    /// concurrently in a cluster.
    async fn each(self, commands: Vec<Cmd>) -> Vec<RedisResult<Value>> {
        let count = commands.len();
        match self {
            Connection::Single(mut manager) => {
                let mut pipe = redis::pipe();
                pipe.ignore_errors();
                for command in commands {
                    pipe.add_command(command);
                }
                match pipe
                    .query_async::<Vec<RedisResult<Value>>>(&mut manager)
                    .await
                {
                    Ok(replies) => replies,
                    Err(error) => vec![Err(error); count],
                }
            }
            Connection::Cluster(cluster) => {
                futures::future::join_all(commands.into_iter().map(|command| {
                    let mut cluster = cluster.clone();
                    async move { command.query_async::<Value>(&mut cluster).await }
                }))
                .await
            }
        }
    }

    /// The primaries of a cluster as `(host, port)`, sorted; one entry (empty host)
    /// for a single server.
    async fn primaries(&self) -> RedisResult<Vec<(String, u16)>> {
        let Connection::Cluster(cluster) = self else {
            return Ok(vec![(String::new(), 0)]);
        };
        let slots: Value = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query_async(&mut cluster.clone())
            .await?;
        let mut primaries: Vec<(String, u16)> = match slots {
            Value::Array(ranges) => ranges.iter().filter_map(primary_of_range).collect(),
            _ => Vec::new(),
        };
        primaries.sort();
        primaries.dedup();
        Ok(primaries)
    }

    /// Runs `command` on the primary `node` (from [`primaries`](Self::primaries)).
    async fn on_node<T: redis::FromRedisValue>(
        &self,
        node: &(String, u16),
        command: Cmd,
    ) -> RedisResult<T> {
        match self {
            Connection::Single(manager) => command.query_async(&mut manager.clone()).await,
            Connection::Cluster(cluster) => {
                let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                    host: node.0.clone(),
                    port: node.1,
                });
                let reply = cluster.clone().route_command(command, routing).await?;
                T::from_redis_value(reply).map_err(RedisError::from)
            }
        }
    }

    /// Sum of the primaries' `maxmemory`; `None` when any has no limit.
    async fn capacity(&self) -> RedisResult<Option<u64>> {
        let mut total = 0u64;
        for node in self.primaries().await? {
            let mut info = redis::cmd("INFO");
            info.arg("memory");
            let text: String = self.on_node(&node, info).await?;
            match info_field(&text, "maxmemory") {
                Some(limit) if limit > 0 => total = total.saturating_add(limit),
                _ => return Ok(None),
            }
        }
        Ok(Some(total))
    }

    /// One page of keys matching `pattern` and their lengths, from `cursor`.
    async fn scan(self, pattern: Vec<u8>, cursor: u64, page: u32) -> RedisResult<ScanPage> {
        let primaries = self.primaries().await?;
        let node_index = usize::try_from(cursor >> NODE_CURSOR_BITS).unwrap_or(usize::MAX);
        let Some(node) = primaries.get(node_index) else {
            return Err(scan_error("the cluster changed during a scan"));
        };
        let mut scan = redis::cmd("SCAN");
        scan.arg(cursor & ((1 << NODE_CURSOR_BITS) - 1))
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(page.max(1));
        let (next, keys): (u64, Vec<Vec<u8>>) = self.on_node(node, scan).await?;
        if next >> NODE_CURSOR_BITS != 0 {
            return Err(scan_error("the store's scan cursor is too large"));
        }
        let lengths = self
            .clone()
            .each(keys.iter().map(|key| strlen(key)).collect())
            .await;
        let keys = keys
            .into_iter()
            .zip(lengths)
            .filter_map(|(key, length)| match length {
                Ok(Value::Int(n)) if n > 0 => Some((key, n.unsigned_abs())),
                // Deleted meanwhile, or not a string: not ours.
                _ => None,
            })
            .collect();
        let node_index = node_index as u64;
        let cursor = if next != 0 {
            Some((node_index << NODE_CURSOR_BITS) | next)
        } else if node_index + 1 < primaries.len() as u64 {
            Some((node_index + 1) << NODE_CURSOR_BITS)
        } else {
            None
        };
        Ok(ScanPage { keys, cursor })
    }
}

/// Bytes of `command`'s arguments.
fn argument_bytes(command: &Cmd) -> usize {
    command
        .args_iter()
        .map(|arg| match arg {
            redis::Arg::Simple(bytes) => bytes.len(),
            _ => 0,
        })
        .sum()
}

fn strlen(key: &[u8]) -> Cmd {
    let mut command = redis::cmd("STRLEN");
    command.arg(key);
    command
}

fn scan_error(reason: &'static str) -> RedisError {
    RedisError::from((redis::ErrorKind::Client, reason))
}

/// The primary's `(host, port)` of one `CLUSTER SLOTS` range.
fn primary_of_range(range: &Value) -> Option<(String, u16)> {
    let Value::Array(fields) = range else {
        return None;
    };
    let Some(Value::Array(node)) = fields.get(2) else {
        return None;
    };
    let host = match node.first()? {
        Value::BulkString(bytes) => String::from_utf8(bytes.clone()).ok()?,
        Value::SimpleString(text) => text.clone(),
        _ => return None,
    };
    let port = match node.get(1)? {
        Value::Int(port) => u16::try_from(*port).ok()?,
        _ => return None,
    };
    Some((host, port))
}

/// `prefix*` as a `SCAN MATCH` pattern, the prefix's glob characters escaped.
fn match_prefix(prefix: &[u8]) -> Vec<u8> {
    let mut pattern = Vec::with_capacity(prefix.len() + 1);
    for &byte in prefix {
        if matches!(byte, b'*' | b'?' | b'[' | b']' | b'\\') {
            pattern.push(b'\\');
        }
        pattern.push(byte);
    }
    pattern.push(b'*');
    pattern
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

/// Sends the commands of the valid items (built as they are sent, in pipelines of
/// about [`PIPELINE_BYTES`]), keeping each invalid item's error; `finish` turns item
/// `at`'s reply into its result.
fn send_valid<T>(
    client: &RedisClient,
    checked: impl Iterator<Item = Result<Cmd, DkvError>>,
    mut finish: impl FnMut(usize, Value) -> Result<T, DkvError>,
) -> Vec<Result<T, DkvError>> {
    let mut results: Vec<Option<Result<T, DkvError>>> = Vec::new();
    let mut pending: Vec<(usize, Cmd)> = Vec::new();
    let mut bytes = 0usize;
    let mut flush = |pending: &mut Vec<(usize, Cmd)>, results: &mut Vec<Option<_>>| {
        let (positions, commands): (Vec<usize>, Vec<Cmd>) = pending.drain(..).unzip();
        for (at, reply) in positions.into_iter().zip(client.each(commands)) {
            results[at] = Some(reply.and_then(|value| finish(at, value)));
        }
    };
    for (at, command) in checked.enumerate() {
        match command {
            Err(error) => results.push(Some(Err(error))),
            Ok(command) => {
                results.push(None);
                bytes += argument_bytes(&command);
                pending.push((at, command));
                if bytes >= PIPELINE_BYTES {
                    flush(&mut pending, &mut results);
                    bytes = 0;
                }
            }
        }
    }
    if !pending.is_empty() {
        flush(&mut pending, &mut results);
    }
    results
        .into_iter()
        .map(|result| result.unwrap_or_else(|| Err(DkvError::Store("no reply".into()))))
        .collect()
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
        let checked = items.iter().map(|(key, value)| {
            check_key(key)?;
            if value.is_empty() || value.len() > MAX_VALUE_LEN {
                return Err(DkvError::Invalid(format!(
                    "value of {} bytes (1 to {MAX_VALUE_LEN})",
                    value.len()
                )));
            }
            let mut set = redis::cmd("SET");
            set.arg(*key).arg(*value);
            Ok(set)
        });
        send_valid(self, checked, |_, reply| match reply {
            Value::Okay => Ok(()),
            other => Err(unexpected(&other)),
        })
    }

    fn batch_get(&self, items: &mut [GetInto<'_>]) -> Vec<Result<u64, DkvError>> {
        let checked: Vec<Result<Cmd, DkvError>> = items
            .iter()
            .map(|item| {
                check_key(item.key)?;
                let mut get = redis::cmd("GET");
                get.arg(item.key);
                Ok(get)
            })
            .collect();
        send_valid(self, checked.into_iter(), |at, reply| match reply {
            Value::BulkString(value) => items[at].fill(&value),
            Value::Nil => Err(DkvError::NotFound),
            other => Err(unexpected(&other)),
        })
    }

    fn batch_exists(&self, keys: &[&[u8]]) -> Vec<Result<bool, DkvError>> {
        let checked = keys.iter().map(|key| {
            check_key(key)?;
            let mut exists = redis::cmd("EXISTS");
            exists.arg(*key);
            Ok(exists)
        });
        send_valid(self, checked, |_, reply| match reply {
            Value::Int(count) => Ok(count > 0),
            other => Err(unexpected(&other)),
        })
    }

    fn batch_delete(&self, keys: &[&[u8]]) -> Vec<Result<(), DkvError>> {
        let checked = keys.iter().map(|key| {
            check_key(key)?;
            let mut unlink = redis::cmd("UNLINK");
            unlink.arg(*key);
            Ok(unlink)
        });
        send_valid(self, checked, |_, reply| match reply {
            Value::Int(_) => Ok(()),
            other => Err(unexpected(&other)),
        })
    }

    fn scan(&self, prefix: &[u8], cursor: Option<u64>, page: u32) -> Result<ScanPage, DkvError> {
        let pattern = match_prefix(prefix);
        let start = cursor.unwrap_or(0);
        self.run(move |connection| Box::pin(connection.scan(pattern, start, page)))
    }

    fn capacity(&self) -> Option<u64> {
        self.capacity
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scan_patterns_escape_glob_characters() {
        assert_eq!(match_prefix(b"ns/"), b"ns/*");
        assert_eq!(match_prefix(b"a*b?[c]\\"), b"a\\*b\\?\\[c\\]\\\\*");
    }

    #[test]
    fn argument_bytes_count_every_argument() {
        let mut set = redis::cmd("SET");
        set.arg("key").arg(vec![0u8; 1000]);
        assert_eq!(argument_bytes(&set), 3 + 3 + 1000);
    }

    #[test]
    fn info_fields_are_read() {
        let info = "# Memory\r\nused_memory:100\r\nmaxmemory:4096\r\nmaxmemory_human:4K\r\n";
        assert_eq!(info_field(info, "maxmemory"), Some(4096));
        assert_eq!(info_field(info, "cluster_enabled"), None);
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
