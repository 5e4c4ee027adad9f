//! The message decoder and dispatcher fed arbitrary byte streams, with fds, against a real
//! `testdev` and a real DMA space: the harness of the `dispatch` fuzz target
//! (`fuzz/fuzz_targets/dispatch.rs`) and of its corpus replay.
//!
//! [`dispatch`] cuts its input into chunks ([`decode`](super::decode)), each as one socket
//! read would deliver it: bytes, and fds of a few kinds. Each chunk goes into a [`Framer`];
//! every whole message is dispatched through a real `Session` exactly as the connection
//! thread does, until the input ends or the framer reports a fatal error (as the real
//! connection, which then disconnects). The harness then tears down as a disconnect does.
//! Chunk flags are ignored.
//!
//! The harness plays the client: it reads everything the server sends on the other end of a
//! socket pair and answers the device's DMA_READ/DMA_WRITE requests (correctly, with an
//! error, or malformed, as the config byte's bits 0-1 say). After each message it waits for
//! the device's DMA worker to go idle, so a run is deterministic. It panics unless:
//!
//! - every request that wants a reply gets exactly one, in order, with its id and command;
//!   error replies are bare headers with the error flag and an errno; a VERSION reply is no
//!   longer than the request; a region-info reply fits the request's `argsz`; replies whose
//!   length the request fixes (REGION_READ, DMA_UNMAP, ...) have that length; only a
//!   region-info reply carries an fd; nothing but VERSION succeeds before VERSION, and
//!   VERSION succeeds once;
//! - everything the server sends frames cleanly, and it sends no command but DMA_READ and
//!   DMA_WRITE;
//! - the device goes idle within a bound, and has dropped its pins when detached (the
//!   teardown's unmap succeeds);
//! - no fd the input brought is still open after the teardown: the harness keeps a duplicate
//!   of each and looks for any other fd on the same open file (`kcmp`). The fuzz target also
//!   checks the process's fd count around each run ([`open_fds`](super::open_fds)).

use std::collections::VecDeque;
use std::io;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use umdev_devices::testdev;
use umdev_mdev::{DeviceContext, VfioDevice, VFIO_PCI_BAR0_REGION_INDEX};
use umdev_pinning::{DmaSpace, PAGE_SIZE};

use super::{
    check_dma_request, decode, dma_space, le, limits, message, qemu_version, testdev_capability, Chunk,
    FdKind, Replies, Stream, Tracker, CONFIG_LOCK, CONFIG_SMALL_LIMITS, CONFIG_VERSION, MAX_FDS,
};
use umdev_server::internals::Receiver;
use umdev_server::internals::{ClientDmaPort, Link};
use umdev_server::internals::{Session, SessionEnd};
use umdev_server::wire::framing::Framer;
use umdev_server::wire::{flags, Command, Header, HEADER_SIZE};
use umdev_server::ServerStats;

/// Config bits 0-1: how the harness answers the device's DMA_READ/DMA_WRITE requests.
pub const CONFIG_CLIENT_DMA: u8 = 3;
/// Client DMA answers: correct (data for reads, address and count echoed for writes).
pub const CLIENT_DMA_OK: u8 = 0;
/// Client DMA answers: an error reply (EFAULT).
pub const CLIENT_DMA_ERROR: u8 = 1;
/// Client DMA answers: a reply of the wrong length.
pub const CLIENT_DMA_SHORT: u8 = 2;
/// Client DMA answers: reads answered for the wrong address, writes with a bare header.
pub const CLIENT_DMA_ODD: u8 = 3;

/// Most messages one input dispatches.
pub const MAX_FRAMES: usize = 256;
/// How long the device may take to go idle after a message.
const SETTLE_LIMIT: Duration = Duration::from_secs(10);

