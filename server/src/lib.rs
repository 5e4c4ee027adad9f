//! # umdev-server
//!
//! A hardened vfio-user server: the wire protocol, client connections, and a daemon hosting
//! many device instances, each on its own UNIX socket.
//!
//! Devices are anything implementing [`umdev_mdev::VfioDevice`]; guest memory the client
//! maps goes into the instance's [`umdev_pinning::DmaSpace`]. Nothing a client sends can
//! crash the server, hang another instance or grow memory beyond the documented limits
//! ([`Limits`]): every message is framed and parsed with bounds checks before anything sized
//! by the client is allocated, every failure is answered with an errno, and a connection is
//! dropped only when its stream cannot be resynced.
//!
//! What it is not: a device model (see `umdev-mdev`) or a VMM-side client.

#![deny(unsafe_op_in_unsafe_fn)]
#![deny(missing_docs)]

pub mod client_fd;
mod connection;
pub mod daemon;
mod eventfd;
/// The server's internals, for the fuzz harnesses of `umdev-testkit` (feature `fuzzing`); not API.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod internals {
    pub use crate::connection::{serve, Disconnect, Served};
    pub use crate::link::{ClientDmaPort, Link};
    pub use crate::session::{Session, SessionEnd};
    pub use crate::socket::Receiver;
}
mod link;
mod session;
mod socket;
mod stats;
pub mod wire;

pub use connection::Disconnect;
pub use daemon::{Daemon, DaemonError, InstanceConfig, InstanceInfo};
pub use link::{CLIENT_DMA_CHUNK, CLIENT_DMA_TIMEOUT};
pub use stats::{ServerStats, StatsSnapshot};
pub use wire::Limits;
