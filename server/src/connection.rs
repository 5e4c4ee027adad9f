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

use umdev_mdev::{DeviceContext, VfioDevice};
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
pub(crate) struct Served {
    pub(crate) device: Arc<dyn VfioDevice>,
    pub(crate) dma: DmaSpace,
    pub(crate) limits: Limits,
    pub(crate) stats: Arc<ServerStats>,
}

/// Serves `stream` until the client goes, then cleans up.
pub(crate) fn serve(stream: UnixStream, served: &Served) -> Disconnect {
    served.stats.connections.fetch_add(1, Ordering::Relaxed);
    let writer = match stream.try_clone() {
        Ok(w) => w,
        Err(e) => return Disconnect::Io(e),
    };
    let link = Arc::new(Link::new(writer, std::thread::current().id(), served.stats.clone()));
    let device = served.device.clone();
    let weak = Arc::downgrade(&device);
    served.dma.set_unmap_notifier(Some(Arc::new(move |iova, len| {
        if let Some(device) = weak.upgrade() {
            device.dma_unmap(iova, len);
        }
    })));
    device.attach(DeviceContext { dma: served.dma.clone(), client_dma: Arc::new(ClientDmaPort { link: link.clone() }) });

    let end = run(&stream, served, link.clone());
    if let Disconnect::Framing(_) = end {
        served.stats.fatal.fetch_add(1, Ordering::Relaxed);
    }

    link.close();
    device.detach();
    served.dma.set_unmap_notifier(None);
    if let Err(e) = served.dma.unmap_all() {
        log::error!("the device kept pins after detach ({e}); abandoning its mappings");
        served.dma.abandon_all();
    }
    let _ = stream.shutdown(std::net::Shutdown::Both);
    end
}

fn run(stream: &UnixStream, served: &Served, link: Arc<Link>) -> Disconnect {
    let limits = &served.limits;
    let mut framer = Framer::new(limits.max_version_size, limits.max_msg_fds as usize);
    let mut receiver = Receiver::new();
    let mut session =
        Session::new(served.device.clone(), served.dma.clone(), limits.clone(), link, served.stats.clone());
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
            Ok(None) => match receiver.recv(stream, &mut framer) {
                Ok(0) => return Disconnect::Closed,
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::ConnectionReset => return Disconnect::Closed,
                Err(e) => return Disconnect::Io(e),
            },
        }
    }
}
