//! Direct connections for the bulk calls to a single Redis or Valkey server reached
//! over plain TCP: `SET` of a batch's records and `GET` into the reader's buffers.
//!
//! A value goes out from where the caller has it, with gathered writes (the command's
//! framing from a small buffer, the record's header and the object's bytes from the
//! caller's memory), and a reply is read straight into the destination; the general
//! client copies a value several times on the way out and once on the way in. A large
//! batch is spread over several connections (one per two CPU cores, up to
//! [`MAX_CONNECTIONS`]), one thread each, by bytes ([`BYTES_PER_CONNECTION`] at least
//! per connection), each connection sending its whole share as one pipeline before
//! reading the replies.
//!
//! The connections are blocking sockets kept in a small pool (at most
//! [`MAX_CONNECTIONS`] idle); each waits at most [`RESPONSE_TIMEOUT`] for a read or a
//! write. A connection that failed, timed out, or got a reply of the wrong shape is
//! closed, never reused; the next call opens a new one (after `AUTH` and `SELECT` as
//! the URL asks). Every length a reply announces is checked against
//! [`MAX_VALUE_LEN`](super::MAX_VALUE_LEN) before anything is read, and reply lines
//! are at most [`MAX_LINE`] bytes.

use std::io::{BufRead, BufReader, Read};
use std::net::TcpStream;

use parking_lot::Mutex;

use super::connection::{CONNECT_TIMEOUT, RESPONSE_TIMEOUT};
use crate::dkv::{DkvError, GetInto, PutFrom};
use crate::io::{Gathered, MAX_GATHER};

/// Most connections one batch uses at once, and most kept open between calls.
pub const MAX_CONNECTIONS: usize = 4;

/// Bytes of values each connection of a batch carries at least: smaller batches use
/// fewer connections.
pub const BYTES_PER_CONNECTION: usize = 8 << 20;

/// Bytes per gathered write to the socket.
const SEND_WINDOW: usize = 4 << 20;

/// Longest reply line accepted (a status, an error, a length).
pub const MAX_LINE: usize = 4096;

/// Bytes of the read buffer of a connection.
const READ_BUFFER: usize = 64 << 10;

/// Where and how to connect.
#[derive(Debug, Clone)]
pub struct Target {
    /// Host name or address.
    pub host: String,
    /// TCP port.
    pub port: u16,
    /// `AUTH` user name, when the URL names one.
    pub username: Option<String>,
    /// `AUTH` password, when the URL gives one.
    pub password: Option<String>,
    /// Database number (`SELECT` when not 0).
    pub db: i64,
}

/// The pool of direct connections to one server.
#[derive(Debug)]
pub struct DirectPool {
    target: Target,
    idle: Mutex<Vec<Connection>>,
}

/// One open connection.
#[derive(Debug)]
struct Connection {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

/// Why a connection cannot be used any further.
type Broken = std::io::Error;

impl DirectPool {
    /// A pool for `target`; connects lazily.
    pub fn new(target: Target) -> Self {
        DirectPool {
            target,
            idle: Mutex::new(Vec::new()),
        }
    }

    /// A connection: an idle one, or a new one.
    fn take(&self) -> Result<Connection, DkvError> {
        if let Some(connection) = self.idle.lock().pop() {
            return Ok(connection);
        }
        Connection::open(&self.target).map_err(|e| {
            DkvError::Store(format!(
                "Redis {}:{}: cannot connect: {e}",
                self.target.host, self.target.port
            ))
        })
    }

    /// Keeps a healthy connection for the next call.
    fn give_back(&self, connection: Connection) {
        let mut idle = self.idle.lock();
        if idle.len() < MAX_CONNECTIONS {
            idle.push(connection);
        }
    }