/// Runs one input through a session (see the module documentation). Panics on any
/// violation.
pub fn dispatch(data: &[u8]) {
    let (config, chunks) = decode(data);
    let mut harness = Harness::new(config);
    let mut frames = 0;
    let mut fds_made = 0;
    let mut chunks: VecDeque<Chunk> = chunks.into();
    if config & CONFIG_VERSION != 0 {
        chunks.push_front(Chunk { bytes: qemu_version(0), ..Chunk::default() });
    }
    'input: for chunk in chunks {
        let kinds = &chunk.fds[..chunk.fds.len().min(MAX_FDS - fds_made)];
        fds_made += kinds.len();
        if chunk.bytes.is_empty() {
            // A read never delivers fds without bytes (0 bytes is end of stream).
            continue;
        }
        let fds = kinds.iter().map(|&k| harness.tracker.make(k)).collect();
        harness.framer.push(&chunk.bytes, fds);
        loop {
            if frames == MAX_FRAMES {
                break 'input;
            }
            match harness.framer.next_frame() {
                Err(_) => break 'input,
                Ok(None) => break,
                Ok(Some(frame)) => {
                    frames += 1;
                    harness.handle(frame);
                }
            }
        }
    }
    harness.finish();
}

struct Harness {
    framer: Framer,
    session: Session,
    device: Arc<dyn VfioDevice>,
    dma: DmaSpace,
    link: Arc<Link>,
    /// The client's end of the socket pair.
    peer: UnixStream,
    peer_framer: Framer,
    receiver: Receiver,
    /// Synthesizes the client's replies to DMA requests.
    reply_framer: Framer,
    replies: Replies,
    client_dma: u8,
    tracker: Tracker,
}

impl Harness {
    fn new(config: u8) -> Harness {
        let limits = limits(config);
        let dma = dma_space(config, &limits, Duration::from_millis(500));
        let device: Arc<dyn VfioDevice> = match testdev::create() {
            Ok(d) => Arc::new(d),
            Err(e) => panic!("creating a testdev: {e}"),
        };
        let (server, peer) = match UnixStream::pair() {
            Ok(pair) => pair,
            Err(e) => panic!("socketpair: {e}"),
        };
        // A reply that cannot be sent (the harness failed to drain) fails instead of hanging.
        if let Err(e) = server.set_write_timeout(Some(Duration::from_secs(5))) {
            panic!("socket timeout: {e}");
        }
        let stats = Arc::new(ServerStats::default());
        // As connection::serve: the link, the unmap notifier, the device attached.
        let link = Arc::new(Link::new(server, std::thread::current().id(), stats.clone()));
        let weak = Arc::downgrade(&device);
        dma.set_unmap_notifier(Some(Arc::new(move |iova, len| {
            if let Some(device) = weak.upgrade() {
                device.dma_unmap(iova, len);
            }
        })));
        device.attach(DeviceContext::new(dma.clone(), Arc::new(ClientDmaPort { link: link.clone() })));
        let session = Session::new(device.clone(), dma.clone(), limits.clone(), link.clone(), stats);
        Harness {
            framer: Framer::new(limits.max_version_size, limits.max_msg_fds as usize),
            session,
            device,
            dma,
            link,
            peer,
            peer_framer: Framer::new(4 << 20, 16),
            receiver: Receiver::new(),
            reply_framer: Framer::new(4 << 20, 16),
            replies: Replies::new(&limits),
            client_dma: config & CONFIG_CLIENT_DMA,
            tracker: Tracker::default(),
        }
    }

    /// Dispatches one message of the input, then waits for the device and checks the
    /// replies.
    fn handle(&mut self, frame: umdev_server::wire::framing::Frame) {
        let payload = self.framer.payload(&frame);
        self.replies.request(frame.header, payload);
        if let Err(SessionEnd::Send(e)) = self.session.handle(frame, payload) {
            panic!("a reply could not be sent to a client that reads everything: {e}");
        }
        if let Some(max) = self.session.take_new_max_size() {
            self.framer.set_max_size(max);
        }
        self.settle();
        if let Some(request) = self.replies.first_owed() {
            panic!("no reply to message {request:?}");
        }
    }

    /// Waits until the device's DMA worker is idle, serving its client DMA meanwhile.
    fn settle(&mut self) {
        let deadline = Instant::now() + SETTLE_LIMIT;
        loop {
            self.drain_peer();
            if !self.device_busy() {
                self.drain_peer();
                return;
            }
            assert!(Instant::now() < deadline, "the device did not go idle within {SETTLE_LIMIT:?}");
            std::thread::sleep(Duration::from_micros(20));
        }
    }

