//! One client's session: request dispatch against the device and the DMA space.
//!
//! Requests are handled strictly in arrival order (a reply also vouches for every posted
//! write before it). Every failure is answered with the error flag and an errno, unless the
//! client asked for no reply; the stream stays in sync, since the framer consumed the whole
//! message before it got here.

use std::os::fd::AsFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use umdev_mdev::{DeviceError, IrqData, RegionFlags, RegionInfo, SetIrqs, VfioDevice};
use umdev_pinning::{DmaSpace, UnmapError};

use crate::link::Link;
use crate::stats::ServerStats;
use crate::wire::framing::Frame;
use crate::wire::reply::{self, error_header, ok_header};
use crate::wire::request::{parse, MultiWrite, Request, WireIrqData, UNMAP_FLAG_ALL};
use crate::wire::version::{negotiate, Negotiated};
use crate::wire::{flags, Header, Limits};

/// Why a session must end.
#[derive(Debug)]
pub enum SessionEnd {
    /// A reply could not be sent.
    Send(std::io::Error),
}

/// What a request came to: a reply payload (and maybe the region fd) or an errno.
type Outcome = Result<Reply, i32>;

enum Reply {
    /// Payload bytes.
    Payload(Vec<u8>),
    /// The reply built in the session's scratch buffer (a REGION_READ's fixed part and data, a
    /// REGION_WRITE's fixed part, a REGION_WRITE_MULTI's count): no allocation per message.
    Scratch,
    /// Region info with the region's fd.
    WithFd(Vec<u8>, Arc<std::os::fd::OwnedFd>),
}

/// Cached shape of a region (sizes and flags do not change during a session).
#[derive(Clone, Copy)]
struct RegionShape {
    size: u64,
    flags: RegionFlags,
}

/// One connection's protocol state: negotiation, the device's regions, every request dispatched.
pub struct Session {
    device: Arc<dyn VfioDevice>,
    dma: DmaSpace,
    limits: Limits,
    link: Arc<Link>,
    stats: Arc<ServerStats>,
    negotiated: Option<Negotiated>,
    /// Set when negotiation raised the message size limit; the connection applies it.
    new_max_size: Option<u32>,
    regions: Vec<Option<RegionShape>>,
    scratch: Vec<u8>,
    /// The client's process, where known ([`Session::set_client_pid`]).
    client_pid: Option<i32>,
}

impl Session {
    /// A session serving `device` with `dma` over `link`.
    pub fn new(
        device: Arc<dyn VfioDevice>,
        dma: DmaSpace,
        limits: Limits,
        link: Arc<Link>,
        stats: Arc<ServerStats>,
    ) -> Self {
        Session {
            device,
            dma,
            limits,
            link,
            stats,
            negotiated: None,
            new_max_size: None,
            regions: Vec::new(),
            scratch: Vec::new(),
            client_pid: None,
        }
    }

    /// The client's process (SO_PEERCRED, when it is in this pid namespace): a file it maps
    /// from a mount of its own mount namespace is known by its mount table.
    pub fn set_client_pid(&mut self, pid: Option<i32>) {
        self.client_pid = pid;
    }

    /// Logs a client's mistake within the instance's budget, across its connections (a
    /// client that reconnects gets no new one): at warning level for the first few, then
    /// at debug level (see [`umdev_mdev::log_budget`]).
    fn fault(&mut self, what: std::fmt::Arguments<'_>) {
        self.stats.faults.warn(what);
    }

    /// The message size limit negotiation raised, once.
    pub fn take_new_max_size(&mut self) -> Option<u32> {
        self.new_max_size.take()
    }