    /// `SET` of every item (its value: `head` then `body`); one result per item.
    pub fn put(&self, items: &[PutFrom<'_>]) -> Vec<Result<(), DkvError>> {
        let weights: Vec<usize> = items.iter().map(|i| i.head.len() + i.body.len()).collect();
        let groups = split(&weights);
        let mut results = Vec::with_capacity(items.len());
        if groups.len() <= 1 {
            results.extend(self.on_one_connection(items, |c, items| c.put(items)));
            return results;
        }
        std::thread::scope(|scope| {
            let running: Vec<_> = groups
                .iter()
                .map(|range| {
                    let part = &items[range.clone()];
                    scope.spawn(move || self.on_one_connection(part, |c, items| c.put(items)))
                })
                .collect();
            for (handle, range) in running.into_iter().zip(&groups) {
                match handle.join() {
                    Ok(part) => results.extend(part),
                    Err(_) => results.extend(range.clone().map(|_| Err(thread_failed()))),
                }
            }
        });
        results
    }

    /// `GET` of every item into its destination; one result per item: the value's
    /// length.
    pub fn get(&self, items: &mut [GetInto<'_>]) -> Vec<Result<u64, DkvError>> {
        let weights: Vec<usize> = items
            .iter()
            .map(|i| usize::try_from(i.capacity()).unwrap_or(usize::MAX))
            .collect();
        let groups = split(&weights);
        if groups.len() <= 1 {
            return self.on_one_connection(items, |c, items| c.get(items));
        }
        let mut rest = items;
        let mut parts = Vec::with_capacity(groups.len());
        for range in &groups {
            let (part, tail) = rest.split_at_mut(range.len());
            parts.push(part);
            rest = tail;
        }
        std::thread::scope(|scope| {
            let running: Vec<_> = parts
                .into_iter()
                .map(|part| {
                    let count = part.len();
                    let handle =
                        scope.spawn(move || self.on_one_connection(part, |c, items| c.get(items)));
                    (handle, count)
                })
                .collect();
            let mut results = Vec::new();
            for (handle, count) in running {
                match handle.join() {
                    Ok(part) => results.extend(part),
                    Err(_) => results.extend((0..count).map(|_| Err(thread_failed()))),
                }
            }
            results
        })
    }

    /// Runs `call` on one connection for `items`: every item gets a result; a broken
    /// connection fails the items it did not answer and is closed.
    fn on_one_connection<I: Items, T>(
        &self,
        items: I,
        call: impl FnOnce(&mut Connection, I) -> (Vec<Result<T, DkvError>>, Option<Broken>),
    ) -> Vec<Result<T, DkvError>> {
        let count = items.count();
        let mut connection = match self.take() {
            Ok(connection) => connection,
            Err(error) => return (0..count).map(|_| Err(error.clone())).collect(),
        };
        let (mut results, broken) = call(&mut connection, items);
        match broken {
            None => self.give_back(connection),
            Some(error) => {
                let failed = DkvError::Store(format!("Redis connection failed: {error}"));
                results.resize_with(count, || Err(failed.clone()));
            }
        }
        results
    }
}

/// What [`DirectPool::on_one_connection`] needs of a call's items.
trait Items {
    fn count(&self) -> usize;
}

impl Items for &[PutFrom<'_>] {
    fn count(&self) -> usize {
        self.len()
    }
}

impl Items for &mut [GetInto<'_>] {
    fn count(&self) -> usize {
        self.len()
    }
}

fn thread_failed() -> DkvError {
    DkvError::Store("a Redis connection thread failed".into())
}

/// Connections one batch uses at most: one per two CPU cores of this machine (the
/// sending threads need cores, and a server on the same machine more), at most
/// [`MAX_CONNECTIONS`].
fn connections_per_batch() -> usize {
    // Asking for the cores reads the cgroup's files: once per process.
    static CONNECTIONS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CONNECTIONS.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
        (cores / 2).clamp(1, MAX_CONNECTIONS)
    })
}

/// Splits items weighing `weights` into consecutive groups of at least
/// [`BYTES_PER_CONNECTION`] bytes (the last may be lighter), at most
/// [`connections_per_batch`] of them, about equally heavy.
fn split(weights: &[usize]) -> Vec<std::ops::Range<usize>> {
    split_into(weights, connections_per_batch())
}

/// [`split`] into at most `most` groups.
fn split_into(weights: &[usize], most: usize) -> Vec<std::ops::Range<usize>> {
    let total: usize = weights.iter().fold(0, |a, w| a.saturating_add(*w));
    let groups = (total / BYTES_PER_CONNECTION).clamp(1, most.max(1));
    let share = total.div_ceil(groups).max(1);
    let mut ranges = Vec::with_capacity(groups);
    let (mut start, mut bytes) = (0, 0usize);
    for (at, weight) in weights.iter().enumerate() {
        bytes = bytes.saturating_add(*weight);
        if bytes >= share && ranges.len() + 1 < groups {
            ranges.push(start..at + 1);
            (start, bytes) = (at + 1, 0);
        }
    }
    if start < weights.len() {
        ranges.push(start..weights.len());
    }
    ranges
}

impl Connection {
    fn open(target: &Target) -> std::io::Result<Self> {
        use std::net::ToSocketAddrs;
        let mut last = std::io::Error::other("the host name resolves to no address");
        for address in (target.host.as_str(), target.port).to_socket_addrs()? {
            match TcpStream::connect_timeout(&address, CONNECT_TIMEOUT) {
                Ok(stream) => return Self::start(stream, target),
                Err(error) => last = error,
            }
        }
        Err(last)
    }

