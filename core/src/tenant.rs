//! Tenants: several users of one cluster with separate key spaces.
//!
//! A real client serves one tenant (`--tenant_id`, default `default`). Its keys are
//! stored at the master as `<tenant><TENANT_SEPARATOR><key>`, except for the default
//! tenant, whose keys are stored as they are (so a cluster without tenants stores
//! exactly the user's keys). Keys may therefore not contain the separator (`U+001F`,
//! the ASCII unit separator): [`validate_key`](crate::types::validate_key) refuses them.
//! `remove_all` and `remove_by_regex` only see the caller's tenant, and regular
//! expressions match the key as the user wrote it.

use std::borrow::Cow;

use crate::error::ErrorCode;
pub use crate::types::TENANT_SEPARATOR;
use crate::types::validate_key;

/// The tenant of a real client started without `--tenant_id`.
pub const DEFAULT_TENANT: &str = "default";

/// Longest tenant name.
pub const MAX_TENANT_LEN: usize = 64;

/// One tenant's view of the master's key space.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tenant {
    name: String,
    /// `<name><separator>`, empty for the default tenant.
    prefix: String,
}

impl Default for Tenant {
    fn default() -> Self {
        Tenant {
            name: DEFAULT_TENANT.to_string(),
            prefix: String::new(),
        }
    }
}

impl Tenant {
    /// The tenant called `name`: 1 to 64 ASCII letters, digits, `_`, `-` or `.`.
    pub fn new(name: &str) -> Result<Self, String> {
        if name == DEFAULT_TENANT {
            return Ok(Tenant::default());
        }
        if !is_valid_name(name) {
            return Err(format!(
                "tenant {name:?}: use 1 to {MAX_TENANT_LEN} ASCII letters, digits, '_', '-' or '.'"
            ));
        }
        Ok(Tenant {
            name: name.to_string(),
            prefix: format!("{name}{TENANT_SEPARATOR}"),
        })
    }

    /// The tenant's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// True for the default tenant (keys stored unchanged).
    pub fn is_default(&self) -> bool {
        self.prefix.is_empty()
    }

    /// The master's name for the tenant's `key`. A key containing the separator is
    /// turned into one the master refuses (`INVALID_KEY`), so no tenant can name
    /// another tenant's keys.
    pub fn scope<'a>(&self, key: &'a str) -> Cow<'a, str> {
        if key.contains(TENANT_SEPARATOR) {
            Cow::Owned(format!("{TENANT_SEPARATOR}{key}"))
        } else if self.is_default() {
            Cow::Borrowed(key)
        } else {
            Cow::Owned(format!("{}{key}", self.prefix))
        }
    }

    /// [`scope`](Self::scope) for a list of keys.
    pub fn scope_all(&self, keys: Vec<String>) -> Vec<String> {
        if self.is_default() && !keys.iter().any(|k| k.contains(TENANT_SEPARATOR)) {
            keys
        } else {
            keys.iter().map(|k| self.scope(k).into_owned()).collect()
        }
    }

    /// The tenant's key for a master key, or `None` when it belongs to another tenant.
    pub fn unscope<'a>(&self, stored: &'a str) -> Option<&'a str> {
        if self.is_default() {
            (!stored.contains(TENANT_SEPARATOR)).then_some(stored)
        } else {
            stored.strip_prefix(self.prefix.as_str())
        }
    }
}

fn is_valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_TENANT_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
}

/// Checks a key as the master stores it: a user key (see [`validate_key`]), optionally
/// scoped by a valid non-default tenant name.
pub fn validate_stored_key(stored: &str, max_len: usize) -> Result<(), ErrorCode> {
    let key = match stored.split_once(TENANT_SEPARATOR) {
        Some((tenant, key)) if tenant != DEFAULT_TENANT && is_valid_name(tenant) => key,
        Some(_) => return Err(ErrorCode::INVALID_KEY),
        None => stored,
    };
    validate_key(key, max_len)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_are_disjoint() {
        let default = Tenant::default();
        let acme = Tenant::new("acme").expect("valid");
        let other = Tenant::new("acme2").expect("valid");
        assert_eq!(default.scope("k"), "k");
        assert_eq!(acme.scope("k"), "acme\u{1f}k");
        assert_eq!(acme.unscope("acme\u{1f}k"), Some("k"));
        assert_eq!(default.unscope("acme\u{1f}k"), None);
        assert_eq!(acme.unscope("k"), None);
        assert_eq!(other.unscope(&acme.scope("k")), None);
        assert_eq!(Tenant::new("default"), Ok(Tenant::default()));
        // Naming another tenant's key is impossible.
        assert_eq!(
            validate_stored_key(&default.scope("acme\u{1f}k"), 100),
            Err(ErrorCode::INVALID_KEY)
        );
    }

    #[test]
    fn names_are_validated() {
        for bad in ["", "a b", "a\u{1f}", "ü", &"x".repeat(65)] {
            assert!(Tenant::new(bad).is_err(), "{bad:?}");
        }
        assert!(Tenant::new("team-1.prod_a").is_ok());
    }

    #[test]
    fn stored_keys() {
        let acme = Tenant::new("acme").expect("valid");
        assert_eq!(validate_stored_key(&acme.scope("k"), 10), Ok(()));
        assert_eq!(validate_stored_key("k", 10), Ok(()));
        for bad in [
            "acme\u{1f}",
            "\u{1f}k",
            "default\u{1f}k",
            "a b\u{1f}k",
            "acme\u{1f}k\u{1f}",
        ] {
            assert_eq!(
                validate_stored_key(bad, 10),
                Err(ErrorCode::INVALID_KEY),
                "{bad:?}"
            );
        }
    }
}
