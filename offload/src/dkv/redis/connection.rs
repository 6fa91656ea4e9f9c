//! The connection to a Redis or Valkey store: one server (a `ConnectionManager` that
//! reconnects) or a cluster (requests routed by slot), with the calls that differ
//! between the two: sending a batch, listing keys on every primary, and capacity.

use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{Cmd, RedisError, RedisResult, Value};

use super::Address;
use crate::dkv::ScanPage;

/// How long connecting to a node may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// How long one request may wait for its reply.
pub const RESPONSE_TIMEOUT: Duration = Duration::from_secs(10);

/// Scan cursor layout: the primaries' fingerprint, which primary, its own cursor.
const NODE_CURSOR_BITS: u32 = 40;
const NODE_INDEX_BITS: u32 = 8;
const FINGERPRINT_SHIFT: u32 = NODE_CURSOR_BITS + NODE_INDEX_BITS;

/// The connection: to one server, or to a cluster.
#[derive(Clone)]
pub enum Connection {
    /// One server.
    Single(ConnectionManager),
    /// A cluster.
    Cluster(ClusterConnection),
}

/// A cluster primary as `(host, port)`; `("", 0)` stands for the single server.
/// A primary's `(host, port)`.
pub type Primary = (String, u16);

/// Connects: a list of nodes is a cluster; a single URL is a cluster when the node says
/// so. Returns the connection and the store's capacity.
pub async fn connect(
    address: Address,
    certificates: Option<redis::TlsCertificates>,
) -> RedisResult<(Connection, Option<u64>)> {
    let connection = if address.is_node_list() {
        connect_cluster(address, certificates).await?
    } else {
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
        if info_field(&info, "cluster_enabled") == Some(1) {
            connect_cluster(address, certificates).await?
        } else {
            Connection::Single(manager)
        }
    };
    let capacity = connection.capacity().await?;
    Ok((connection, capacity))
}

async fn connect_cluster(
    address: Address,
    certificates: Option<redis::TlsCertificates>,
) -> RedisResult<Connection> {
    let mut builder = redis::cluster::ClusterClient::builder(address.nodes)
        .connection_timeout(CONNECT_TIMEOUT)
        .response_timeout(RESPONSE_TIMEOUT)
        .retries(2);
    if let Some(certs) = certificates {
        builder = builder.certs(certs);
    }
    Ok(Connection::Cluster(
        builder.build()?.get_async_connection().await?,
    ))
}

/// The number after `name:` in an `INFO` reply.
pub fn info_field(info: &str, name: &str) -> Option<u64> {
    info.lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
        .and_then(|v| v.trim().parse().ok())
}