    fn device_busy(&self) -> bool {
        let mut status = [0u8; 4];
        match self.device.region_read(VFIO_PCI_BAR0_REGION_INDEX, testdev::regs::DMA_STATUS, &mut status) {
            Ok(()) => u32::from_le_bytes(status) == testdev::regs::STATUS_BUSY,
            Err(e) => panic!("reading DMA_STATUS: {e}"),
        }
    }

    /// Reads everything the server sent: checks replies, answers DMA requests.
    fn drain_peer(&mut self) {
        loop {
            match self.receiver.recv(&self.peer, &mut self.peer_framer, false) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("reading the server's messages: {e}"),
            }
        }
        loop {
            let frame = match self.peer_framer.next_frame() {
                Ok(Some(frame)) => frame,
                Ok(None) => break,
                Err(e) => panic!("the server sent an unframeable message: {e}"),
            };
            let header = frame.header;
            let payload = self.peer_framer.payload(&frame).to_vec();
            match header.message_type() {
                flags::TYPE_REPLY => {
                    self.replies.reply(&header, payload.len(), frame.fds.len() + frame.excess_fds);
                }
                flags::TYPE_COMMAND => self.answer_dma(&header, &payload),
                other => panic!("the server sent a message of type {other}: {header:?}"),
            }
            // The frame's fds (a region fd) close here.
        }
    }

    /// Answers the device's DMA_READ/DMA_WRITE as the input's config says.
    fn answer_dma(&mut self, request: &Header, payload: &[u8]) {
        let (is_read, addr, count) = check_dma_request(request, payload);
        let mut reply =
            Header { id: request.id, command: request.command, size: 0, flags: flags::TYPE_REPLY, error: 0 };
        let mut body = Vec::new();
        let echo = |body: &mut Vec<u8>, addr: u64| {
            body.extend_from_slice(&addr.to_le_bytes());
            body.extend_from_slice(&count.to_le_bytes());
        };
        match (self.client_dma, is_read) {
            (CLIENT_DMA_ERROR, _) => {
                reply.flags |= flags::ERROR;
                reply.error = libc::EFAULT as u32;
            }
            (CLIENT_DMA_SHORT, _) => body.extend_from_slice(&payload[..8]),
            (CLIENT_DMA_ODD, false) => {}
            (mode, true) => {
                echo(&mut body, if mode == CLIENT_DMA_ODD { addr ^ 1 } else { addr });
                body.extend((0..count).map(|i| (addr.wrapping_add(i) as u8) ^ 0xa5));
            }
            (_, false) => echo(&mut body, addr),
        }
        reply.size = (HEADER_SIZE + body.len()) as u32;
        let mut bytes = reply.encode().to_vec();
        bytes.extend_from_slice(&body);
        self.reply_framer.push(&bytes, Vec::new());
        match self.reply_framer.next_frame() {
            Ok(Some(frame)) => {
                let payload = self.reply_framer.payload(&frame);
                if let Err(SessionEnd::Send(e)) = self.session.handle(frame, payload) {
                    panic!("handling the client's DMA reply: {e}");
                }
            }
            other => panic!("framing the client's DMA reply: {other:?}"),
        }
    }

    /// Tears down as a disconnect does, then checks that every fd the input brought is
    /// closed.
    fn finish(self) {
        let Harness { framer, session, device, dma, link, peer, mut tracker, .. } = self;
        // fds of a message the input left incomplete.
        drop(framer);
        link.close();
        device.detach();
        dma.set_unmap_notifier(None);
        if let Err(e) = dma.unmap_all() {
            dma.abandon_all();
            panic!("the device kept pins after detach: {e}");
        }
        drop(session);
        tracker.check_closed("after detach and unmap");
        drop(device);
        drop(link);
        drop(peer);
    }
}

