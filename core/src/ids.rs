//! Random identifiers: of real client instances, masters, dummy clients and tasks.

/// A random 128-bit id. Without an entropy source it falls back to the clock mixed with
/// the process id, still unique per process start.
pub fn random_id() -> u128 {
    let mut bytes = [0u8; 16];
    if getrandom::fill(&mut bytes).is_ok() {
        return u128::from_le_bytes(bytes);
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    nanos ^ (u128::from(std::process::id()) << 96)
}

#[cfg(test)]
mod tests {
    use super::random_id;

    #[test]
    fn ids_differ() {
        assert_ne!(random_id(), random_id());
    }
}