    /// Handles one message.
    pub fn handle(&mut self, frame: Frame, payload: &[u8]) -> Result<(), SessionEnd> {
        let header = frame.header;
        self.stats.bytes_in.fetch_add(u64::from(header.size), Ordering::Relaxed);
        match header.message_type() {
            flags::TYPE_REPLY => {
                if !self.link.deliver(header, payload) {
                    self.stats.stray_replies.fetch_add(1, Ordering::Relaxed);
                    self.fault(format_args!(
                        "reply {} (command {}) matches no request; dropped",
                        header.id, header.command
                    ));
                }
                return Ok(());
            }
            flags::TYPE_COMMAND => {}
            other => {
                self.stats.count_message(header.command);
                self.fault(format_args!("message {} has unknown type {other}", header.id));
                return self.answer(&header, Err(libc::EINVAL));
            }
        }
        self.stats.count_message(header.command);
        if frame.excess_fds > 0 {
            self.fault(format_args!(
                "message {} came with {} fds over the limit; all closed",
                header.id, frame.excess_fds
            ));
            return self.answer(&header, Err(libc::EINVAL));
        }
        if frame.fds_lost {
            // Not the client's doing, but loud only as often as its mistakes are: another
            // client may be filling the fd table to flood this one's log.
            self.fault(format_args!(
                "message {} (command {}) lost fds on the way in: this process's fd table is full (RLIMIT_NOFILE)",
                header.id, header.command
            ));
            return self.answer(&header, Err(libc::EMFILE));
        }
        let outcome = match parse(&header, payload, frame.fds, &self.limits) {
            Err(e) => {
                log::debug!("refused message {}: {e}", header.id);
                Err(e.errno)
            }
            // A device that panics handling a request fails that request (EIO); the
            // connection, the device and the server go on.
            Ok(request) => umdev_mdev::request::serve(
                format_args!("the device handling message {} (command {})", header.id, header.command),
                || self.dispatch(&header, request),
            )
            .unwrap_or(Err(libc::EIO)),
        };
        self.answer(&header, outcome)
    }

    fn answer(&mut self, header: &Header, outcome: Outcome) -> Result<(), SessionEnd> {
        if outcome.is_err() {
            self.stats.errors.fetch_add(1, Ordering::Relaxed);
        }
        if header.no_reply() {
            return Ok(());
        }
        let sent = match outcome {
            Err(errno) => self.link.send(&error_header(header, errno), &[], None),
            Ok(Reply::Payload(p)) => self.link.send(&ok_header(header, p.len()), &[&p], None),
            Ok(Reply::Scratch) => {
                self.link.send(&ok_header(header, self.scratch.len()), &[&self.scratch], None)
            }
            Ok(Reply::WithFd(p, fd)) => self.link.send(&ok_header(header, p.len()), &[&p], Some(fd.as_fd())),
        };
        sent.map_err(SessionEnd::Send)
    }