/// Hand-made seeds: realistic sessions and known hostile shapes, as `(name, input)`. The
/// corpus replay runs them besides the corpus files; `tests/fuzz_corpus.rs` can write them
/// into `fuzz/corpus/dispatch/`.
pub fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    use testdev::regs::*;
    use umdev_mdev::{VFIO_PCI_CONFIG_REGION_INDEX, VFIO_PCI_MSIX_IRQ_INDEX};
    use umdev_server::wire::request::UNMAP_FLAG_ALL;

    const BAR0: u32 = VFIO_PCI_BAR0_REGION_INDEX;
    const CONFIG: u32 = VFIO_PCI_CONFIG_REGION_INDEX;
    const RAM: u64 = 0x10_0000;
    const MSG_RAM: u64 = 0x20_0000;

    let mut seeds = Vec::new();

    // A QEMU-like session: realize, guest RAM as a memfd and a message-only region, MSI-X
    // on eventfds, DMA both ways through pins and through the client, posted writes,
    // WRITE_MULTI, unmap, reset.
    let msix = testdev_capability(0x11);
    let mut s = Stream::default();
    s.realize();
    s.map(RAM, 16 * PAGE_SIZE, 3, Some(FdKind::Memfd(16)));
    s.map(MSG_RAM, 16 * PAGE_SIZE, 3, None);
    s.set_irqs(VFIO_PCI_MSIX_IRQ_INDEX, 0x24, 0, 2, &[], vec![FdKind::Eventfd, FdKind::Eventfd]);
    s.write(CONFIG, msix + 2, &0x8000u16.to_le_bytes(), false);
    s.write(BAR0, 0x800, &0xfee0_0000u64.to_le_bytes(), false);
    s.write(BAR0, 0x808, &le(&[&0x4021u32.to_le_bytes(), &0u32.to_le_bytes()]), false);
    s.reg(SCRATCH, 0x1234_5678).read(BAR0, SCRATCH, 4).read(BAR0, ID, 8);
    s.dma(CMD_FILL, RAM + 0x800, 3 * 4096).dma(CMD_CHECKSUM, RAM, 16 * 4096);
    s.dma(CMD_FILL, MSG_RAM + 100, 70_000).dma(CMD_CHECKSUM, MSG_RAM, 8192);
    s.write(BAR0, IRQ_RAISE, &1u32.to_le_bytes(), true).read(BAR0, IRQ_COUNT, 4).read(BAR0, ISR, 4);
    let multi: Vec<u8> = [(SCRATCH, 1u32), (DMA_LEN, 16), (DMA_PATTERN, 3)]
        .iter()
        .flat_map(|&(off, v)| {
            le(&[&off.to_le_bytes(), &BAR0.to_le_bytes(), &4u32.to_le_bytes(), &v.to_le_bytes(), &[0; 4]])
        })
        .collect();
    s.cmd(Command::RegionWriteMulti, &le(&[&3u64.to_le_bytes(), &multi]));
    s.write(1, 4096, b"bar1 second page", false)
        .read(1, 4090, 32)
        .write(2, 0, &9u32.to_le_bytes(), false)
        .read(2, 0, 4);
    s.unmap(MSG_RAM, 16 * PAGE_SIZE, 0).unmap(RAM, 16 * PAGE_SIZE, 0);
    s.cmd(Command::DeviceReset, &[]);
    s.map(RAM, 4 * PAGE_SIZE, 1, Some(FdKind::Memfd(4))).dma(CMD_FILL, RAM, 100).dma(CMD_CHECKSUM, RAM, 100);
    s.unmap(0, 0, UNMAP_FLAG_ALL);
    seeds.push(("qemu-session", s.bytes(CLIENT_DMA_OK)));
    seeds.push(("qemu-session-split-7", s.resplit(CLIENT_DMA_OK, 7)));
    seeds.push(("qemu-session-client-dma-errors", s.bytes(CLIENT_DMA_ERROR)));
    seeds.push((
        "qemu-session-small-limits-lock",
        s.bytes(CLIENT_DMA_ODD | CONFIG_SMALL_LIMITS | CONFIG_LOCK),
    ));

    // QEMU's reset burst: an fd-less DMA_UNMAP and a DMA_MAP with its fd in one read.
    let mut s = Stream::default();
    s.version().map(RAM, 4 * PAGE_SIZE, 3, Some(FdKind::Memfd(4)));
    let mut burst = Stream::from_id(s.id);
    burst.unmap(RAM, 4 * PAGE_SIZE, 0).map(RAM, 8 * PAGE_SIZE, 3, Some(FdKind::Memfd(8)));
    s.id = burst.id;
    s.chunks.push(burst.glued());
    s.dma(CMD_FILL, RAM + 4 * 4096, 4096);
    seeds.push(("reset-burst", s.bytes(CLIENT_DMA_OK)));

    // Hostile shapes: fds where none belong, too many fds, fds that are not what they
    // should be, a mapping past the memfd's end, bad types and commands, a stray reply,
    // commands before VERSION and VERSION twice, then a header that ends the stream.
    let mut s = Stream::default();
    s.read(BAR0, 0, 4);
    s.version().version();
    s.push(
        Command::DeviceGetInfo,
        flags::TYPE_COMMAND,
        &le(&[&16u32.to_le_bytes(), &[0; 12]]),
        vec![FdKind::Pipe(false)],
    );
    s.set_irqs(VFIO_PCI_MSIX_IRQ_INDEX, 0x24, 0, 20, &[], vec![FdKind::Eventfd; 20]);
    s.set_irqs(0, 0x24, 0, 1, &[], vec![FdKind::Pipe(true)]);
    s.set_irqs(0, 0x24, 0, 1, &[], vec![FdKind::DevNull]);
    s.map(RAM, 8 * PAGE_SIZE, 3, Some(FdKind::Memfd(2)));
    s.map(RAM, PAGE_SIZE, 3, Some(FdKind::DevNull));
    s.map(RAM, PAGE_SIZE, 3, Some(FdKind::Eventfd));
    s.push(Command::DmaMap, flags::TYPE_COMMAND, &[0; 32], vec![FdKind::Memfd(1), FdKind::Memfd(1)]);
    s.push(Command::DeviceGetInfo, 7, &[0; 16], Vec::new());
    s.push(Command::DmaRead, flags::TYPE_COMMAND, &[0; 16], Vec::new());
    s.push(Command::DmaWrite, flags::TYPE_REPLY, &[0; 16], Vec::new());
    s.cmd(Command::DeviceFeature, &[0; 8]).cmd(Command::MigDataRead, &[0; 8]);
    s.chunks.push(Chunk {
        bytes: message(99, 99, flags::TYPE_COMMAND, &[1, 2, 3]),
        fds: vec![FdKind::Memfd(1)],
        flags: 0,
    });
    let mut fatal = message(100, Command::RegionWrite as u16, 0, &[]);
    fatal[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
    s.chunks.push(Chunk { bytes: fatal, fds: vec![FdKind::Eventfd], flags: 0 });
    seeds.push(("hostile", s.bytes(CLIENT_DMA_SHORT)));

    // INTx and MSI: eventfds, mask/unmask, raise, read ISR, de-assign.
    let msi = testdev_capability(0x05);
    let mut s = Stream::default();
    s.version();
    s.set_irqs(0, 0x24, 0, 1, &[], vec![FdKind::Eventfd]);
    s.set_irqs(0, 0x08 | 0x01, 0, 1, &[], Vec::new()).set_irqs(0, 0x10 | 0x01, 0, 1, &[], Vec::new());
    s.reg(IRQ_RAISE, 1).read(BAR0, ISR, 4).set_irqs(0, 0x22, 0, 1, &[1], Vec::new());
    s.set_irqs(1, 0x24, 0, 1, &[], vec![FdKind::Eventfd]).write(CONFIG, msi + 2, &1u16.to_le_bytes(), false);
    s.reg(IRQ_RAISE, 1).set_irqs(1, 0x24, 0, 0, &[], Vec::new()).set_irqs(0, 0x21, 0, 0, &[], Vec::new());
    s.cmd(Command::DeviceReset, &[]);
    seeds.push(("irqs", s.bytes(CLIENT_DMA_OK)));

    seeds
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_dispatch() {
        for (name, seed) in seeds() {
            eprintln!("seed {name}");
            dispatch(&seed);
        }
    }

    #[test]
    fn any_bytes_dispatch() {
        for len in 0..100 {
            let data: Vec<u8> = (0..len).map(|i| (i * 77 + len) as u8).collect();
            dispatch(&data);
        }
    }
}