impl Connection {
    /// Sends `commands`, one reply (or error) each: one pipeline on a single server,
    /// all in flight at once in a cluster (each to its slot's node).
    pub async fn each(self, commands: Vec<Cmd>) -> Vec<RedisResult<Value>> {
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

    /// The primaries, sorted.
    async fn primaries(&self) -> RedisResult<Vec<Primary>> {
        let Connection::Cluster(cluster) = self else {
            return Ok(vec![(String::new(), 0)]);
        };
        let slots: Value = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query_async(&mut cluster.clone())
            .await?;
        let mut primaries: Vec<Primary> = match slots {
            Value::Array(ranges) => ranges.iter().filter_map(primary_of_range).collect(),
            _ => Vec::new(),
        };
        primaries.sort();
        primaries.dedup();
        if primaries.is_empty() {
            return Err(client_error("the cluster lists no primaries"));
        }
        Ok(primaries)
    }

    /// Runs `command` on `node` (one of [`primaries`](Self::primaries)).
    async fn on_node<T: redis::FromRedisValue>(
        &self,
        node: &Primary,
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
    pub async fn capacity(&self) -> RedisResult<Option<u64>> {
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

    /// One page of keys starting with `prefix` and their lengths, from `cursor`
    /// (`None` to start). The cursor names a primary by its place in the sorted list
    /// and carries a fingerprint of that list: when the primaries change during a
    /// listing, the next page fails instead of resuming on the wrong node.
    pub async fn scan(
        self,
        prefix: Vec<u8>,
        cursor: Option<u64>,
        page: u32,
    ) -> RedisResult<ScanPage> {
        let primaries = self.primaries().await?;
        let fingerprint = fingerprint(&primaries);
        let cursor = cursor.unwrap_or(fingerprint << FINGERPRINT_SHIFT);
        let index = (cursor >> NODE_CURSOR_BITS) & ((1 << NODE_INDEX_BITS) - 1);
        let node = usize::try_from(index).ok().and_then(|i| primaries.get(i));
        let (Some(node), true) = (node, cursor >> FINGERPRINT_SHIFT == fingerprint) else {
            return Err(client_error(
                "the cluster's primaries changed during a scan",
            ));
        };
        let mut scan = redis::cmd("SCAN");
        scan.arg(cursor & ((1 << NODE_CURSOR_BITS) - 1))
            .arg("MATCH")
            .arg(match_prefix(&prefix))
            .arg("COUNT")
            .arg(page.max(1));
        let (next, keys): (u64, Vec<Vec<u8>>) = self.on_node(node, scan).await?;
        if next >> NODE_CURSOR_BITS != 0 {
            return Err(client_error("the store's scan cursor is too large"));
        }
        let keys = self.with_lengths(keys).await;
        let base = fingerprint << FINGERPRINT_SHIFT;
        let cursor = if next != 0 {
            Some(base | (index << NODE_CURSOR_BITS) | next)
        } else if index + 1 < primaries.len() as u64 {
            if index + 1 >= 1 << NODE_INDEX_BITS {
                return Err(client_error("more than 256 primaries"));
            }
            Some(base | ((index + 1) << NODE_CURSOR_BITS))
        } else {
            None
        };
        Ok(ScanPage { keys, cursor })
    }

    /// `keys` with their value lengths; keys deleted meanwhile, or not strings, left
    /// out.
    async fn with_lengths(self, keys: Vec<Vec<u8>>) -> Vec<(Vec<u8>, u64)> {
        let lengths = self
            .each(keys.iter().map(|key| strlen(key)).collect())
            .await;
        keys.into_iter()
            .zip(lengths)
            .filter_map(|(key, length)| match length {
                Ok(Value::Int(n)) if n > 0 => Some((key, n.unsigned_abs())),
                _ => None,
            })
            .collect()
    }
}

fn strlen(key: &[u8]) -> Cmd {
    let mut command = redis::cmd("STRLEN");
    command.arg(key);
    command
}

fn client_error(reason: &'static str) -> RedisError {
    RedisError::from((redis::ErrorKind::Client, reason))
}

/// 16 bits that change when the list of primaries does.
fn fingerprint(primaries: &[Primary]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for (host, port) in primaries {
        for byte in host.bytes().chain(port.to_le_bytes()).chain([0]) {
            hash = (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    (hash ^ (hash >> 16) ^ (hash >> 32) ^ (hash >> 48)) & 0xffff
}

/// The primary's `(host, port)` of one `CLUSTER SLOTS` range; `None` when the range
/// names none.
fn primary_of_range(range: &Value) -> Option<Primary> {
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
    // An empty host or port 0 names no node (and an empty host is the placeholder of
    // a single server).
    (!host.is_empty() && port != 0).then_some((host, port))
}

/// What this backend reads from one server reply (`bytes`: RESP, as a server sends it):
/// the primaries of a `CLUSTER SLOTS` reply, the `maxmemory` of an `INFO` reply, and the
/// cursor and key count of a `SCAN` reply, each `None` or empty when the reply is not
/// of that shape. For the fuzz target: no reply may make any of it panic.
#[cfg(any(test, feature = "test-utils"))]
pub fn read_reply(bytes: &[u8]) -> (Vec<Primary>, Option<u64>, Option<(u64, usize)>) {
    use redis::FromRedisValue;
    let Ok(value) = redis::parse_redis_value(bytes) else {
        return (Vec::new(), None, None);
    };
    let primaries = match &value {
        Value::Array(ranges) => ranges.iter().filter_map(primary_of_range).collect(),
        _ => Vec::new(),
    };
    let maxmemory = String::from_redis_value(value.clone())
        .ok()
        .and_then(|text| info_field(&text, "maxmemory"));
    let scan = <(u64, Vec<Vec<u8>>)>::from_redis_value(value)
        .ok()
        .map(|(next, keys)| (next, keys.len()));
    (primaries, maxmemory, scan)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scan_patterns_escape_glob_characters() {
        assert_eq!(match_prefix(b"ns/"), b"ns/*");
        assert_eq!(match_prefix(b"a*b?[c]\\"), b"a\\*b\\?\\[c\\]\\\\*");
    }

    #[test]
    fn replies_are_read_by_shape_and_garbage_reads_as_nothing() {
        let slots = b"*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:7000\r\n";
        let (primaries, maxmemory, scan) = read_reply(slots);
        assert_eq!(primaries, vec![("127.0.0.1".to_string(), 7000)]);
        assert_eq!((maxmemory, scan), (None, None));
        let text = "# Memory\r\nmaxmemory:4096\r\n";
        let info = format!("${}\r\n{text}\r\n", text.len());
        assert_eq!(read_reply(info.as_bytes()).1, Some(4096));
        let page = b"*2\r\n$2\r\n17\r\n*2\r\n$1\r\na\r\n$1\r\nb\r\n";
        assert_eq!(read_reply(page).2, Some((17, 2)));
        let nameless = b"*1\r\n*3\r\n_\r\n_\r\n*2\r\n+\r\n:0\r\n";
        assert!(
            read_reply(nameless).0.is_empty(),
            "an empty host and port 0 name no node"
        );
        for garbage in [
            &b""[..],
            b"*-5\r\n",
            b"*1\r\n*3\r\n:0\r\n",
            b"$99999999999\r\n",
            b"\xff\xfe",
        ] {
            let (primaries, _, _) = read_reply(garbage);
            assert!(primaries.is_empty());
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]

        #[test]
        fn no_reply_panics_the_redis_reply_readers(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..256),
        ) {
            for (host, port) in read_reply(&bytes).0 {
                proptest::prop_assert!(!host.is_empty() && port != 0);
                proptest::prop_assert!(bytes.windows(host.len()).any(|w| w == host.as_bytes()));
            }
        }

        #[test]
        fn mutated_cluster_slots_replies_read_or_fail_cleanly(
            at in 0usize..64,
            byte in proptest::prelude::any::<u8>(),
        ) {
            let mut slots = b"*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:7000\r\n".to_vec();
            let at = at % slots.len();
            slots[at] = byte;
            // The reply names one range: a damaged one reads as that range or none.
            proptest::prop_assert!(read_reply(&slots).0.len() <= 1);
        }
    }

    #[test]
    fn info_fields_are_read() {
        let info = "# Memory\r\nused_memory:100\r\nmaxmemory:4096\r\nmaxmemory_human:4K\r\n";
        assert_eq!(info_field(info, "maxmemory"), Some(4096));
        assert_eq!(info_field(info, "cluster_enabled"), None);
    }

    #[test]
    fn the_fingerprint_follows_the_primaries() {
        let a = vec![
            ("10.0.0.1".to_string(), 7000),
            ("10.0.0.2".to_string(), 7000),
        ];
        let mut b = a.clone();
        b[1].1 = 7001;
        assert_ne!(fingerprint(&a), fingerprint(&b));
        assert_eq!(fingerprint(&a), fingerprint(&a.clone()));
        assert!(fingerprint(&a) < 1 << 16);
    }
}
