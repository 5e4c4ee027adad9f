//! Support code of the `umdev` binary that tests and tools share: a guest-side driver for
//! the ccw device over vfio-user.

#![warn(missing_docs)]

pub mod ccw_guest;
