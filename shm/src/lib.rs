//! Shared memory between a dummy client and its real client.
//!
//! # Lifecycle
//!
//! * **Who creates**: the dummy creates every segment ([`SharedMemory::create`]): a memfd,
//!   sized once, sealed against shrinking and growing, mapped `MAP_SHARED`. The real client
//!   creates its own global segment the same way.
//! * **Who maps**: the dummy sends the memfd over its Unix socket with SCM_RIGHTS
//!   ([`fd_passing`]); the real client checks the seals and size and maps it
//!   ([`SharedMemory::map_received`]), then records `dummy range → real address` in the
//!   dummy's [`Registry`].
//! * **Who may write**: the dummy writes its own buffers before a put and reads them after
//!   a get; the real client writes into a dummy range only while serving a get that
//!   names it, and reads from one only while serving a put. Every range is bounds-checked
//!   ([`Registry::translate`]) before any byte moves.
//! * **When it is unmapped**: when the dummy's session ends (clean close, crash, kill -9:
//!   the kernel closes the socket), the real client drops the registry; a copy already in
//!   flight holds its mapping alive through an `Arc` until it finishes. The dummy keeps
//!   its own mappings until its client object is dropped (after `close()` a pointer the
//!   application still holds stays valid memory); the memory itself is freed when the
//!   last mapping and fd are gone.
//! * **If the real client dies**, the dummy keeps its memfds and registers them again
//!   with the next real client instance.
//!
//! Ordinary memory of a dummy (heap, numpy, pinned host memory) is never mapped: the
//! real client copies it across processes ([`cross_memory`]), with its own lifecycle
//! described there.

pub mod cross_memory;
mod fault_guard;
pub mod fd_passing;
mod parallel;
mod pool;
mod registry;
pub mod shared_memory;
mod sys;

pub use parallel::{map_items, on_this_thread};
pub use pool::PoolAllocator;
pub use registry::{Registry, TranslateError};
pub use shared_memory::{MemSlice, Outgoing, SharedMemory, ShmError, send_vectored};
