//! Liveness of the real clients that own segments.
//!
//! A real client announces itself by mounting a segment and then heartbeats. One that
//! stays silent for `client_ttl` is declared dead and its segments are unmounted. A
//! heartbeat from a client the master does not know (the master restarted) is answered
//! with `NeedRemount`, and the client mounts its segments again. A client whose segment
//! name another instance mounted (a restart of that node, or a second node configured
//! with the same name) is answered with `Displaced`: it must not remount, and stops
//! contributing memory.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use mooncake_core::master_api::ClientStatus;
use parking_lot::Mutex;

/// Displaced clients remembered (the oldest are forgotten first).
pub const MAX_DISPLACED: usize = 1024;

/// Last heartbeat of every remote real client.
#[derive(Debug, Default)]
pub struct ClientTable {
    last_seen: Mutex<HashMap<u128, Instant>>,
    displaced: Mutex<VecDeque<u128>>,
}

impl ClientTable {
    /// Records that `client` is alive at `now`.
    pub fn touch(&self, client: u128, now: Instant) {
        self.last_seen.lock().insert(client, now);
    }

    /// Heartbeat: refreshes a known client, or asks an unknown one to remount.
    pub fn heartbeat(&self, client: u128, now: Instant) -> ClientStatus {
        match self.last_seen.lock().get_mut(&client) {
            Some(seen) => {
                *seen = now;
                ClientStatus::Ok
            }
            None if self.displaced.lock().contains(&client) => ClientStatus::Displaced,
            None => ClientStatus::NeedRemount,
        }
    }

    /// Forgets `client` because another instance took its segment name; its
    /// heartbeats are answered with `Displaced` from now on.
    pub fn displace(&self, client: u128) {
        self.last_seen.lock().remove(&client);
        let mut displaced = self.displaced.lock();
        if displaced.len() >= MAX_DISPLACED {
            displaced.pop_front();
        }
        displaced.push_back(client);
    }

    /// Forgets a client (clean shutdown).
    pub fn remove(&self, client: u128) {
        self.last_seen.lock().remove(&client);
    }

    /// Removes and returns the clients silent for longer than `ttl`.
    pub fn take_expired(&self, now: Instant, ttl: Duration) -> Vec<u128> {
        let mut last_seen = self.last_seen.lock();
        let expired: Vec<u128> = last_seen
            .iter()
            .filter(|(_, seen)| now.duration_since(**seen) > ttl)
            .map(|(id, _)| *id)
            .collect();
        for id in &expired {
            last_seen.remove(id);
        }
        expired
    }

    /// Number of live clients.
    pub fn count(&self) -> usize {
        self.last_seen.lock().len()
    }
}
