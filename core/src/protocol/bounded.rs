//! Lists in requests from another process, decoded within a budget.
//!
//! A request's size on the wire is capped by the frame limit, but a list of tiny
//! elements (one-byte keys, empty ranges) grows many times larger once decoded. Every
//! list of a dummy's request is a [`Batch`] (arguments) or a field decoded with
//! [`vec`]; while a serving codec decodes a frame (see [`with_budget`]) their lengths
//! count against [`MAX_REQUEST_ELEMENTS`], checked before any element is decoded. A
//! frame over budget fails to decode ([`OverBudget`]): the connection is closed with a
//! log line naming the limit. The dummy splits its batches so that it never sends one.

use std::cell::Cell;
use std::fmt;
use std::marker::PhantomData;
use std::ops::Deref;

use serde::de::{Error as _, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};

/// Most list elements (keys, items, ranges, fragments; every list of a request counted
/// together) one request may carry.
pub const MAX_REQUEST_ELEMENTS: usize = 1 << 18;

thread_local! {
    /// Elements the frame being decoded on this thread may still carry; `None` when no
    /// budget applies (decoding outside a serving codec).
    static BUDGET: Cell<Option<usize>> = const { Cell::new(None) };
    /// Set when a list of the frame being decoded went over the budget.
    static EXCEEDED: Cell<bool> = const { Cell::new(false) };
}

/// A request carried more list elements than [`MAX_REQUEST_ELEMENTS`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "the request carries more than {limit} list elements (keys, items, ranges and fragments together); split it into smaller batches"
)]
pub struct OverBudget {
    /// The budget that applied.
    pub limit: usize,
}

/// Restores the budget that applied before [`with_budget`], on every exit path.
struct RestoreBudget(Option<usize>, bool);

impl Drop for RestoreBudget {
    fn drop(&mut self) {
        BUDGET.set(self.0);
        EXCEEDED.set(self.1);
    }
}

/// Runs `decode` with a budget of `elements` list elements for the bounded lists it
/// decodes on this thread; reports whether a list went over it (the decoder then
/// failed with a format error that does not say why).
pub fn with_budget<R>(elements: usize, decode: impl FnOnce() -> R) -> (R, Option<OverBudget>) {
    let _restore = RestoreBudget(BUDGET.replace(Some(elements)), EXCEEDED.replace(false));
    let value = decode();
    let over = EXCEEDED.get().then_some(OverBudget { limit: elements });
    (value, over)
}

/// Takes `count` elements from the budget.
fn spend(count: usize) -> Result<(), &'static str> {
    match BUDGET.get() {
        None => Ok(()),
        Some(left) if count <= left => {
            BUDGET.set(Some(left - count));
            Ok(())
        }
        Some(_) => {
            EXCEEDED.set(true);
            Err("too many list elements in one request")
        }
    }
}

/// Decodes a list whose length counts against the decoding budget (for
/// `#[serde(deserialize_with = "...")]` on request fields).
pub fn vec<'de, D, T>(deserializer: D) -> Result<Vec<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    deserializer.deserialize_seq(BoundedVisitor(PhantomData))
}

struct BoundedVisitor<T>(PhantomData<T>);

impl<'de, T: Deserialize<'de>> Visitor<'de> for BoundedVisitor<T> {
    type Value = Vec<T>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a list")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
        let announced = seq.size_hint();
        if let Some(len) = announced {
            spend(len).map_err(A::Error::custom)?;
        }
        // Never reserve more than a page's worth up front: the announced length is the
        // peer's word.
        let mut out = Vec::with_capacity(announced.unwrap_or(0).min(4096 / size_of::<T>().max(1)));
        while let Some(element) = seq.next_element()? {
            if announced.is_none() {
                spend(1).map_err(A::Error::custom)?;
            }
            out.push(element);
        }
        Ok(out)
    }
}

/// A list argument of a request; its length counts against the decoding budget.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct Batch<T>(pub Vec<T>);

impl<T> Batch<T> {
    /// The elements.
    pub fn into_inner(self) -> Vec<T> {
        self.0
    }
}

impl<T> From<Vec<T>> for Batch<T> {
    fn from(elements: Vec<T>) -> Self {
        Batch(elements)
    }
}

impl<T> Deref for Batch<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        &self.0
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Batch<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        vec(deserializer).map(Batch)
    }
}

/// The list elements an item of a request adds to the budget: itself and its own
/// lists. The dummy splits batches by it.
pub trait Elements {
    /// Elements counted for this item.
    fn elements(&self) -> usize;
}

impl Elements for String {
    fn elements(&self) -> usize {
        1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Serialize, Deserialize, Debug, PartialEq)]
    struct Request {
        keys: Batch<String>,
        #[serde(deserialize_with = "vec")]
        ranges: Vec<u64>,
    }

    fn request(keys: usize, ranges: usize) -> Vec<u8> {
        postcard::to_stdvec(&Request {
            keys: Batch(vec![String::new(); keys]),
            ranges: vec![0; ranges],
        })
        .expect("encodes")
    }

    #[test]
    fn lists_within_the_budget_decode() {
        let bytes = request(3, 4);
        let (decoded, over) = with_budget(7, || postcard::from_bytes::<Request>(&bytes));
        let decoded = decoded.expect("decodes");
        assert_eq!(over, None);
        assert_eq!(decoded.keys.len(), 3);
        assert_eq!(decoded.ranges.len(), 4);
    }

    #[test]
    fn every_list_of_a_request_counts_against_one_budget() {
        let bytes = request(3, 4);
        let (decoded, over) = with_budget(6, || postcard::from_bytes::<Request>(&bytes));
        assert!(decoded.is_err());
        assert_eq!(over, Some(OverBudget { limit: 6 }));
    }

    #[test]
    fn a_list_over_the_budget_is_refused_before_its_elements_are_decoded() {
        // One more one-byte key than the budget allows: small on the wire, many times
        // larger decoded.
        let keys = Batch(vec![String::new(); MAX_REQUEST_ELEMENTS + 1]);
        let bytes = postcard::to_stdvec(&keys).expect("encodes");
        let (decoded, over) = with_budget(MAX_REQUEST_ELEMENTS, || {
            postcard::from_bytes::<Batch<String>>(&bytes)
        });
        assert!(decoded.is_err());
        assert!(over.expect("over budget").to_string().contains("split"));
        // A length of a billion (a postcard varint) with nothing behind it fails too.
        let announced = [0x80, 0x94, 0xeb, 0xdc, 0x03];
        let (decoded, _) = with_budget(MAX_REQUEST_ELEMENTS, || {
            postcard::from_bytes::<Batch<String>>(&announced)
        });
        assert!(decoded.is_err());
    }

    #[test]
    fn without_a_budget_nothing_is_counted() {
        let bytes = request(10, 10);
        let decoded: Request = postcard::from_bytes(&bytes).expect("decodes");
        assert_eq!(decoded.keys.len(), 10);
    }

    #[test]
    fn the_budget_is_restored_after_decoding() {
        let bytes = request(2, 0);
        let _ = with_budget(0, || postcard::from_bytes::<Request>(&bytes));
        assert_eq!(BUDGET.get(), None);
        assert!(!EXCEEDED.get());
    }
}
