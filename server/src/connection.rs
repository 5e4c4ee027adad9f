//! Serving one client from connect to disconnect.
//!
//! The connection thread reads, frames and dispatches; when the client goes (at any point,
//! cleanly or not) it tears everything down in an order that cannot deadlock: fail the
//! device's pending client-DMA requests, detach (reset) the device so it drops its pins and
//! eventfds, then unmap every mapping.

use std::io;
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use umdev_mdev::{request, DeviceContext, VfioDevice};
use umdev_pinning::DmaSpace;

use crate::link::{ClientDmaPort, Link};
use crate::session::{Session, SessionEnd};
use crate::socket::Receiver;
use crate::stats::ServerStats;
use crate::wire::framing::{Framer, FramingError};
use crate::wire::Limits;

/// How a connection ended.
#[derive(Debug)]
pub enum Disconnect {
    /// The client closed the socket (or the server shut it down).
    Closed,
    /// A message header that cannot be followed: the stream cannot be resynced.
    Framing(FramingError),
    /// Reading or writing the socket failed.
    Io(io::Error),
}

impl std::fmt::Display for Disconnect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Disconnect::Closed => f.write_str("closed"),
            Disconnect::Framing(e) => write!(f, "protocol error: {e}"),
            Disconnect::Io(e) => write!(f, "I/O error: {e}"),
        }
    }
}

/// Everything a connection needs from its instance.
pub struct Served {
    /// The device.
    pub device: Arc<dyn VfioDevice>,
    /// The client's DMA space.
    pub dma: DmaSpace,
    /// Protocol limits.
    pub limits: Limits,
    /// The instance's counters.
    pub stats: Arc<ServerStats>,
    /// Longest busy-poll window after a reply (zero: off).
    pub busy_poll: Duration,
}

/// Serves `stream` until the client goes, then cleans up.
pub fn serve(stream: UnixStream, served: &Served) -> Disconnect {
    served.stats.connections.fetch_add(1, Ordering::Relaxed);
    let writer = match stream.try_clone() {
        Ok(w) => w,
        Err(e) => return Disconnect::Io(e),
    };
    let link = Arc::new(Link::new(writer, std::thread::current().id(), served.stats.clone()));
    let device = served.device.clone();
    let weak = Arc::downgrade(&device);
    // A device's own panics in these calls are caught (logged by `request::serve`): the
    // connection thread must always get to the cleanup below, or the instance would stay
    // taken by a client that is gone.
    served.dma.set_unmap_notifier(Some(Arc::new(move |iova, len| {
        if let Some(device) = weak.upgrade() {
            request::serve("the device's dma_unmap", || device.dma_unmap(iova, len));
        }
    })));
    let ctx = DeviceContext::new(served.dma.clone(), Arc::new(ClientDmaPort { link: link.clone() }));
    let end = match request::serve("the device's attach", || device.attach(ctx)) {
        Some(()) => run(&stream, served, link.clone()),
        None => Disconnect::Io(io::Error::other("the device's attach panicked")),
    };
    if let Disconnect::Framing(_) = end {
        served.stats.fatal.fetch_add(1, Ordering::Relaxed);
    }

    link.close();
    request::serve("the device's detach", || device.detach());
    served.dma.set_unmap_notifier(None);
    if let Err(e) = served.dma.unmap_all() {
        log::error!("the device kept pins after detach ({e}); abandoning its mappings");
        served.dma.abandon_all();
    }
    let _ = stream.shutdown(std::net::Shutdown::Both);
    end
}

/// Adaptive busy-polling: after a reply, spin on a non-blocking receive for a window before
/// sleeping in the kernel. A wake-up across CPUs costs tens of microseconds on a VM; a
/// client that answers within the window never pays it. The window doubles (up to the
/// configured maximum) while spins find data and halves when they do not, so an idle or slow
/// client soon costs no CPU.
struct BusyPoll {
    max: Duration,
    window: Duration,
}

impl BusyPoll {
    const MIN: Duration = Duration::from_micros(2);

    fn new(max: Duration) -> Self {
        BusyPoll { max, window: max }
    }

    /// Spins for the current window; `Some` with what the receive returned if data came.
    fn spin(
        &mut self,
        receiver: &mut Receiver,
        stream: &UnixStream,
        framer: &mut Framer,
    ) -> Option<io::Result<usize>> {
        if self.max.is_zero() || self.window < Self::MIN {
            // Backed off: try again with a small window next time, so a client that wakes up
            // gets polling back.
            self.window = (self.window * 2).max(Self::MIN).min(self.max);
            return None;
        }
        let deadline = Instant::now() + self.window;
        loop {
            match receiver.recv(stream, framer, false) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                other => {
                    self.window = (self.window * 2).min(self.max);
                    return Some(other);
                }
            }
            if Instant::now() >= deadline {
                self.window /= 2;
                return None;
            }
            std::hint::spin_loop();
        }
    }
}

fn run(stream: &UnixStream, served: &Served, link: Arc<Link>) -> Disconnect {
    let limits = &served.limits;
    let mut framer = Framer::new(limits.max_version_size, limits.max_msg_fds as usize);
    let mut receiver = Receiver::new();
    let mut busy = BusyPoll::new(served.busy_poll);
    // The client waits on this thread as on a device's workers: its slice is chosen alike.
    let mut slice = umdev_mdev::sched::SliceChoice::for_this_thread();
    let mut session =
        Session::new(served.device.clone(), served.dma.clone(), limits.clone(), link, served.stats.clone());
    session.set_client_pid(crate::daemon::peer_pid(stream));
    loop {
        match framer.next_frame() {
            Err(e) => return Disconnect::Framing(e),
            Ok(Some(frame)) => {
                let payload = framer.payload(&frame);
                // The payload is borrowed from the framer only for the call.
                let result = session.handle(frame, payload);
                if let Err(SessionEnd::Send(e)) = result {
                    return Disconnect::Io(e);
                }
                if let Some(max) = session.take_new_max_size() {
                    framer.set_max_size(max);
                }
            }
            Ok(None) => match busy.spin(&mut receiver, stream, &mut framer).unwrap_or_else(|| {
                let got = receiver.recv(stream, &mut framer, true);
                slice.woke();
                got
            }) {
                Ok(0) => return Disconnect::Closed,
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::ConnectionReset => return Disconnect::Closed,
                Err(e) => return Disconnect::Io(e),
            },
        }
    }
}
