//! Upstream's HTTP metadata server (`mooncake_master --enable_http_metadata_server`):
//! an in-memory key-value store at `/metadata?key=K`.
//!
//! | request | answer |
//! |---|---|
//! | `GET ?key=K` | 200 with the stored bytes (`application/json`), or 404 `metadata not found` |
//! | `PUT ?key=K` + body | 200 `metadata updated`; 400 `Duplicate rpc_meta key not allowed` when a key containing `rpc_meta` exists already |
//! | `DELETE ?key=K` | 200 `metadata deleted`, or 404 `metadata not found` |
//! | no or empty `key` | 400 `Missing key parameter` |
//! | other methods or paths | 404 `404 Not Found` |
//!
//! Values are bounded by [`mooncake_core::http::MAX_BODY`], the store by [`MAX_KEYS`] keys.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use mooncake_core::http::{Request, Response, Router};

/// Most keys the store holds; a PUT of a new key beyond it gets 400.
pub const MAX_KEYS: usize = 1 << 20;

/// The in-memory store behind `/metadata`.
#[derive(Debug, Default)]
pub struct MetadataStore {
    values: Mutex<HashMap<String, Vec<u8>>>,
}

impl MetadataStore {
    /// Answers one request with upstream's status codes and bodies.
    pub fn handle(&self, request: &Request) -> Response {
        if request.path != "/metadata" {
            return Response::not_found();
        }
        let key = request.param("key").unwrap_or_default();
        if key.trim().is_empty() {
            return Response::new(400, None, "Missing key parameter");
        }
        match request.method.as_str() {
            "GET" => match self.values.lock().get(&key) {
                Some(value) => Response::new(200, Some("application/json"), value.clone()),
                None => Response::new(404, None, "metadata not found"),
            },
            "PUT" => self.put(key, request.body.clone()),
            "DELETE" => match self.values.lock().remove(&key) {
                Some(_) => Response::new(200, None, "metadata deleted"),
                None => Response::new(404, None, "metadata not found"),
            },
            _ => Response::not_found(),
        }
    }

    fn put(&self, key: String, value: Vec<u8>) -> Response {
        let mut values = self.values.lock();
        let exists = values.contains_key(&key);
        if key.contains("rpc_meta") && exists {
            return Response::new(400, None, "Duplicate rpc_meta key not allowed");
        }
        if !exists && values.len() >= MAX_KEYS {
            return Response::new(400, None, format!("metadata store full ({MAX_KEYS} keys)"));
        }
        values.insert(key, value);
        Response::new(200, None, "metadata updated")
    }

    /// A router serving this store.
    pub fn router(self: Arc<Self>) -> Router {
        Arc::new(move |request: Request| {
            let response = self.handle(&request);
            Box::pin(std::future::ready(Some(response)))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(store: &MetadataStore, method: &str, target: &str, body: &[u8]) -> (u16, Vec<u8>) {
        let (path, query) = target.split_once('?').unwrap_or((target, ""));
        let response = store.handle(&Request {
            method: method.into(),
            path: path.into(),
            query: query.into(),
            body: body.to_vec(),
        });
        (response.status, response.body)
    }

    #[test]
    fn upstream_semantics() {
        let store = MetadataStore::default();
        assert_eq!(
            call(&store, "GET", "/metadata?key=a", b""),
            (404, b"metadata not found".to_vec())
        );
        assert_eq!(call(&store, "PUT", "/metadata?key=a", b"v1").0, 200);
        assert_eq!(call(&store, "PUT", "/metadata?key=a", b"v2").0, 200);
        assert_eq!(
            call(&store, "GET", "/metadata?key=a", b""),
            (200, b"v2".to_vec())
        );
        assert_eq!(
            call(&store, "DELETE", "/metadata?key=a", b""),
            (200, b"metadata deleted".to_vec())
        );
        assert_eq!(call(&store, "DELETE", "/metadata?key=a", b"").0, 404);
        assert_eq!(
            call(&store, "GET", "/metadata", b""),
            (400, b"Missing key parameter".to_vec())
        );
        assert_eq!(call(&store, "POST", "/metadata?key=a", b"").0, 404);
        assert_eq!(call(&store, "GET", "/other?key=a", b"").0, 404);
        assert_eq!(
            call(&store, "PUT", "/metadata?key=mooncake/rpc_meta/x", b"r1").0,
            200
        );
        assert_eq!(
            call(&store, "PUT", "/metadata?key=mooncake/rpc_meta/x", b"r2").0,
            400
        );
        assert_eq!(
            call(&store, "GET", "/metadata?key=mooncake%2Frpc_meta%2Fx", b""),
            (200, b"r1".to_vec())
        );
    }
}
