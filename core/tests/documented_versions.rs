//! The protocol versions `docs/architecture.md` states are the ones the code speaks.

use mooncake_core::protocol::PROTOCOL_VERSION;
use mooncake_core::protocol::master_rpc::MASTER_PROTOCOL_VERSION;

/// The number written right after "`name` = " in the architecture document.
fn documented(name: &str) -> u32 {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/architecture.md");
    let text = std::fs::read_to_string(path).expect("docs/architecture.md");
    let needle = format!("`{name}` = ");
    let at = text
        .find(&needle)
        .unwrap_or_else(|| panic!("docs/architecture.md does not state {name}"));
    let digits: String = text[at + needle.len()..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits
        .parse()
        .unwrap_or_else(|_| panic!("{name} in docs/architecture.md is not a number"))
}

#[test]
fn the_architecture_document_states_the_protocol_versions_of_the_code() {
    assert_eq!(documented("PROTOCOL_VERSION"), PROTOCOL_VERSION);
    assert_eq!(
        documented("MASTER_PROTOCOL_VERSION"),
        MASTER_PROTOCOL_VERSION
    );
}