    fn dispatch(&mut self, header: &Header, request: Request<'_>) -> Outcome {
        if let Request::Version(client) = request {
            if self.negotiated.is_some() {
                self.fault(format_args!("VERSION sent twice"));
                return Err(libc::EINVAL);
            }
            self.device.client_version(&umdev_mdev::ClientHello {
                minor: client.minor,
                capabilities: client.capabilities,
            });
            let negotiated = negotiate(client, &self.limits);
            // A DMA_READ's reply carries its chunk: no larger than what this side accepts.
            self.link
                .set_max_dma_chunk(negotiated.client.max_data_xfer_size.min(self.limits.max_data_xfer_size));
            let payload = negotiated.reply.clone();
            self.negotiated = Some(negotiated);
            self.new_max_size = Some(self.limits.max_message_size());
            return Ok(Reply::Payload(payload));
        }
        let Some(negotiated) = &self.negotiated else {
            self.fault(format_args!("command {} before VERSION", header.command));
            return Err(libc::EINVAL);
        };
        match request {
            Request::Version(_) => unreachable!("handled above"),
            Request::DmaMap { iova, size, offset, prot, fd } => {
                let result = match &fd {
                    Some(fd) => self.dma.map_from(iova, size, fd.as_fd(), offset, prot, self.client_pid),
                    None => self.dma.map_message_only(iova, size, prot),
                };
                result.map(|()| Reply::Payload(Vec::new())).map_err(|e| {
                    log::debug!("DMA_MAP {iova:#x}+{size:#x}: {e}");
                    e.errno()
                })
            }
            Request::DmaUnmap { argsz, flags, iova, size } => {
                let (result, range) = if flags & UNMAP_FLAG_ALL != 0 {
                    (self.dma.unmap_all(), (0, u64::MAX))
                } else {
                    (self.dma.unmap(iova, size), (iova, size))
                };
                match result {
                    Ok(_) => {
                        self.device.dma_unmapped(range.0, range.1);
                        Ok(Reply::Payload(reply::dma_unmap(argsz, flags, iova, size)))
                    }
                    Err(e) => {
                        if matches!(e, UnmapError::Busy { .. }) {
                            log::warn!("DMA_UNMAP {iova:#x}+{size:#x}: {e}");
                        }
                        Err(e.errno())
                    }
                }
            }
            Request::DeviceGetInfo => Ok(Reply::Payload(reply::device_info(&self.device.device_info()))),
            Request::RegionInfo { index, argsz } => {
                let mut info = self.region_info(index).ok_or(libc::EINVAL)?;
                if negotiated.client.max_msg_fds == 0 {
                    // No fd can reach this client: nothing is mappable for it.
                    info.mmap = None;
                    info.flags.remove(RegionFlags::MMAP);
                }
                let (payload, send_fd) = reply::region_info(index, &info, argsz);
                match (send_fd, info.mmap) {
                    (true, Some(mmap)) => Ok(Reply::WithFd(payload, mmap.fd)),
                    _ => Ok(Reply::Payload(payload)),
                }
            }
            Request::RegionIoFds { index } => {
                self.region_info(index).ok_or(libc::EINVAL)?;
                Ok(Reply::Payload(reply::region_io_fds(index)))
            }
            Request::IrqInfo { index } => {
                let info = self.device.irq_info(index).ok_or(libc::EINVAL)?;
                Ok(Reply::Payload(reply::irq_info(index, &info)))
            }
            Request::SetIrqs { index, start, count, action, data } => {
                let data = match data {
                    WireIrqData::None => IrqData::None,
                    WireIrqData::Bool(b) => IrqData::Bool(b),
                    WireIrqData::Fds(fds) => {
                        match fds.into_iter().map(crate::eventfd::vet).collect::<Result<Vec<_>, _>>() {
                            Ok(fds) => IrqData::Eventfds(fds),
                            Err(e) => {
                                self.fault(format_args!("SET_IRQS: {e}"));
                                return Err(libc::EINVAL);
                            }
                        }
                    }
                };
                let request = SetIrqs { index, start, count, action, data };
                self.device.set_irqs(request).map(|()| Reply::Payload(Vec::new())).map_err(device_errno)
            }
            Request::RegionRead { region, offset, count } => {
                self.check_access(region, offset, count as usize, RegionFlags::READ)?;
                let head = reply::region_access(offset, region, count);
                self.scratch.clear();
                self.scratch.extend_from_slice(&head);
                self.scratch.resize(head.len() + count as usize, 0);
                self.device
                    .region_read(region, offset, &mut self.scratch[head.len()..])
                    .map_err(device_errno)?;
                Ok(Reply::Scratch)
            }
            Request::RegionWrite { region, offset, data } => {
                self.check_access(region, offset, data.len(), RegionFlags::WRITE)?;
                self.device.region_write(region, offset, data).map_err(device_errno)?;
                // In the scratch buffer: a doorbell (posted, or not) allocates nothing.
                self.scratch.clear();
                self.scratch.extend_from_slice(&reply::region_access(offset, region, data.len() as u32));
                Ok(Reply::Scratch)
            }
            Request::RegionWriteMulti(writes) => {
                if !negotiated.write_multiple {
                    self.fault(format_args!("REGION_WRITE_MULTI without write_multiple"));
                    return Err(libc::EINVAL);
                }
                self.write_multi(&writes)?;
                self.scratch.clear();
                self.scratch.extend_from_slice(&reply::region_write_multi(writes.len() as u64));
                Ok(Reply::Scratch)
            }
            Request::DeviceReset => {
                self.device.reset().map(|()| Reply::Payload(Vec::new())).map_err(device_errno)
            }
        }
    }

    fn write_multi(&mut self, writes: &[MultiWrite<'_>]) -> Result<(), i32> {
        for w in writes {
            self.check_access(w.region, w.offset, w.data.len(), RegionFlags::WRITE)?;
            self.device.region_write(w.region, w.offset, w.data).map_err(device_errno)?;
        }
        Ok(())
    }

    fn region_info(&self, index: u32) -> Option<RegionInfo> {
        if index >= self.device.device_info().num_regions {
            return None;
        }
        self.device.region_info(index)
    }

    /// Checks an access against the region's size and flags (cached per session).
    fn check_access(&mut self, region: u32, offset: u64, len: usize, need: RegionFlags) -> Result<(), i32> {
        let slot = region as usize;
        if slot >= self.regions.len() {
            // Devices are trusted, but a cache sized by them is still bounded.
            let n = self.device.device_info().num_regions.min(1024) as usize;
            if slot >= n {
                return Err(libc::EINVAL);
            }
            self.regions.resize(n, None);
        }
        let shape = match self.regions[slot] {
            Some(shape) => shape,
            None => {
                let info = self.device.region_info(region).ok_or(libc::EINVAL)?;
                let shape = RegionShape { size: info.size, flags: info.flags };
                self.regions[slot] = Some(shape);
                shape
            }
        };
        if !shape.flags.contains(need) {
            return Err(libc::EPERM);
        }
        match offset.checked_add(len as u64) {
            Some(end) if end <= shape.size => Ok(()),
            _ => Err(libc::EINVAL),
        }
    }
}

fn device_errno(e: DeviceError) -> i32 {
    log::debug!("device: {e}");
    e.errno()
}