    fn start(stream: TcpStream, target: &Target) -> std::io::Result<Self> {
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(RESPONSE_TIMEOUT))?;
        stream.set_write_timeout(Some(RESPONSE_TIMEOUT))?;
        let mut connection = Connection {
            reader: BufReader::with_capacity(READ_BUFFER, stream.try_clone()?),
            writer: stream,
        };
        if let Some(password) = &target.password {
            let mut args: Vec<&[u8]> = vec![b"AUTH"];
            args.extend(target.username.as_deref().map(str::as_bytes));
            args.push(password.as_bytes());
            connection.expect_ok(&args, "AUTH")?;
        }
        if target.db != 0 {
            let db = target.db.to_string();
            connection.expect_ok(&[b"SELECT", db.as_bytes()], "SELECT")?;
        }
        Ok(connection)
    }

    /// Sends one command and expects `+OK`.
    fn expect_ok(&mut self, args: &[&[u8]], what: &str) -> std::io::Result<()> {
        let mut window = Gathered::new(0);
        push_command(&mut window, args, None);
        window.write_to(&mut self.writer)?;
        match read_status(&mut self.reader)? {
            Ok(()) => Ok(()),
            Err(error) => Err(std::io::Error::other(format!("{what}: {error}"))),
        }
    }

    /// Sends a `SET` per item as one pipeline, then reads the replies.
    fn put(&mut self, items: &[PutFrom<'_>]) -> (Vec<Result<(), DkvError>>, Option<Broken>) {
        if let Err(error) = self.send_sets(items) {
            return (Vec::new(), Some(error));
        }
        let mut results = Vec::with_capacity(items.len());
        for _ in 0..items.len() {
            match read_status(&mut self.reader) {
                Ok(result) => results.push(result),
                Err(error) => return (results, Some(error)),
            }
        }
        (results, None)
    }

    fn send_sets(&mut self, items: &[PutFrom<'_>]) -> std::io::Result<()> {
        let mut window = Gathered::new(0);
        for item in items {
            let len = item.head.len() + item.body.len();
            push_command(&mut window, &[b"SET", item.key], Some(len));
            window.push(item.head);
            window.push(item.body);
            window.push_copy(b"\r\n");
            if window.len() >= SEND_WINDOW || window.pieces() + 8 > MAX_GATHER {
                std::mem::replace(&mut window, Gathered::new(0)).write_to(&mut self.writer)?;
            }
        }
        if !window.is_empty() {
            window.write_to(&mut self.writer)?;
        }
        Ok(())
    }

    /// Sends a `GET` per item as one pipeline, then reads each reply into its item.
    fn get(&mut self, items: &mut [GetInto<'_>]) -> (Vec<Result<u64, DkvError>>, Option<Broken>) {
        let mut window = Gathered::new(0);
        for item in items.iter() {
            push_command(&mut window, &[b"GET", item.key], None);
        }
        if let Err(error) = window.write_to(&mut self.writer) {
            return (Vec::new(), Some(error));
        }
        let mut results = Vec::with_capacity(items.len());
        for item in items.iter_mut() {
            match read_value_into(&mut self.reader, item) {
                Ok(result) => results.push(result),
                Err(error) => return (results, Some(error)),
            }
        }
        (results, None)
    }
}

/// Appends a RESP command of `args`; with `value_len`, one more argument of that
/// length is announced, whose bytes the caller appends (followed by `\r\n`).
fn push_command(window: &mut Gathered<'_>, args: &[&[u8]], value_len: Option<usize>) {
    let count = args.len() + usize::from(value_len.is_some());
    window.push_copy(format!("*{count}\r\n").as_bytes());
    for arg in args {
        window.push_copy(format!("${}\r\n", arg.len()).as_bytes());
        window.push_copy(arg);
        window.push_copy(b"\r\n");
    }
    if let Some(len) = value_len {
        window.push_copy(format!("${len}\r\n").as_bytes());
    }
}

/// A protocol error: the connection is not used again.
fn malformed(what: impl std::fmt::Display) -> Broken {
    std::io::Error::new(
        std::io::ErrorKind::InvalidData,
        format!("Redis reply: {what}"),
    )
}

/// Reads one reply line without its `\r\n` (at most [`MAX_LINE`] bytes).
fn read_line(reader: &mut impl BufRead) -> std::io::Result<Vec<u8>> {
    let mut line = Vec::new();
    let read = reader
        .by_ref()
        .take(MAX_LINE as u64 + 2)
        .read_until(b'\n', &mut line)?;
    if read == 0 {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    match line.strip_suffix(b"\r\n") {
        Some(body) => Ok(body.to_vec()),
        None => Err(malformed("a line longer than the limit, or cut short")),
    }
}

/// The error a `-` reply line names.
fn error_reply(line: &[u8]) -> DkvError {
    let text = String::from_utf8_lossy(line);
    if text.starts_with("OOM") {
        DkvError::Full
    } else {
        DkvError::Store(format!("Redis: {text}"))
    }
}

/// Reads a status reply: `+OK` is `Ok(Ok(()))`, an error reply `Ok(Err(..))`;
/// anything else breaks the connection.
fn read_status(reader: &mut impl BufRead) -> std::io::Result<Result<(), DkvError>> {
    let line = read_line(reader)?;
    match line.split_first() {
        Some((b'+', b"OK")) => Ok(Ok(())),
        Some((b'-', error)) => Ok(Err(error_reply(error))),
        _ => Err(malformed(format!(
            "expected +OK, got {:?}",
            String::from_utf8_lossy(&line)
        ))),
    }
}

/// Reads a `GET` reply into `item`: the value's length, `NotFound` for nil,
/// `TooSmall` (the value read and dropped) when it does not fit; a reply of another
/// shape breaks the connection.
fn read_value_into(
    reader: &mut impl BufRead,
    item: &mut GetInto<'_>,
) -> std::io::Result<Result<u64, DkvError>> {
    let line = read_line(reader)?;
    let len = match line.split_first() {
        Some((b'$', b"-1")) => return Ok(Err(DkvError::NotFound)),
        Some((b'-', error)) => return Ok(Err(error_reply(error))),
        Some((b'$', digits)) => std::str::from_utf8(digits)
            .ok()
            .and_then(|d| d.parse::<u64>().ok())
            .filter(|len| *len <= super::MAX_VALUE_LEN as u64)
            .ok_or_else(|| malformed("a value length that is not a number up to the limit"))?,
        _ => {
            return Err(malformed(format!(
                "expected a value, got {:?}",
                String::from_utf8_lossy(&line)
            )));
        }
    };
    let result = if len > item.capacity() {
        std::io::copy(&mut reader.by_ref().take(len), &mut std::io::sink())?;
        Err(DkvError::TooSmall {
            need: len,
            have: item.capacity(),
        })
    } else {
        let len_usize = usize::try_from(len).map_err(|_| malformed("a value too large"))?;
        let in_head = len_usize.min(item.head.len());
        reader.read_exact(&mut item.head[..in_head])?;
        reader.read_exact(&mut item.body[..len_usize - in_head])?;
        Ok(len)
    };
    let mut end = [0u8; 2];
    reader.read_exact(&mut end)?;
    if &end != b"\r\n" {
        return Err(malformed("a value not followed by \\r\\n"));
    }
    Ok(result)
}

/// Reads `bytes` as the replies to a pipeline of `GET`s into destinations of
/// `capacity` bytes, then as status replies, as a connection does; for the fuzz target
/// (no reply may panic the reader or write past a destination). Returns the results
/// read before the first broken reply.
#[cfg(any(test, feature = "test-utils"))]
pub fn read_replies(bytes: &[u8], capacity: usize) -> (Vec<Result<u64, DkvError>>, usize) {
    let mut reader = BufReader::with_capacity(64, bytes);
    let mut values = Vec::new();
    let mut head = vec![0u8; capacity.min(8)];
    let mut body = vec![0u8; capacity.saturating_sub(8)];
    loop {
        let mut item = GetInto::split(b"k", &mut head, &mut body);
        match read_value_into(&mut reader, &mut item) {
            Ok(result) => values.push(result),
            Err(_) => break,
        }
    }
    let mut reader = BufReader::with_capacity(64, bytes);
    let mut statuses = 0;
    while read_status(&mut reader).is_ok() {
        statuses += 1;
    }
    (values, statuses)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_split_by_bytes_into_a_few_groups() {
        assert_eq!(split_into(&[], 4), Vec::<std::ops::Range<usize>>::new());
        assert_eq!(split_into(&[100; 10], 4), vec![0..10]);
        let mib = 1 << 20;
        // 256 MiB in 1 MiB values: four groups of 64.
        let groups = split_into(&vec![mib; 256], 4);
        assert_eq!(groups, vec![0..64, 64..128, 128..192, 192..256]);
        // 16 MiB: two groups; one when one connection is all there is.
        assert_eq!(split_into(&[mib; 16], 4), vec![0..8, 8..16]);
        assert_eq!(split_into(&[mib; 16], 1), vec![0..16]);
        assert!((1..=MAX_CONNECTIONS).contains(&split(&vec![mib; 256]).len()));
    }

    #[test]
    fn replies_are_read_into_the_destination_or_refused() {
        let bytes =
            b"$5\r\nhello\r\n$-1\r\n$9\r\n123456789\r\n-OOM no room\r\n$3\r\nabc\r\n+OK\r\n";
        let mut reader = BufReader::new(&bytes[..]);
        let read = |reader: &mut BufReader<&[u8]>| {
            let (mut head, mut body) = ([0u8; 2], [0u8; 4]);
            let mut item = GetInto::split(b"k", &mut head, &mut body);
            let result = read_value_into(reader, &mut item).expect("well formed");
            (result, [&head[..], &body[..]].concat())
        };
        assert_eq!(read(&mut reader), (Ok(5), b"hello\0".to_vec()));
        assert_eq!(read(&mut reader).0, Err(DkvError::NotFound));
        assert_eq!(
            read(&mut reader).0,
            Err(DkvError::TooSmall { need: 9, have: 6 })
        );
        assert_eq!(read(&mut reader).0, Err(DkvError::Full));
        assert_eq!(read(&mut reader).0, Ok(3), "the connection stays usable");
        let (mut head, mut body) = ([0u8; 2], [0u8; 4]);
        let mut item = GetInto::split(b"k", &mut head, &mut body);
        assert!(
            read_value_into(&mut reader, &mut item).is_err(),
            "+OK is no value"
        );
    }

    #[test]
    fn malformed_replies_break_the_connection() {
        for bytes in [
            &b"$abc\r\n"[..],
            b"$99999999999999\r\n",
            b"$3\r\nabcXY",
            b"$3\r\nab",
            b":1\r\n",
            b"$-2\r\n",
        ] {
            let mut head = [0u8; 0];
            let mut body = [0u8; 16];
            let mut item = GetInto::split(b"k", &mut head, &mut body);
            assert!(
                read_value_into(&mut BufReader::new(bytes), &mut item).is_err(),
                "{:?}",
                String::from_utf8_lossy(bytes)
            );
        }
        let long = [b'+'; MAX_LINE + 10];
        assert!(read_status(&mut BufReader::new(&long[..])).is_err());
        assert!(matches!(
            read_status(&mut BufReader::new(&b"-ERR wrong\r\n"[..])),
            Ok(Err(DkvError::Store(_)))
        ));
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]

        #[test]
        fn no_reply_panics_the_direct_reader(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..256),
            capacity in 0usize..64,
        ) {
            let (values, _) = read_replies(&bytes, capacity);
            for value in values.into_iter().flatten() {
                proptest::prop_assert!(value <= capacity as u64);
            }
        }
    }
}
