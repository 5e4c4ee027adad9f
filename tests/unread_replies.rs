//! A client that stays connected but stops reading the server's replies is disconnected once a
//! reply has waited the send timeout to be written (10 s by default; 200 ms here), and the
//! instance then serves the next client: the connection thread is never stuck on a client's
//! full socket.

mod common;

use std::time::Duration;

use common::raw::*;
use common::Harness;
use umdev_mdev::types::InstanceOptions;
use umdev_server::wire::{flags, Command};

#[test]
fn a_client_that_stops_reading_replies_is_disconnected_after_the_send_timeout() {
    let h =
        Harness::with("testdev", InstanceOptions::default(), |c| c.send_timeout = Duration::from_millis(200));
    let mut c = RawClient::connect(&h.socket).unwrap();
    c.negotiate().unwrap();
    // Should the server never let go, this client's own send fails after a minute (EAGAIN)
    // and the test with it.
    c.stream.set_write_timeout(Some(Duration::from_secs(60))).unwrap();
    // REGION_READs of 4 KiB of testdev's BAR1 (its message-only half), whose replies are never
    // read: they fill the socket's buffers, the server's send blocks, and the server gives up
    // on the client; its end closes, and the client's send fails.
    let read = [&le64(4096)[..], &le32(1), &le32(4096)].concat();
    let mut sent = 0u64;
    let err = loop {
        match c.send(Command::RegionRead as u16, flags::TYPE_COMMAND, &read, &[]) {
            Ok(_) => sent += 1,
            Err(e) => break e,
        }
    };
    assert!(
        matches!(err.kind(), std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset),
        "after {sent} requests: {err}"
    );
    h.wait_idle();
    let mut next = RawClient::connect(&h.socket).unwrap();
    next.negotiate().unwrap();
    let r = next.region_read(1, 4096, 4).unwrap();
    assert_eq!(r.errno(), 0, "the next client is served");
}
