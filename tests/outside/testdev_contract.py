#!/usr/bin/env python3
"""testdev_contract.py: a contract test of `umdev run --type testdev`, from the outside.

What it is
    An independent vfio-user client (Python 3, standard library only), written from umdev's
    documentation alone: README.md, docs/vfio-user.md and docs/testdev.md, plus the public
    vfio-user specification (QEMU's docs/interop/vfio-user.rst) for message layouts. It reads
    none of the server's code. It starts its own `umdev run --type testdev` servers (and one
    `umdev daemon`), drives them over their UNIX sockets like a VMM would, and checks about
    620 documented behaviours. Each check cites the doc file and section it pins (section
    names, not line numbers), e.g. "testdev.md § Interrupt: MSI-X" or
    "vfio-user.md § Commands: DMA_UNMAP"; "a + b" cites both.

What it checks (one section of this file per doc area)
    vfio-user.md  Connections (sockets, one client per instance, handover, disconnect and
                  detach), Framing (impossible headers, fd attribution and limits), Commands
                  (every command's replies and refusal errnos, payload sizes, wire details),
                  VERSION capabilities, Server-to-client DMA (chunking, reply forms, the
                  client's errors, ids), Limits (a server started with small limits).
    testdev.md    Identity and config space, regions, BAR0 registers and access sizes, DMA
                  (fill/checksum through pinned memfds and through DMA_READ/DMA_WRITE, every
                  errno the device documents, bus mastering), interrupts (INTx with automask,
                  MSI, MSI-X with masking and PBA), BAR1 (sparse mmap), BAR2 (I/O), reset,
                  unmap and detach.
    README.md     Serving devices (signals, one client at a time), the daemon's start, stats
                  and stop.

Speed independence (the CI rule: a busy machine makes a test slower, never red)
    - Nothing asserts on elapsed time. Every wait is for an event (a reply, an interrupt,
      end-of-file, a DMA status, a register or counter reaching a value) with a generous
      bound (--timeout, 30 s), and fails only if the event never happens. Counts are counts:
      "one interrupt per completion" waits until IRQ_COUNT moved, then checks it moved by 1.
    - A check that something does NOT happen (no interrupt, no reply to a posted request)
      first makes a round trip (the server handles a connection's messages in arrival
      order), then looks for the event for a short window: a slow machine can only make it
      miss a violation, never report one that did not happen.
    - Scenarios that hold one of the server's DMA requests unanswered (to see the device
      busy, or to cancel or reset it mid-transfer) run inside the server's 5 s wait for the
      client's reply. If this client itself took more than 4 s to answer (a starved
      machine), the attempt is void and run again; it is never judged on a reply the server
      had already given up on.
    - Where the docs let the server turn a client away when a wall-clock deadline passes (a
      handover whose cleanup outlasts 2 s + unmap timeout + 1 s), the client connects again,
      as the docs say it may, and must be served within the bound (a NOTE says so).
    - Not checked, because they need a wall-clock window: the 10 s `send_timeout` for a
      client that stops reading (vfio-user.md § Connections: Unread replies: it takes over
      10 s), how long the 5 s client-DMA wait lasts (only that an unanswered DMA_WRITE ends
      the command with ENOTCONN and the late reply is dropped), and "closed at once",
      "promptly" as durations (only that they happen).
    - A second client while one is live may see end-of-file or ECONNRESET (vfio-user.md
      § Connections: One client per instance); both are accepted.

How to run
    python3 testdev_contract.py --bin target/release/umdev
    python3 testdev_contract.py --bin /path/to/umdev --socket-dir /tmp --only dma,msix

    --bin PATH         the umdev binary (default: $UMDEV_BIN, else target/release/umdev)
    --socket-dir DIR   where this run makes its own fresh directory for sockets, logs and the
                       daemon's run/state dirs (default: the system temp dir); parallel runs
                       never share one. It is removed at exit, whatever happened.
    --only A,B         run only these test groups (--list shows them)
    --timeout S        the bound on every wait for an event (default 30)
    -q, --quiet        print only FAIL and NOTE lines and the summary

    Exit status: 0 when every check passed; 1 when a check failed (the FAIL lines are repeated
    after the summary, with the last lines of the servers' logs); 2 when it could not start
    (binary missing, server not starting, ...); 130 when interrupted.
    NOTE lines are informational and never fail a run. Servers are stopped and files removed
    on every exit path, Ctrl-C and SIGTERM included.
"""
import argparse
import errno as E
import fcntl
import json
import mmap
import os
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback

# ======================================================================
# Timing policy (see the module docstring)
# ======================================================================
WAIT = 30.0        # bound on a wait for an event that must happen (--timeout)
QUIET = 0.1        # window, after a round trip, for an event that must NOT happen
HOLD_LIMIT = 4.0   # the server waits 5 s for a DMA reply; holding one longer voids the attempt
POLL = 0.002       # sleep between polls of a register or a condition


def wait_until(pred, timeout=None, step=POLL):
    """Poll pred() until it is true; False if `timeout` (default WAIT) passed first."""
    deadline = time.monotonic() + (WAIT if timeout is None else timeout)
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            return v
        time.sleep(step)


# ======================================================================
# Citations: doc file § section: item (section names, never line numbers)
# ======================================================================
def cite(doc, section, item=None):
    return '%s § %s%s' % (doc, section, (': ' + item) if item else '')


def VU(section, item=None):
    return cite('vfio-user.md', section, item)


def TD(section, item=None):
    return cite('testdev.md', section, item)


def RM(section, item=None):
    return cite('README.md', section, item)


def SPEC(section):
    return 'vfio-user spec § ' + section


def both(*refs):
    return ' + '.join(refs)


# ======================================================================
# A small vfio-user client
# ======================================================================
# Commands (vfio-user spec "Commands")
VERSION, DMA_MAP, DMA_UNMAP, DEVICE_GET_INFO, GET_REGION_INFO, GET_REGION_IO_FDS, \
    GET_IRQ_INFO, SET_IRQS, REGION_READ, REGION_WRITE, DMA_READ, DMA_WRITE, DEVICE_RESET, \
    DIRTY_PAGES, REGION_WRITE_MULTI, DEVICE_FEATURE, MIG_DATA_READ, MIG_DATA_WRITE = range(1, 19)

# header flags (vfio-user.md § Commands: Wire details)
T_CMD, T_REPLY = 0, 1
F_NO_REPLY, F_ERROR = 0x10, 0x20

# region and IRQ indexes (testdev.md § Regions: VFIO's)
BAR0, BAR1, BAR2, BAR3, BAR4, BAR5, ROM, CONFIG, VGA = range(9)
INTX, MSI, MSIX, ERR, REQ = range(5)

# <linux/vfio.h> flag values
RI_READ, RI_WRITE, RI_MMAP, RI_CAPS = 1, 2, 4, 8
II_EVENTFD, II_MASKABLE, II_AUTOMASKED, II_NORESIZE = 1, 2, 4, 8
DATA_NONE, DATA_BOOL, DATA_EVENTFD = 1, 2, 4
ACTION_MASK, ACTION_UNMASK, ACTION_TRIGGER = 8, 16, 32
DMA_R, DMA_W = 1, 2
UNMAP_DIRTY, UNMAP_ALL = 1, 2

HDR = struct.Struct('<HHIII')   # id, command, size, flags, error
BAD_REPLIES = []                # replies whose header did not match their request


class Closed(Exception):
    pass


class VfioErr(Exception):
    def __init__(self, err, msg):
        super().__init__('errno %d' % err)
        self.errno = err
        self.msg = msg


class Msg:
    def __init__(self, mid, cmd, size, flags, error, payload, fds):
        self.id, self.cmd, self.size, self.flags, self.error = mid, cmd, size, flags, error
        self.payload = payload
        self.fds = fds
        self.t_recv = time.monotonic()

    @property
    def is_error(self):
        return bool(self.flags & F_ERROR)

    def __repr__(self):
        return 'Msg(id=%d cmd=%d size=%d flags=%#x error=%d payload=%d bytes fds=%d)' % (
            self.id, self.cmd, self.size, self.flags, self.error, len(self.payload), len(self.fds))


class Client:
    """One vfio-user connection. A reader thread files replies by id and serves the
    server's DMA_READ/DMA_WRITE requests from self.mem (memory mapped without an fd)."""

    def __init__(self, path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(WAIT)
        try:
            self.sock.connect(path)
        except OSError:
            self.sock.close()
            raise
        self.sock.settimeout(None)
        self.send_lock = threading.Lock()
        self.cv = threading.Condition()
        self.replies = {}
        self.eof = False
        self.eof_error = None
        self._id = 0x100
        self.server_reqs = []       # every server request seen (Msg)
        self.unexpected = []        # messages of an unknown type
        self.held = []              # server requests held by policy 'hold'
        self.dma_policy = 'answer'  # answer | hold | error | malformed
        self.dma_errno = E.ENODEV
        self.dma_write_reply = '16'  # '16' (libvfio-user) | '12' (the spec's) | 'bare' (QEMU's)
        self.mem = []               # [(iova, bytearray)]
        self.attempts = 1           # connections it took to be served (see new_session)
        self.irq_before = None      # IRQ_COUNT before the DMA command being polled
        self.reader = threading.Thread(target=self._loop, daemon=True)
        self.reader.start()

    # ---- transport ----
    def _recv_exact(self, n):
        buf = bytearray()
        fds = []
        while len(buf) < n:
            data, f, _fl, _ = socket.recv_fds(self.sock, n - len(buf), 64)
            fds.extend(f)
            if not data:
                raise EOFError('end-of-file')
            buf += data
        return bytes(buf), fds

    def _loop(self):
        try:
            while True:
                hdr, fds = self._recv_exact(16)
                mid, cmd, size, flags, err = HDR.unpack(hdr)
                payload = b''
                if size > 16:
                    payload, f2 = self._recv_exact(size - 16)
                    fds += f2
                m = Msg(mid, cmd, size, flags, err, payload, fds)
                if flags & 0xf == T_REPLY:
                    with self.cv:
                        self.replies.setdefault(mid, []).append(m)
                        self.cv.notify_all()
                elif flags & 0xf == T_CMD:
                    self._server_request(m)
                else:
                    self.unexpected.append(m)
        except (EOFError, OSError) as e:
            with self.cv:
                self.eof = True
                self.eof_error = e
                self.cv.notify_all()

    def eof_kind(self):
        """'EOF', 'ECONNRESET' or what else ended the connection (None: still open)."""
        e = self.eof_error
        if not self.eof:
            return None
        if isinstance(e, EOFError):
            return 'EOF'
        if isinstance(e, ConnectionResetError):
            return 'ECONNRESET'
        return repr(e)

    def send_raw(self, data, fds=()):
        with self.send_lock:
            if fds:
                n = socket.send_fds(self.sock, [data], list(fds))
                data = data[n:]
            if data:
                self.sock.sendall(data)

    def next_id(self):
        with self.cv:
            self._id = (self._id + 1) & 0xffff
            return self._id

    def wait_reply(self, mid, timeout=None):
        deadline = time.monotonic() + (WAIT if timeout is None else timeout)
        with self.cv:
            while not self.replies.get(mid):
                if self.eof:
                    raise Closed('connection closed (%s)' % self.eof_error)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError('no reply to id %d within %.0f s' % (mid, WAIT))
                self.cv.wait(left)
            return self.replies[mid].pop(0)

    def has_reply(self, mid):
        with self.cv:
            return bool(self.replies.get(mid))

    def request(self, cmd, payload=b'', fds=(), flags=0, size=None, mid=None):
        """Send a command; return the reply Msg (None for NO_REPLY)."""
        if mid is None:
            mid = self.next_id()
        sz = 16 + len(payload) if size is None else size
        self.send_raw(HDR.pack(mid, cmd, sz, flags, 0) + payload, fds)
        if flags & F_NO_REPLY:
            return None
        m = self.wait_reply(mid)
        # every reply: same command, reply type, errno only with the error flag, and an
        # error reply is a bare header (vfio-user.md § Commands: error replies)
        ok = m.cmd == cmd and m.flags & 0xf == T_REPLY and (m.is_error or m.error == 0) and \
            (not m.is_error or (m.size == 16 and m.error > 0))
        if not ok:
            BAD_REPLIES.append((cmd, repr(m)))
        return m

    def call(self, cmd, payload=b'', fds=(), flags=0):
        m = self.request(cmd, payload, fds, flags)
        if m is None:
            return None
        if m.is_error:
            for fd in m.fds:
                os.close(fd)
            raise VfioErr(m.error, m)
        return m

    def errno_of(self, cmd, payload=b'', fds=(), flags=0, size=None):
        """Send and return the errno of the reply (0 for success)."""
        m = self.request(cmd, payload, fds, flags, size=size)
        for fd in m.fds:
            os.close(fd)
        return m.error if m.is_error else 0

    def wait_eof(self, timeout=None):
        deadline = time.monotonic() + (WAIT if timeout is None else timeout)
        with self.cv:
            while not self.eof:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cv.wait(left)
        return True

    def barrier(self):
        """A round trip. Messages are handled strictly in arrival order (vfio-user.md
        § Connections: Threads), so everything sent before it has been handled."""
        self.request(DEVICE_GET_INFO, struct.pack('<IIII', 16, 0, 0, 0))

    def alive(self):
        """True if the connection still answers (a DEVICE_GET_INFO round trip)."""
        try:
            m = self.request(DEVICE_GET_INFO, struct.pack('<IIII', 16, 0, 0, 0))
            return not m.is_error
        except (Closed, TimeoutError, OSError):
            return False

    def close(self):
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self.reader.join(2)

    # ---- the server's requests (DMA_READ / DMA_WRITE) ----
    def _find(self, addr, count):
        for base, buf in self.mem:
            if base <= addr and addr + count <= base + len(buf):
                return base, buf
        return None, None

    def _server_request(self, m):
        self.server_reqs.append(m)
        for fd in m.fds:
            os.close(fd)
        if self.dma_policy == 'hold':
            self.held.append(m)
            return
        self.answer(m, self.dma_policy)

    def wait_held(self, n=1):
        return wait_until(lambda: len(self.held) >= n)

    def release_held(self, pol='answer'):
        """Answer every held request; return how long the longest was held (s)."""
        held, self.held = self.held, []
        longest = 0.0
        for m in held:
            longest = max(longest, time.monotonic() - m.t_recv)
            self.answer(m, pol)
        return longest

    def answer(self, m, pol='answer'):
        if m.cmd not in (DMA_READ, DMA_WRITE):
            self.unexpected.append(m)
            self.send_raw(HDR.pack(m.id, m.cmd, 16, T_REPLY | F_ERROR, E.ENOSYS))
            return
        if pol == 'error':
            self.send_raw(HDR.pack(m.id, m.cmd, 16, T_REPLY | F_ERROR, self.dma_errno))
            return
        addr, count = struct.unpack_from('<QQ', m.payload)
        base, buf = self._find(addr, count)
        if m.cmd == DMA_READ:
            if buf is None:
                self.send_raw(HDR.pack(m.id, m.cmd, 16, T_REPLY | F_ERROR, E.ENODEV))
                return
            data = bytes(buf[addr - base: addr - base + count])
            if pol == 'malformed':
                data = data[:-1]        # one byte short
            payload = struct.pack('<QQ', addr, count) + data
        else:
            data = m.payload[16:]
            if buf is None or len(data) != count:
                self.send_raw(HDR.pack(m.id, m.cmd, 16, T_REPLY | F_ERROR, E.ENODEV))
                return
            buf[addr - base: addr - base + count] = data
            if pol == 'malformed':
                payload = struct.pack('<QQ', addr + 1, count)   # the wrong address
            elif self.dma_write_reply == 'bare':
                payload = b''
            elif self.dma_write_reply == '12':
                payload = struct.pack('<QI', addr, count)
            else:
                payload = struct.pack('<QQ', addr, count)
        self.send_raw(HDR.pack(m.id, m.cmd, 16 + len(payload), T_REPLY, 0) + payload)

    # ---- commands ----
    def version(self, caps=None, major=0, minor=0, raw=None):
        if raw is not None:
            js = raw
        elif caps is None:
            js = b''
        else:
            js = json.dumps({'capabilities': caps}).encode() + b'\0'
        return self.request(VERSION, struct.pack('<HH', major, minor) + js)

    def negotiate(self, caps=None):
        if caps is None:
            caps = {'max_msg_fds': 16, 'max_data_xfer_size': 1 << 20, 'pgsizes': 4096,
                    'max_dma_maps': 4096, 'write_multiple': True}
        m = self.version(caps)
        if m.is_error:
            raise VfioErr(m.error, m)
        major, minor = struct.unpack_from('<HH', m.payload)
        js = m.payload[4:]
        parsed = json.loads(js.rstrip(b'\0').decode()) if js else None
        return major, minor, parsed, m

    def device_info(self, argsz=16):
        m = self.call(DEVICE_GET_INFO, struct.pack('<IIII', argsz, 0, 0, 0))
        return struct.unpack_from('<IIII', m.payload)

    def region_info(self, index, argsz=32):
        m = self.call(GET_REGION_INFO, struct.pack('<IIIIQQ', argsz, 0, index, 0, 0, 0))
        argsz_r, flags, idx, cap_off, size, off = struct.unpack_from('<IIIIQQ', m.payload)
        caps = []
        if flags & RI_CAPS and cap_off:
            o = cap_off
            while o and o + 8 <= len(m.payload) and len(caps) < 16:
                cid, cver, nxt = struct.unpack_from('<HHI', m.payload, o)
                body = m.payload[o + 8:]
                cap = {'id': cid, 'version': cver, 'next': nxt, 'offset': o}
                if cid == 1:  # VFIO_REGION_INFO_CAP_SPARSE_MMAP
                    nr, _res = struct.unpack_from('<II', body)
                    cap['areas'] = [struct.unpack_from('<QQ', body, 8 + 16 * i) for i in range(nr)]
                caps.append(cap)
                o = nxt
        return dict(argsz=argsz_r, flags=flags, index=idx, cap_offset=cap_off, size=size,
                    offset=off, caps=caps, fds=m.fds, payload_len=len(m.payload), msg=m)

    def irq_info(self, index):
        m = self.call(GET_IRQ_INFO, struct.pack('<IIII', 16, 0, index, 0))
        return struct.unpack_from('<IIII', m.payload)

    def set_irqs(self, index, flags, start, count, fds=(), data=b'', argsz=None):
        if argsz is None:
            argsz = 20 + len(data)
        return self.call(SET_IRQS, struct.pack('<IIIII', argsz, flags, index, start, count) + data, fds=fds)

    def region_read(self, region, offset, count):
        m = self.call(REGION_READ, struct.pack('<QII', offset, region, count))
        o, r, c = struct.unpack_from('<QII', m.payload)
        assert (o, r, c) == (offset, region, count), ((o, r, c), (offset, region, count))
        return m.payload[16:]

    def region_write(self, region, offset, data, posted=False):
        return self.call(REGION_WRITE, struct.pack('<QII', offset, region, len(data)) + data,
                         flags=F_NO_REPLY if posted else 0)

    def rd(self, region, offset, size):
        return int.from_bytes(self.region_read(region, offset, size), 'little')

    def wr(self, region, offset, value, size):
        self.region_write(region, offset, value.to_bytes(size, 'little'))

    def dma_map(self, iova, size, flags=DMA_R | DMA_W, fd=None, offset=0, argsz=32):
        fds = [fd] if fd is not None else []
        return self.call(DMA_MAP, struct.pack('<IIQQQ', argsz, flags, offset, iova, size), fds=fds)

    def dma_unmap(self, iova, size, flags=0, argsz=24):
        return self.call(DMA_UNMAP, struct.pack('<IIQQ', argsz, flags, iova, size)).payload

    def reset(self):
        return self.call(DEVICE_RESET)


class Ev:
    """An interrupt eventfd and the signals counted on it so far.

    take(n) waits (up to WAIT) until n new signals arrived and returns how many arrived
    since the last take; take(0) is for "no signal": it looks for QUIET seconds."""

    def __init__(self, blocking=False):
        self.fd = os.eventfd(0, os.EFD_CLOEXEC | (0 if blocking else os.EFD_NONBLOCK))
        self.total = 0
        self.mark = 0

    def _drain(self, timeout):
        r, _, _ = select.select([self.fd], [], [], max(0.0, timeout))
        if r:
            try:
                self.total += os.eventfd_read(self.fd)
            except BlockingIOError:
                pass

    def take(self, n=1):
        if n == 0:
            deadline = time.monotonic() + QUIET
            while time.monotonic() < deadline:
                self._drain(deadline - time.monotonic())
        else:
            deadline = time.monotonic() + WAIT
            while self.total - self.mark < n and time.monotonic() < deadline:
                self._drain(deadline - time.monotonic())
            self._drain(0)
        got = self.total - self.mark
        self.mark = self.total
        return got

    def dup(self):
        return os.dup(self.fd)

    def close(self):
        os.close(self.fd)


def errname(n):
    return '%d(%s)' % (n, E.errorcode.get(n, '?')) if n else '0(ok)'


def fmt(v):
    if isinstance(v, int) and not isinstance(v, bool):
        return hex(v) if v > 9 else str(v)
    if isinstance(v, tuple) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return '(%s)' % ', '.join(fmt(x) for x in v)
    if isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return '[%s]' % ', '.join(fmt(x) for x in v)
    if isinstance(v, (bytes, bytearray)) and len(v) > 32:
        return '%d bytes %s...' % (len(v), bytes(v[:16]).hex())
    if isinstance(v, (bytes, bytearray)):
        return bytes(v).hex() or "b''"
    return repr(v)


# ======================================================================
# Results
# ======================================================================
class Results:
    def __init__(self):
        self.items = []
        self.section = ''
        self.quiet = False

    def _print(self, line):
        if not self.quiet or not line.startswith('PASS'):
            print(line, flush=True)

    def sec(self, name):
        self.section = name
        if not self.quiet:
            print('\n=== %s' % name, flush=True)

    def info(self, text):
        if not self.quiet:
            print('   ' + text, flush=True)

    def check(self, ok, ref, what, got=''):
        tag = 'PASS' if ok else 'FAIL'
        self.items.append((tag, self.section, ref, what, got))
        self._print('%s [%s] %s%s' % (tag, ref, what, ('  -- got: %s' % (got,)) if got != '' else ''))
        return bool(ok)

    def eq(self, got, want, ref, what):
        return self.check(got == want, ref, what + ' (want %s)' % fmt(want), fmt(got))

    def errno(self, got, want, ref, what):
        return self.check(got == want, ref, '%s -> %s' % (what, errname(want)), errname(got))

    def note(self, ref, what):
        self.items.append(('NOTE', self.section, ref, what, ''))
        self._print('NOTE [%s] %s' % (ref, what))

    def count(self, tag):
        return sum(1 for t, *_ in self.items if t == tag)

    def summary(self, elapsed):
        n = {t: self.count(t) for t in ('PASS', 'FAIL', 'NOTE')}
        print('\n=== summary: PASS %d, FAIL %d, NOTE %d (%.2f s)' % (n['PASS'], n['FAIL'], n['NOTE'], elapsed))
        for want in ('FAIL', 'NOTE'):
            for t, s, ref, what, got in self.items:
                if t == want:
                    print('%s [%s] (%s) %s%s' % (t, ref, s, what, ('  -- got: %s' % (got,)) if got != '' else ''))
        return n['FAIL']


R = Results()


class Attempt:
    """The checks of one attempt at a scenario that holds a server DMA request. They count
    only if the client answered within HOLD_LIMIT; otherwise the attempt is void."""

    def __init__(self):
        self.items = []
        self.void = None

    def check(self, ok, ref, what, got=''):
        self.items.append(('check', (ok, ref, what, got)))
        return bool(ok)

    def eq(self, got, want, ref, what):
        return self.check(got == want, ref, what + ' (want %s)' % fmt(want), fmt(got))

    def note(self, ref, what):
        self.items.append(('note', (ref, what)))

    def held(self, seconds):
        if seconds > HOLD_LIMIT:
            self.void = 'this client held a DMA request %.1f s (the server waits 5 s)' % seconds


def attempt(ref, what, fn, tries=4):
    """Run fn(Attempt) until an attempt is not void, then record its checks."""
    for i in range(tries):
        a = Attempt()
        fn(a)
        if a.void is None:
            for kind, args in a.items:
                (R.check if kind == 'check' else R.note)(*args)
            return
        R.info('(%s: attempt %d void: %s; again)' % (what, i + 1, a.void))
    R.note(ref, '%s: not judged, every attempt was void (machine too slow to answer within 4 s)' % what)


# ======================================================================
# The harness: a fresh directory, the servers, cleanup on every exit path
# ======================================================================
class SetupError(Exception):
    pass


class Harness:
    def __init__(self, binary, socket_dir):
        self.bin = binary
        self.dir = tempfile.mkdtemp(prefix='umdev-contract-', dir=socket_dir)
        self.procs = []
        self.sock = self.path('testdev.sock')

    def path(self, name):
        return os.path.join(self.dir, name)

    def spawn(self, args, log):
        with open(self.path(log + '.log'), 'ab') as logf:
            p = subprocess.Popen([self.bin] + args, stdin=subprocess.DEVNULL, stdout=logf,
                                 stderr=subprocess.STDOUT)
        self.procs.append(p)
        return p

    def start_server(self, sock, extra=(), log='server', unlink=True):
        """`umdev run --type testdev` on sock; returns once the socket file exists."""
        if unlink and os.path.lexists(sock):
            os.unlink(sock)
        p = self.spawn(['run', '--type', 'testdev', '--socket', sock] + list(extra), log)
        if not wait_until(lambda: p.poll() is not None or os.path.exists(sock)) or p.poll() is not None:
            raise SetupError('server on %s did not start (rc %s): %s' % (sock, p.poll(), self.log_tail(log)))
        return p

    def stop(self, p, sig=signal.SIGTERM):
        """Signal p and wait for it (up to WAIT, then SIGKILL); return its exit status."""
        if p.poll() is None:
            p.send_signal(sig)
            try:
                p.wait(WAIT)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        return p.returncode

    def log_tail(self, log, n=20):
        try:
            with open(self.path(log + '.log'), errors='replace') as f:
                return ''.join(f.readlines()[-n:])
        except OSError:
            return ''

    def dump_logs(self):
        for name in sorted(os.listdir(self.dir)):
            if name.endswith('.log'):
                tail = self.log_tail(name[:-4])
                if tail.strip():
                    print('--- last lines of %s:\n%s' % (name, tail.rstrip()))

    def cleanup(self):
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGTERM)
                except OSError:
                    pass
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def connect(path):
    """A connection; retries while the socket is not there or not listening yet."""
    deadline = time.monotonic() + WAIT
    while True:
        try:
            return Client(path)
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _served(path, first):
    """Connect and send `first`; reconnect while the server closes the connection.

    A client arriving just after another one left waits for that one's cleanup, and is
    closed if the cleanup outlasts the server's deadline; a client after that is served
    (vfio-user.md § Connections: Handover). So being turned away is allowed, and a slow
    machine only means more connections here, never a failure."""
    deadline = time.monotonic() + WAIT
    attempts = 0
    while True:
        attempts += 1
        c = connect(path)
        try:
            first(c)
            c.attempts = attempts
            return c
        except TimeoutError:
            c.close()
            raise
        except (Closed, OSError) as e:
            c.close()
            if time.monotonic() > deadline:
                raise Closed('not served within %.0f s (%d connections): %s' % (WAIT, attempts, e))
            time.sleep(0.02)


def new_session(path, caps=None):
    """A negotiated session (VERSION done)."""
    return _served(path, lambda c: c.negotiate(caps))


def raw_client(path):
    """A served connection before VERSION: its first request (DEVICE_GET_INFO, EINVAL before
    VERSION) has been answered, so the server is reading it."""
    return _served(path, lambda c: c.request(DEVICE_GET_INFO, struct.pack('<IIII', 16, 0, 0, 0)))


def memfd(size, name='guest'):
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    return fd


# ======================================================================
# testdev's registers (testdev.md § BAR0 registers) and DMA helpers
# ======================================================================
ID, SCRATCH, DMA_ADDR_LO, DMA_ADDR_HI, DMA_LEN, DMA_PATTERN, DMA_CMD, DMA_STATUS, DMA_RESULT, \
    IRQ_RAISE, IRQ_COUNT, ISR = range(0, 0x30, 4)
MSIX_TABLE, MSIX_PBA = 0x800, 0xc00
TESTDEV_ID = 0x75646576
ST_IDLE, ST_BUSY, ST_DONE, ST_ERROR = 0, 1, 2, 3

DMA_POLLS = {'commands': 0, 'idle_after_cmd': []}   # see t_dma_status_after_cmd


def walk_caps(c):
    cfg = c.region_read(CONFIG, 0, 256)
    caps = []
    p = cfg[0x34] & 0xfc
    seen = set()
    while p and p not in seen:
        seen.add(p)
        caps.append((cfg[p], p))
        p = cfg[p + 1] & 0xfc
    return cfg, caps


def cap_pos(c):
    return dict(walk_caps(c)[1])


def start_dma(c, addr, length, cmd, pattern=0, via8=False):
    c.irq_before = c.rd(BAR0, IRQ_COUNT, 4)
    c.wr(BAR0, DMA_ADDR_LO, addr & 0xffffffff, 4)
    c.wr(BAR0, DMA_ADDR_HI, addr >> 32, 4)
    c.wr(BAR0, DMA_LEN, length, 4)
    if via8:
        c.wr(BAR0, DMA_PATTERN, pattern | (cmd << 32), 8)
    else:
        c.wr(BAR0, DMA_PATTERN, pattern, 4)
        c.wr(BAR0, DMA_CMD, cmd, 4)


def poll_dma(c, what='', step=0.001):
    """Poll DMA_STATUS until done or error (up to WAIT). Returns (status, result, statuses
    seen). Called right after a DMA_CMD write's reply: DMA_STATUS must not read idle from
    then on (testdev.md § DMA), which t_whole_run checks. Every command that ends raises the
    device interrupt, which may come a moment after DMA_STATUS changed: when the command's
    IRQ_COUNT before is known (c.irq_before), it also waits for that interrupt, so that no
    interrupt of this command is still to come when the next check counts them."""
    saw = []

    def done():
        st = c.rd(BAR0, DMA_STATUS, 4)
        if not saw or saw[-1] != st:
            saw.append(st)
        return st in (ST_DONE, ST_ERROR)
    ok = wait_until(done, step=step)
    DMA_POLLS['commands'] += 1
    if ST_IDLE in saw:
        DMA_POLLS['idle_after_cmd'].append((what, saw))
    if not ok:
        return saw[-1], None, saw
    res = c.rd(BAR0, DMA_RESULT, 4)
    if c.irq_before is not None:
        wait_irq_count(c, c.irq_before + 1)
        c.irq_before = None
    return saw[-1], res, saw


def run_dma(c, addr, length, cmd, pattern=0, via8=False, what=''):
    start_dma(c, addr, length, cmd, pattern, via8)
    return poll_dma(c, what)


def wait_irq_count(c, target):
    """IRQ_COUNT once it reached target (or after WAIT). The interrupt of a completion may
    be raised a moment after DMA_STATUS changed, so a count is read only after it is due."""
    val = [0]

    def reached():
        val[0] = c.rd(BAR0, IRQ_COUNT, 4)
        return val[0] >= target
    wait_until(reached)
    return val[0]


def wait_reg(c, region, off, size, pred):
    """A register's value once pred(value) holds (or its last value after WAIT)."""
    val = [None]

    def ok():
        val[0] = c.rd(region, off, size)
        return pred(val[0])
    wait_until(ok)
    return val[0]


def fmt_dma(st, res):
    return 'status %s result %s' % (st, errname(res) if st == ST_ERROR and res is not None else
                                   (hex(res) if isinstance(res, int) else res))


def dma_expect(c, addr, length, cmd, pattern, want_status, want_result, ref, what, sink=None):
    """Run a command and check its status and result, and that it raised one interrupt."""
    sink = sink or R
    cnt0 = c.rd(BAR0, IRQ_COUNT, 4)
    st, res, saw = run_dma(c, addr, length, cmd, pattern, what=what)
    want = 'status %d result %s' % (want_status, errname(want_result) if want_status == ST_ERROR else hex(want_result))
    sink.check((st, res) == (want_status, want_result), ref, '%s -> %s' % (what, want), fmt_dma(st, res))
    cnt1 = wait_irq_count(c, cnt0 + 1)
    sink.check(cnt1 - cnt0 == 1, TD('DMA', 'on completion the device interrupt is raised'),
               '%s: one interrupt on completion' % what, cnt1 - cnt0)
    c.rd(BAR0, ISR, 4)
    return st, res


def err_of(m):
    return m.error if m.is_error else 0


# ######################################################################
# vfio-user.md § Commands: VERSION, requests before it, § VERSION capabilities
# ######################################################################
def t_pre_version(env):
    R.sec('Requests before VERSION, VERSION refusals (vfio-user.md § Commands: VERSION; any other, before VERSION)')
    pre = VU('Commands', 'any other, before VERSION')
    ver = VU('Commands', 'VERSION')
    c = raw_client(env.sock)
    R.errno(c.errno_of(DEVICE_GET_INFO, struct.pack('<IIII', 16, 0, 0, 0)), E.EINVAL, pre,
            'DEVICE_GET_INFO before VERSION ("a request that parses")')
    R.errno(c.errno_of(99), E.ENOSYS, pre, 'unknown command 99 before VERSION')
    R.errno(c.errno_of(DEVICE_FEATURE, struct.pack('<II', 8, 0)), E.ENOTTY, pre, 'DEVICE_FEATURE before VERSION')
    R.errno(c.errno_of(DIRTY_PAGES, struct.pack('<II', 8, 0)), E.ENOTSUP, pre, 'DIRTY_PAGES before VERSION')
    ev = Ev()
    R.errno(c.errno_of(REGION_READ, struct.pack('<QII', 0, BAR0, 4), fds=[ev.dup()]), E.EINVAL, pre,
            'REGION_READ with an fd before VERSION')
    R.errno(c.errno_of(REGION_READ, struct.pack('<QII', 0, BAR0, (1 << 20) + 1)), E.E2BIG, pre,
            'REGION_READ count > max_data_xfer_size before VERSION')
    R.errno(c.errno_of(REGION_READ, struct.pack('<QI', 0, BAR0)), E.EINVAL, pre,
            'REGION_READ with a 12-byte (malformed) payload before VERSION')
    # VERSION refusals; each leaves negotiation open
    for raw, caps, major, want, what in (
            (b'{"capabilities": {}', None, 0, E.EINVAL, 'JSON without NUL'),
            (b'{"capabilities": \0', None, 0, E.EINVAL, 'bad JSON'),
            (None, {'max_msg_fds': 'many'}, 0, E.EINVAL, 'max_msg_fds of the wrong type'),
            (None, {'max_msg_fds': 1025}, 0, E.EINVAL, 'max_msg_fds 1025'),
            (None, {'max_data_xfer_size': 0}, 0, E.EINVAL, 'max_data_xfer_size 0'),
            (None, {'max_dma_maps': 1 << 32}, 0, E.EINVAL, 'max_dma_maps 2^32'),
            (None, {'pgsizes': 8192}, 0, E.EINVAL, 'pgsizes without 4 KiB'),
            (None, {}, 1, E.ENOTSUP, 'major 1')):
        R.errno(err_of(c.version(caps, major=major, raw=raw)), want, ver, 'VERSION %s' % what)
    R.errno(err_of(c.request(VERSION, b'\0\0')), E.EINVAL, ver, 'VERSION payload < 4')
    m = c.request(VERSION, struct.pack('<HH', 0, 0) + json.dumps({'capabilities': {}}).encode() + b'\0',
                  fds=[ev.dup()])
    R.errno(err_of(m), E.EINVAL, ver, 'VERSION with an fd attached')
    ev.close()
    try:
        major, minor, js, m = c.negotiate()
        R.check(True, ver, 'VERSION accepted after refused ones ("leaves negotiation open")')
        R.eq((major, minor), (0, 0), ver, 'VERSION reply major/minor')
    except VfioErr as ex:
        R.check(False, ver, 'VERSION accepted after refused ones ("leaves negotiation open")', errname(ex.errno))
    R.errno(err_of(c.version({'max_msg_fds': 16})), E.EINVAL, ver, 'a second well-formed VERSION after success')
    R.errno(err_of(c.version({}, major=1)), E.ENOTSUP, ver, 'a second VERSION with major 1 after success')
    R.errno(err_of(c.version(raw=b'{bad\0')), E.EINVAL, ver, 'a second, malformed VERSION after success')
    R.check(c.alive(), VU('Framing', 'any other malformed message: the connection goes on'),
            'the connection still serves after all the refusals')
    c.close()


def t_version_caps(env):
    R.sec('VERSION reply: capabilities and size (vfio-user.md § VERSION capabilities)')
    offers = VU('VERSION capabilities', 'What the server offers')
    size = VU('VERSION capabilities', 'Reply size')
    c = raw_client(env.sock)
    caps = {'max_msg_fds': 16, 'max_data_xfer_size': 1 << 20, 'pgsizes': 4096, 'max_dma_maps': 4096,
            'write_multiple': True, 'migration': {'pgsize': 4096, 'max_bitmap_size': 1 << 20}}
    req = struct.pack('<HH', 0, 0) + json.dumps({'capabilities': caps}).encode() + b'\0'
    m = c.request(VERSION, req)
    R.info('VERSION reply JSON: %r' % m.payload[4:])
    cap = json.loads(m.payload[4:].rstrip(b'\0')).get('capabilities', {})
    R.eq(cap.get('max_msg_fds'), 16, offers, 'offered max_msg_fds')
    R.eq(cap.get('max_data_xfer_size'), 1 << 20, offers, 'offered max_data_xfer_size')
    R.eq(cap.get('pgsizes'), 4096, offers, 'offered pgsizes')
    R.eq(cap.get('max_dma_maps'), 4096, offers, 'offered max_dma_maps')
    R.eq(cap.get('write_multiple'), True, offers, 'write_multiple offered back when the client offered it')
    R.check('migration' not in cap, offers, 'no migration key, whatever the client offered', sorted(cap))
    R.check(m.payload[-1:] == b'\0', SPEC('VERSION'), 'reply JSON NUL-terminated', m.payload[-4:])
    R.check(m.size <= 16 + len(req), size, 'reply no longer than the request', '%d <= %d' % (m.size, 16 + len(req)))
    c.close()

    # without write_multiple: REGION_WRITE_MULTI refused
    c = raw_client(env.sock)
    short = {'max_msg_fds': 16}
    m = c.version(short)
    js = json.loads(m.payload[4:].rstrip(b'\0'))
    R.info('VERSION reply to %s: %r' % (short, m.payload[4:]))
    R.check(m.size <= 16 + 4 + len(json.dumps({'capabilities': short})) + 1, size, 'reply no longer than a short request', m.size)
    R.check('write_multiple' not in js.get('capabilities', {}), offers, 'write_multiple only if the client offered it', js)
    e = c.errno_of(REGION_WRITE_MULTI, struct.pack('<Q', 1) + struct.pack('<QII', SCRATCH, BAR0, 4) + bytes(8))
    R.errno(e, E.EINVAL, VU('Commands', 'REGION_WRITE_MULTI'), 'REGION_WRITE_MULTI not negotiated')
    c.close()

    # JSON shorter than 20 bytes (with its NUL), or none: a reply without JSON
    for raw, what, ref in ((b'{}\0', 'JSON "{}" (3 bytes)', size),
                           (b'{"x":"1234567890"}\0', 'a 19-byte JSON (with NUL)', size),
                           (b'', 'a request without JSON', VU('VERSION capabilities', 'A request without JSON'))):
        c = raw_client(env.sock)
        m = c.version(raw=raw)
        R.check(not m.is_error and len(m.payload) == 4, ref, '%s -> a reply without JSON' % what,
                errname(m.error) if m.is_error else m.payload)
        c.close()
    c = raw_client(env.sock)
    raw = b'{"capabilities":{}}\0'
    m = c.version(raw=raw)
    R.check(not m.is_error and len(m.payload) <= 4 + len(raw), size, 'a 20-byte JSON request -> a reply that fits', m.payload)
    c.close()
    # write_multiple offered in a short request: the reply may trim it, and the command follows the reply
    c = raw_client(env.sock)
    raw = json.dumps({'capabilities': {'write_multiple': True}}, separators=(',', ':')).encode() + b'\0'
    m = c.version(raw=raw)
    js = json.loads(m.payload[4:].rstrip(b'\0')) if len(m.payload) > 4 else {}
    wm = js.get('capabilities', {}).get('write_multiple')
    e = c.errno_of(REGION_WRITE_MULTI, struct.pack('<Q', 1) + struct.pack('<QII', SCRATCH, BAR0, 4) + b'\x01'.ljust(8, b'\0'))
    R.check((wm is True and e == 0) or (wm is None and e == E.EINVAL), both(size, VU('Commands', 'REGION_WRITE_MULTI')),
            'write_multiple in a short request: REGION_WRITE_MULTI follows what the reply kept',
            'reply write_multiple=%s, REGION_WRITE_MULTI %s' % (wm, errname(e)))
    c.close()
    # a client offering a small max_data_xfer_size
    c = raw_client(env.sock)
    m = c.version({'max_data_xfer_size': 4096, 'max_msg_fds': 16})
    R.check(not m.is_error, SPEC('VERSION'), 'VERSION with max_data_xfer_size 4096 accepted', m.payload[4:])
    c.close()


def t_version_keys(env):
    R.sec('VERSION keys: types, unknown keys, twin_socket, max_msg_fds 0 (vfio-user.md § VERSION capabilities)')
    ver = VU('Commands', 'VERSION')
    twin = VU('VERSION capabilities', 'twin_socket; other keys')
    for caps, want, what in (({'write_multiple': 1}, E.EINVAL, 'write_multiple as a number'),
                             ({'pgsizes': '4096'}, E.EINVAL, 'pgsizes as a string'),
                             ({'max_data_xfer_size': -1}, E.EINVAL, 'max_data_xfer_size -1'),
                             ({'max_data_xfer_size': (1 << 32)}, E.EINVAL, 'max_data_xfer_size 2^32'),
                             ({'pgsizes': 4096 | (2 << 20)}, 0, 'pgsizes 4 KiB | 2 MiB')):
        c = raw_client(env.sock)
        R.errno(err_of(c.version(caps)), want, ver, 'VERSION %s' % what)
        c.close()
    c = raw_client(env.sock)
    m = c.version(raw=json.dumps({'capabilities': []}).encode() + b'\0')
    R.errno(err_of(m), E.EINVAL, twin, 'VERSION with "capabilities": [] (a known key of the wrong type)')
    c.close()
    c = raw_client(env.sock)
    m = c.version({'max_msg_fds': 16}, minor=5)
    mm = struct.unpack_from('<HH', m.payload) if not m.is_error else None
    R.check(not m.is_error and mm == (0, 0), both(ver, SPEC('VERSION')), 'VERSION minor 5 -> reply 0.0', mm or errname(m.error))
    c.close()
    # twin_socket and an unknown key: accepted and ignored, never offered
    c = raw_client(env.sock)
    m = c.version({'max_msg_fds': 16, 'twin_socket': {'supported': True}, 'some_future_key': [1, 2]})
    js = json.loads(m.payload[4:].rstrip(b'\0')) if not m.is_error and len(m.payload) > 4 else {}
    cap = js.get('capabilities', {})
    R.check(not m.is_error and 'twin_socket' not in cap and not m.fds, twin,
            'twin_socket accepted and ignored, never offered', errname(m.error) if m.is_error else js)
    R.check(not m.is_error and 'some_future_key' not in cap, twin,
            'an unknown key ("some_future_key") accepted and ignored', errname(m.error) if m.is_error else js)
    c.close()
    # max_msg_fds 0: nothing mappable
    c = raw_client(env.sock)
    m = c.version({'max_msg_fds': 0, 'max_data_xfer_size': 1 << 20})
    R.check(not m.is_error, ver, 'VERSION max_msg_fds 0 accepted', m.payload[4:])
    if not m.is_error:
        ri = c.region_info(BAR1, argsz=256)
        R.check(not ri['flags'] & (RI_MMAP | RI_CAPS) and not ri['fds'], VU('Commands', 'GET_REGION_INFO'),
                'max_msg_fds 0: BAR1 offered without MMAP, capability or fd', (hex(ri['flags']), ri['caps'], len(ri['fds'])))
        c.region_write(BAR1, 0, b'abc')
        R.eq(c.region_read(BAR1, 0, 3), b'abc', TD('BAR1'), 'BAR1 page 1 by messages')
    c.close()


# ######################################################################
# vfio-user.md § Framing
# ######################################################################
def t_framing(env):
    R.sec('Impossible headers close the connection (vfio-user.md § Framing)')
    fr = VU('Framing')
    for what, pre_version, hdr in (
            ('size 8 (< 16)', True, HDR.pack(1, DEVICE_GET_INFO, 8, 0, 0)),
            ('size 16 KiB + 1 before VERSION', True, HDR.pack(1, REGION_WRITE, 16 * 1024 + 1, 0, 0)),
            ('size 16 + 16 + 1 MiB + 1 after VERSION', False, HDR.pack(1, REGION_WRITE, 32 + (1 << 20) + 1, 0, 0))):
        c = raw_client(env.sock) if pre_version else new_session(env.sock)
        c.send_raw(hdr)
        R.check(c.wait_eof(), fr, 'a header with %s closes the connection' % what, c.eof_kind())
        c.close()
    c = new_session(env.sock)
    e = c.errno_of(REGION_WRITE, struct.pack('<QII', 0, BAR1, 1 << 20) + bytes(1 << 20))
    R.errno(e, E.EINVAL, both(fr, VU('Commands', 'REGION_WRITE')),
            'a REGION_WRITE of 1 MiB (within the message limit) to the 8 KiB BAR1: refused, not closed')
    R.check(c.alive(), fr, 'the connection goes on after it')
    c.send_raw(HDR.pack(c.next_id(), REGION_WRITE, 32 + (1 << 20) + 1, 0, 0) + struct.pack('<QII', 0, BAR1, (1 << 20) + 1))
    R.check(c.wait_eof(), fr, 'a REGION_WRITE carrying 1 MiB + 1 of data closes the connection', c.eof_kind())
    c.close()
    c = raw_client(env.sock)
    e = c.errno_of(REGION_WRITE, struct.pack('<QII', 0, BAR1, 16 * 1024 - 32) + bytes(16 * 1024 - 32))
    R.check(not c.eof, fr, 'a 16 KiB message before VERSION is framed (answered %s)' % errname(e))
    c.close()


def t_fds(env):
    R.sec('Which message fds belong to, fd limits, fds on commands (vfio-user.md § Framing: fds, fd limits, Which messages take fds)')
    fds_ref = VU('Framing', 'fds')
    c = new_session(env.sock)
    c.wr(CONFIG, 4, 6, 2)
    fd = memfd(0x20000)
    g = mmap.mmap(fd, 0x20000)
    # two sendmsgs back to back: an fd-less REGION_READ, then a DMA_MAP with its fd
    id1, id2 = c.next_id(), c.next_id()
    c.send_raw(HDR.pack(id1, REGION_READ, 32, 0, 0) + struct.pack('<QII', 0, BAR0, 4))
    c.send_raw(HDR.pack(id2, DMA_MAP, 48, 0, 0) + struct.pack('<IIQQQ', 32, 3, 0, 0x1000000, 0x10000), [fd])
    r1, r2 = c.wait_reply(id1), c.wait_reply(id2)
    R.check(not r1.is_error and not r2.is_error, fds_ref,
            'an fd-less REGION_READ and a DMA_MAP with its fd in sendmsgs of their own: both succeed', (r1, r2))
    n0 = len(c.server_reqs)
    st, res, saw = run_dma(c, 0x1000000, 16, 1, 0xab, what='fill')
    c.rd(BAR0, ISR, 4)
    R.check((st, res) == (2, 0) and g[0:16] == b'\xab' * 16 and len(c.server_reqs) == n0, fds_ref,
            '... and the DMA_MAP got its fd (a fill reached the memfd directly)', (fmt_dma(st, res), g[0:4], len(c.server_reqs) - n0))
    c.dma_unmap(0x1000000, 0x10000)
    # one sendmsg carrying a DMA_MAP and then a REGION_READ, with the fd
    id1, id2 = c.next_id(), c.next_id()
    c.send_raw(HDR.pack(id1, DMA_MAP, 48, 0, 0) + struct.pack('<IIQQQ', 32, 3, 0, 0x1000000, 0x10000) +
               HDR.pack(id2, REGION_READ, 32, 0, 0) + struct.pack('<QII', 0, BAR0, 4), [fd])
    r1, r2 = c.wait_reply(id1), c.wait_reply(id2)
    R.errno(err_of(r2), E.EINVAL, fds_ref,
            'DMA_MAP then REGION_READ in one sendmsg with an fd: the fd goes to the later REGION_READ, which takes none')
    R.errno(err_of(r1), 0, fds_ref, '... and the DMA_MAP left without its fd succeeds')
    if not r1.is_error:
        mem = bytearray(0x10000)
        c.mem.append((0x1000000, mem))
        g[0:16] = bytes(16)
        n0 = len(c.server_reqs)
        st, res, saw = run_dma(c, 0x1000000, 16, 1, 0xcd, what='fill')
        c.rd(BAR0, ISR, 4)
        reqs = c.server_reqs[n0:]
        R.check((st, res) == (2, 0) and g[0:16] == bytes(16) and mem[0:16] == b'\xcd' * 16 and reqs and
                all(m.cmd == DMA_WRITE for m in reqs), fds_ref,
                '... served as a mapping without fd (a fill goes by DMA_WRITE, the memfd is untouched)',
                (fmt_dma(st, res), g[0:2].hex(), mem[0:2].hex(), [m.cmd for m in reqs]))
        c.dma_unmap(0x1000000, 0x10000)
        c.mem.clear()
    # fds on commands that take none; more than max_msg_fds
    take = VU('Framing', 'Which messages take fds')
    ev = Ev()
    R.errno(c.errno_of(REGION_READ, struct.pack('<QII', 0, BAR0, 4), fds=[ev.dup()]), E.EINVAL, take, 'REGION_READ with an fd')
    R.errno(c.errno_of(DEVICE_GET_INFO, struct.pack('<IIII', 16, 0, 0, 0), fds=[ev.dup()]), E.EINVAL, take, 'DEVICE_GET_INFO with an fd')
    R.errno(c.errno_of(99, fds=[ev.dup()]), E.ENOSYS, take, 'an unknown command with an fd still gets ENOSYS')
    fds = [ev.dup() for _ in range(17)]
    e = c.errno_of(SET_IRQS, struct.pack('<IIIII', 20, DATA_EVENTFD | ACTION_TRIGGER, MSIX, 0, 2), fds=fds)
    for f in fds:
        os.close(f)
    R.errno(e, E.EINVAL, VU('Framing', 'fd limits'), 'SET_IRQS with 17 fds (max_msg_fds 16)')
    R.check(c.alive(), VU('Framing', 'fd limits'), 'the connection goes on')
    ev.close()
    g.close()
    os.close(fd)
    c.close()


# ######################################################################
# vfio-user.md § Commands: queries (DEVICE_GET_INFO, GET_REGION_INFO, GET_REGION_IO_FDS,
# GET_IRQ_INFO) and testdev.md § Regions
# ######################################################################
def t_info(env):
    R.sec('DEVICE_GET_INFO, GET_REGION_INFO, GET_REGION_IO_FDS, GET_IRQ_INFO (vfio-user.md § Commands; testdev.md § Regions)')
    gdi = VU('Commands', 'DEVICE_GET_INFO')
    gri = VU('Commands', 'GET_REGION_INFO')
    sizes = VU('Commands', 'Payload sizes')
    regions_ref = TD('Regions')
    c = new_session(env.sock)
    R.eq(c.device_info(), (16, 3, 9, 5), gdi, 'DEVICE_GET_INFO: argsz, flags PCI|RESET, 9 regions, 5 IRQ indexes')
    R.errno(c.errno_of(DEVICE_GET_INFO, struct.pack('<IIII', 24, 0, 0, 0) + bytes(8)), 0, sizes,
            'DEVICE_GET_INFO payload 24 with argsz 24 (extra bytes ignored)')
    R.errno(c.errno_of(DEVICE_GET_INFO, struct.pack('<IIII', 16, 0, 0, 0) + bytes(8)), E.EINVAL, sizes,
            'DEVICE_GET_INFO payload longer than its argsz')
    R.errno(c.errno_of(DEVICE_GET_INFO, struct.pack('<II', 16, 0)), E.EINVAL, gdi, 'DEVICE_GET_INFO payload < 16')
    R.errno(c.errno_of(DEVICE_GET_INFO, struct.pack('<IIII', 8, 0, 0, 0)), E.EINVAL, gdi, 'DEVICE_GET_INFO argsz < 16')

    want = {BAR0: (4096, RI_READ | RI_WRITE), BAR1: (8192, RI_READ | RI_WRITE | RI_MMAP | RI_CAPS),
            BAR2: (16, RI_READ | RI_WRITE), BAR3: (0, None), BAR4: (0, None), BAR5: (0, None),
            ROM: (0, None), VGA: (0, None), CONFIG: (256, RI_READ | RI_WRITE)}
    regions = {}
    for i in range(9):
        ri = c.region_info(i, argsz=32)
        for fd in ri['fds']:
            os.close(fd)
        if i == BAR1:
            R.check(ri['argsz'] > 32 and ri['payload_len'] == 32 and not ri['flags'] & RI_CAPS and not ri['fds'], gri,
                    'BAR1 with argsz 32: the 32-byte struct, argsz = the size needed, no CAPS flag, no fd',
                    'flags %#x fds %d len %d argsz %d' % (ri['flags'], len(ri['fds']), ri['payload_len'], ri['argsz']))
            R.check(ri['flags'] & RI_MMAP, both(gri, VU('Connections', 'Departures from the specification')),
                    'BAR1 with argsz 32: the cut-short answer keeps the MMAP flag', hex(ri['flags']))
            ri = c.region_info(i, argsz=ri['argsz'])
        regions[i] = ri
        R.info('region %d: size %#x flags %#x offset %#x cap_offset %d caps %s fds %d' % (
            i, ri['size'], ri['flags'], ri['offset'], ri['cap_offset'], ri['caps'], len(ri['fds'])))
        wsize, wflags = want[i]
        R.eq(ri['size'], wsize, regions_ref, 'region %d size' % i)
        if wflags is not None:
            R.eq(ri['flags'], wflags, both(regions_ref, gri), 'region %d flags' % i)
        elif ri['flags']:
            R.note(regions_ref, 'absent region %d has flags %#x' % (i, ri['flags']))
    b1 = regions[BAR1]
    R.check(len(b1['fds']) == 1, gri, 'the complete BAR1 answer carries the region fd', len(b1['fds']))
    caps = b1['caps']
    ok = len(caps) == 1 and caps[0]['id'] == 1 and caps[0]['version'] == 1 and caps[0].get('areas') == [(0, 4096)]
    R.check(ok, both(regions_ref, TD('BAR1')), 'BAR1 sparse-mmap capability (id 1, version 1): one area [0, 4096)', caps)
    R.check(b1['cap_offset'] >= 32, gri, 'BAR1 cap_offset >= 32', b1['cap_offset'])
    R.eq(b1['offset'], 0, TD('BAR1'), 'BAR1 file offset 0')
    for fd in b1['fds']:
        os.close(fd)
    for i in (BAR0, BAR2, CONFIG):
        R.check(not regions[i]['fds'], regions_ref, 'region %d comes without fd' % i, len(regions[i]['fds']))
    ri = c.region_info(BAR1, argsz=48)
    R.check(ri['payload_len'] == 32 and ri['argsz'] == 64 and not ri['fds'] and not ri['flags'] & RI_CAPS, gri,
            'BAR1 with argsz 48: cut short (32 bytes, argsz 64, no CAPS, no fd)',
            (ri['payload_len'], ri['argsz'], hex(ri['flags']), len(ri['fds'])))
    R.check(ri['flags'] & RI_MMAP, gri, 'BAR1 with argsz 48: MMAP stays set', hex(ri['flags']))
    m = c.request(GET_REGION_INFO, struct.pack('<IIIIQQ', 128, 0, BAR1, 0, 0, 0) + bytes(96))
    for fd in m.fds:
        os.close(fd)
    R.check(not m.is_error, sizes, 'GET_REGION_INFO with a payload as long as its argsz (128) accepted', m)
    R.errno(c.errno_of(GET_REGION_INFO, struct.pack('<IIIIQQ', 32, 0, 9, 0, 0, 0)), E.EINVAL, gri, 'GET_REGION_INFO index 9')
    R.errno(c.errno_of(GET_REGION_INFO, struct.pack('<IIIIQ', 32, 0, 0, 0, 0)), E.EINVAL, gri, 'GET_REGION_INFO payload 24 (< 32)')
    R.errno(c.errno_of(GET_REGION_INFO, struct.pack('<IIIIQQ', 16, 0, 0, 0, 0, 0)), E.EINVAL, gri, 'GET_REGION_INFO argsz 16 (< 32)')

    iofds = VU('Commands', 'GET_REGION_IO_FDS')
    m = c.request(GET_REGION_IO_FDS, struct.pack('<IIII', 16, 0, BAR0, 0))
    R.check(not m.is_error and struct.unpack_from('<IIII', m.payload)[3] == 0 and not m.fds, iofds,
            'GET_REGION_IO_FDS: count 0', m.payload.hex() if not m.is_error else errname(m.error))
    R.errno(c.errno_of(GET_REGION_IO_FDS, struct.pack('<IIII', 16, 1, BAR0, 0)), E.EINVAL, iofds, 'GET_REGION_IO_FDS flags != 0')
    R.errno(c.errno_of(GET_REGION_IO_FDS, struct.pack('<IIII', 16, 0, 12, 0)), E.EINVAL, iofds, 'GET_REGION_IO_FDS bad index')

    irq = both(TD('Config space', 'GET_IRQ_INFO'), VU('Commands', 'GET_IRQ_INFO'))
    want_irq = {INTX: (1, II_EVENTFD | II_MASKABLE | II_AUTOMASKED), MSI: (1, II_EVENTFD),
                MSIX: (2, II_EVENTFD | II_MASKABLE), ERR: (1, II_EVENTFD), REQ: (1, II_EVENTFD)}
    for i in range(5):
        argsz, flags, idx, count = c.irq_info(i)
        R.eq((argsz, idx, count, flags), (16, i) + want_irq[i], irq, 'GET_IRQ_INFO %d: (argsz, index, count, flags)' % i)
    R.errno(c.errno_of(GET_IRQ_INFO, struct.pack('<IIII', 16, 0, 5, 0)), E.EINVAL, VU('Commands', 'GET_IRQ_INFO'), 'GET_IRQ_INFO index 5')
    c.close()


# ######################################################################
# vfio-user.md § Commands: the rest of the table, error replies, Wire details
# ######################################################################
def t_commands(env):
    R.sec('Unknown and refused commands, posted requests, wire details, REGION_WRITE_MULTI (vfio-user.md § Commands)')
    cmds = VU('Commands')
    wire = VU('Commands', 'Wire details')
    posted = VU('Commands', 'error replies (posted requests get no reply)')
    c = new_session(env.sock)
    R.errno(c.errno_of(99), E.ENOSYS, VU('Commands', 'unknown command'), 'unknown command 99')
    m = c.request(0)
    R.errno(err_of(m), E.ENOSYS, VU('Commands', 'unknown command'), 'command 0')
    R.check(m.flags == 0x21 and m.size == 16, VU('Commands', 'error replies'), 'an error reply is a bare header with flags 0x21',
            (hex(m.flags), m.size))
    R.errno(c.errno_of(DMA_READ, struct.pack('<QQ', 0, 4)), E.EINVAL, VU('Commands', 'DMA_READ/DMA_WRITE from the client'), 'DMA_READ from the client')
    R.errno(c.errno_of(DMA_WRITE, struct.pack('<QQ', 0, 4) + bytes(4)), E.EINVAL, VU('Commands', 'DMA_READ/DMA_WRITE from the client'), 'DMA_WRITE from the client')
    R.errno(c.errno_of(DEVICE_FEATURE, struct.pack('<II', 8, 0x10001)), E.ENOTTY, VU('Commands', 'DEVICE_FEATURE'), 'DEVICE_FEATURE')
    for cmd in (DIRTY_PAGES, MIG_DATA_READ, MIG_DATA_WRITE):
        R.errno(c.errno_of(cmd, struct.pack('<II', 8, 0)), E.ENOTSUP, VU('Commands', 'DIRTY_PAGES, MIG_DATA_READ/WRITE'),
                'migration command %d' % cmd)
    R.errno(c.errno_of(DEVICE_RESET, b'\0\0\0\0'), E.EINVAL, VU('Commands', 'DEVICE_RESET'), 'DEVICE_RESET with a payload')
    m = c.request(DEVICE_RESET)
    R.check(not m.is_error and m.payload == b'', both(VU('Commands', 'DEVICE_RESET'), wire), 'DEVICE_RESET: an empty reply', m)
    mid = c.next_id()
    c.send_raw(HDR.pack(mid, DEVICE_GET_INFO, 32, 2, 0) + struct.pack('<IIII', 16, 0, 0, 0))
    R.errno(err_of(c.wait_reply(mid)), E.EINVAL, both(VU('Commands', 'unknown message type'), wire), 'message type 2')
    m = c.request(DEVICE_GET_INFO, struct.pack('<IIII', 16, 0, 0, 0), flags=0x40 | 0x100)
    R.check(not m.is_error, wire, 'unknown header flag bits ignored', m)
    c.send_raw(HDR.pack(0x7777, DMA_READ, 16, T_REPLY, 0))
    R.check(c.alive(), VU('Commands', 'a reply matching none of our requests'), 'a stray reply is dropped; the connection goes on')
    # posted (NO_REPLY) requests that fail: no reply. A round trip after each proves the
    # server has handled it (messages are handled in arrival order).
    for cmd, payload, what in ((REGION_READ, struct.pack('<QII', 0, BAR3, 4), 'REGION_READ of an absent region'),
                               (SET_IRQS, struct.pack('<IIIII', 20, DATA_NONE | ACTION_MASK, MSI, 0, 1), 'SET_IRQS MASK on MSI'),
                               (DMA_UNMAP, struct.pack('<IIQQ', 24, 0, 0x9000000, 0x1000), 'DMA_UNMAP of nothing mapped'),
                               (99, b'', 'unknown command 99')):
        mid = c.next_id()
        c.send_raw(HDR.pack(mid, cmd, 16 + len(payload), F_NO_REPLY, 0) + payload)
        c.barrier()
        R.check(not c.has_reply(mid), posted, 'a posted %s that fails gets no reply' % what)
    R.check(c.alive(), posted, 'alive after the posted errors')
    # REGION_WRITE_MULTI (negotiated on this connection)
    multi = VU('Commands', 'REGION_WRITE_MULTI')

    def ent(off, data):
        return struct.pack('<QII', off, BAR0, len(data)) + data.ljust(8, b'\0')
    m = c.request(REGION_WRITE_MULTI, struct.pack('<Q', 2) + ent(SCRATCH, b'\x11\x22\x33\x44') + ent(DMA_LEN, b'\x05\0\0\0'))
    R.check(not m.is_error and m.payload == struct.pack('<Q', 2), multi, 'REGION_WRITE_MULTI of 2 entries: reply = the 8-byte count',
            m.payload.hex() if not m.is_error else errname(m.error))
    R.eq((c.rd(BAR0, SCRATCH, 4), c.rd(BAR0, DMA_LEN, 4)), (0x44332211, 5), multi, 'both entries applied')
    m = c.request(REGION_WRITE_MULTI, struct.pack('<Q', 3) + ent(SCRATCH, b'\x01\0\0\0') + ent(SCRATCH, b'\x01\x02\x03') + ent(DMA_LEN, b'\x09\0\0\0'))
    R.check(m.is_error and m.error == E.EINVAL and m.size == 16, multi, 'a refused entry (3 bytes on BAR0) -> its errno, no count',
            (errname(m.error) if m.is_error else 'ok', m.size))
    R.eq((c.rd(BAR0, SCRATCH, 4), c.rd(BAR0, DMA_LEN, 4)), (1, 5), multi, 'the entries before it stay applied, the ones after it not')
    R.errno(c.errno_of(REGION_WRITE_MULTI, struct.pack('<Q', 0)), E.E2BIG, multi, 'REGION_WRITE_MULTI n = 0')
    R.errno(c.errno_of(REGION_WRITE_MULTI, struct.pack('<Q', 201) + ent(SCRATCH, b'\0\0\0\0') * 201), E.E2BIG, multi, 'REGION_WRITE_MULTI n = 201')
    R.errno(c.errno_of(REGION_WRITE_MULTI, struct.pack('<Q', 2) + ent(SCRATCH, b'\0\0\0\0')), E.EINVAL, multi, 'REGION_WRITE_MULTI size != 8 + 24n')
    R.errno(c.errno_of(REGION_WRITE_MULTI, struct.pack('<Q', 1) + struct.pack('<QII', SCRATCH, BAR0, 9) + bytes(8)), E.EINVAL, multi,
            'REGION_WRITE_MULTI entry count 9 (> 8)')
    # pipelining: 50 requests in flight, all answered
    ids = []
    for i in range(50):
        mid = c.next_id()
        ids.append(mid)
        c.send_raw(HDR.pack(mid, REGION_READ, 32, 0, 0) + struct.pack('<QII', 0, BAR0, 4))
    got = [c.wait_reply(i) for i in ids]
    R.check(all(not m.is_error for m in got), both(VU('Connections', 'Threads'), SPEC('Command Concurrency')),
            '50 pipelined requests all answered')
    R.check(c.alive(), cmds, 'alive after all the refusals')
    c.close()


# ######################################################################
# testdev.md § Identity, § Config space
# ######################################################################
def t_config(env):
    R.sec('Identity and config space (testdev.md § Identity, § Config space)')
    ident = TD('Identity')
    cs = TD('Config space')
    c = new_session(env.sock)
    cfg, caps = walk_caps(c)
    u16 = lambda o: struct.unpack_from('<H', cfg, o)[0]
    u32 = lambda o: struct.unpack_from('<I', cfg, o)[0]
    R.eq((u16(0), u16(2)), (0x1234, 0x75d1), ident, 'vendor/device')
    R.eq((u16(0x2c), u16(0x2e)), (0x1234, 0x75d1), ident, 'subsystem vendor/subsystem')
    R.eq(cfg[8], 1, ident, 'revision')
    R.eq((cfg[0xb], cfg[0xa], cfg[9]), (0xff, 0, 0), ident, 'class/subclass/prog-if')
    R.eq(cfg[0xe], 0, ident, 'header type')
    R.eq(cfg[0x3d], 1, ident, 'interrupt pin (INTA#)')
    R.eq(u32(0x30), 0, cs, 'expansion ROM BAR reads 0')
    R.check(u16(6) & 0x10, both(cs, 'PCI (capability list)'), 'STATUS capabilities-list bit', hex(u16(6)))
    R.eq([cid for cid, _ in caps], [0x01, 0x05, 0x11], cs, 'capability list order: PM, MSI, MSI-X')
    R.eq([p for _, p in caps], [0x40, 0x48, 0x58], cs, 'capability offsets ("they sit at 0x40, 0x48 and 0x58 today")')
    pos = dict(caps)
    pm, msi, msix = pos.get(1), pos.get(5), pos.get(0x11)
    if pm:
        pmc, pmcsr = u16(pm + 2), u16(pm + 4)
        R.eq(pmc & 7, 3, cs, 'PM version 3')
        R.eq(pmc & 0x600, 0, cs, 'PM: no D1/D2 support bits')
        R.eq(pmc >> 11, 0, cs, 'PM: no PME support')
        R.check(pmcsr & 0x8, cs, 'PM: No_Soft_Reset set', hex(pmcsr))
        R.eq(pmcsr & 3, 0, cs, 'PM: power state D0 at start')
        for st, want in ((1, 0), (2, 0), (3, 3), (0, 0)):
            c.wr(CONFIG, pm + 4, st, 2)
            R.eq(c.rd(CONFIG, pm + 4, 2) & 3, want, cs, 'PM: write D%d -> power state' % st)
    if msi:
        ctl = u16(msi + 2)
        R.eq(ctl & 1, 0, cs, 'MSI disabled at start')
        R.eq((ctl >> 1) & 7, 0, cs, 'MSI: 1 vector (Multiple Message Capable 0)')
        R.check(ctl & 0x80, cs, 'MSI: 64-bit address', hex(ctl))
        R.eq(ctl & 0x100, 0, cs, 'MSI: no per-vector masking')
        c.wr(CONFIG, msi + 2, 0x0071, 2)
        got = c.rd(CONFIG, msi + 2, 2)
        R.check(got & 1 and (got >> 4) & 7 == 0, cs, 'MSI: Multiple Message Enable not writable, reads 0 (wrote enable | MME 7)', hex(got))
        c.wr(CONFIG, msi + 2, 0, 2)
    if msix:
        ctl = u16(msix + 2)
        R.eq(ctl & 0x7ff, 1, cs, 'MSI-X table size 2 (N-1 = 1)')
        R.eq(ctl & 0xc000, 0, cs, 'MSI-X disabled and unmasked at start')
        R.eq(u32(msix + 4), 0x800, cs, 'MSI-X table: BAR0 offset 0x800 (BIR 0)')
        R.eq(u32(msix + 8), 0xc00, cs, 'MSI-X PBA: BAR0 offset 0xc00 (BIR 0)')
        R.eq(cfg[msix + 1], 0, cs, 'MSI-X is the last capability')
    # writable fields
    R.eq(u16(4), 0, TD('Reset, unmap, detach', 'DEVICE_RESET (power-on COMMAND 0)'), 'COMMAND 0 at start')
    c.wr(CONFIG, 4, 0xffff, 2)
    R.eq(c.rd(CONFIG, 4, 2), 0x0407, cs, 'COMMAND after writing 0xffff: only bits 0, 1, 2 and 10 are writable')
    c.wr(CONFIG, 4, 0x0006, 2)
    R.eq(c.rd(CONFIG, 4, 2), 0x0006, cs, 'COMMAND memory | bus master')
    st0 = c.rd(CONFIG, 6, 2)
    c.wr(CONFIG, 6, 0xffff, 2)
    R.eq(c.rd(CONFIG, 6, 2), st0, cs, 'STATUS after writing 0xffff (no error bit set, nothing else writable)')
    c.wr(CONFIG, 0, 0xffffffff, 4)
    R.eq(c.rd(CONFIG, 0, 4), 0x75d11234, cs, 'vendor/device read-only')
    c.wr(CONFIG, 0x0c, 0x10, 1)
    R.eq(c.rd(CONFIG, 0x0c, 1), 0x10, cs, 'cache line size writable')
    c.wr(CONFIG, 0x3c, 0x0b, 1)
    R.eq(c.rd(CONFIG, 0x3c, 1), 0x0b, cs, 'INTERRUPT_LINE writable')
    c.wr(CONFIG, 0x3d, 0x05, 1)
    R.eq(c.rd(CONFIG, 0x3d, 1), 1, cs, 'interrupt pin read-only')
    c.wr(CONFIG, 0x30, 0xffffffff, 4)
    R.eq(c.rd(CONFIG, 0x30, 4), 0, cs, 'ROM BAR stays 0 after all-ones')
    for bar, want in ((0, 0xfffff000), (1, 0xffffe000), (3, 0), (4, 0), (5, 0)):
        c.wr(CONFIG, 0x10 + 4 * bar, 0xffffffff, 4)
        R.eq(c.rd(CONFIG, 0x10 + 4 * bar, 4), want, both(cs, TD('Regions')), 'BAR%d all-ones sizing' % bar)
        c.wr(CONFIG, 0x10 + 4 * bar, 0, 4)
    c.wr(CONFIG, 0x18, 0xffffffff, 4)
    got = c.rd(CONFIG, 0x18, 4)
    R.check(got in (0xfffffff1, 0x0000fff1), both(cs, TD('Regions')), 'BAR2 (16-byte I/O) all-ones sizing', hex(got))
    c.wr(CONFIG, 0x10, 0xfebf0000, 4)
    R.eq(c.rd(CONFIG, 0x10, 4), 0xfebf0000, cs, 'BAR0 address bits writable')
    c.wr(CONFIG, 0x18, 0xc000, 4)
    R.eq(c.rd(CONFIG, 0x18, 4), 0xc001, cs, 'BAR2 I/O address writable')
    # PM D3hot -> D0 with No_Soft_Reset keeps the device's state
    if pm:
        c.wr(BAR0, SCRATCH, 0x5a5a, 4)
        c.wr(CONFIG, pm + 4, 3, 2)
        c.wr(CONFIG, pm + 4, 0, 2)
        R.eq(c.rd(BAR0, SCRATCH, 4), 0x5a5a, cs, 'PM D3hot -> D0 with No_Soft_Reset: SCRATCH kept')
    # BAR accesses whatever COMMAND's memory and I/O bits
    c.wr(CONFIG, 4, 0, 2)
    c.wr(BAR0, SCRATCH, 0x1234, 4)
    c.wr(BAR2, 0, 0x77, 4)
    R.eq((c.rd(BAR0, SCRATCH, 4), c.rd(BAR2, 0, 4)), (0x1234, 0x77), cs, 'BAR accesses work with COMMAND memory and I/O clear')
    # config space takes any size and alignment
    wire = VU('Commands', 'Wire details (region accesses)')
    R.eq(c.region_read(CONFIG, 1, 3), bytes(cfg[1:4]), wire, 'config read of 3 bytes at offset 1')
    R.eq(c.region_read(CONFIG, 0, 0), b'', wire, 'config read of 0 bytes accepted')
    R.errno(c.errno_of(REGION_READ, struct.pack('<QII', 255, CONFIG, 2)), E.EINVAL, VU('Commands', 'REGION_READ'), 'config read past 256 bytes')
    R.errno(c.errno_of(REGION_READ, struct.pack('<QII', 0, CONFIG, 257)), E.EINVAL, VU('Commands', 'REGION_READ'), 'config read of 257 bytes')
    R.eq(len(c.region_read(CONFIG, 0, 256)), 256, TD('Regions'), 'whole config space read (256 bytes)')
    c.close()


# ######################################################################
# testdev.md § BAR0 registers (access sizes, plain registers)
# ######################################################################
def t_bar0(env):
    R.sec('BAR0 registers and access sizes (testdev.md § BAR0 registers)')
    regs = TD('BAR0 registers')
    c = new_session(env.sock)
    R.eq(c.rd(BAR0, ID, 4), TESTDEV_ID, regs, 'ID')
    c.wr(BAR0, ID, 0, 4)
    R.eq(c.rd(BAR0, ID, 4), TESTDEV_ID, regs, 'ID read-only (write ignored)')
    c.wr(BAR0, SCRATCH, 0x11223344, 4)
    R.eq(c.rd(BAR0, SCRATCH, 4), 0x11223344, regs, 'SCRATCH 4-byte')
    c.wr(BAR0, SCRATCH + 1, 0xaa, 1)
    R.eq(c.rd(BAR0, SCRATCH, 4), 0x1122aa44, regs, 'SCRATCH 1-byte write at +1')
    c.wr(BAR0, SCRATCH + 2, 0xbbcc, 2)
    R.eq(c.rd(BAR0, SCRATCH, 4), 0xbbccaa44, regs, 'SCRATCH 2-byte write at +2')
    R.eq(c.rd(BAR0, SCRATCH + 3, 1), 0xbb, regs, '1-byte read at 0x07')
    R.eq(c.rd(BAR0, SCRATCH + 1, 2), 0xccaa, regs, '2-byte read at odd 0x05')
    R.eq(c.rd(BAR0, ID, 8), TESTDEV_ID | (0xbbccaa44 << 32), regs, '8-byte read at 0x00 (ID low, SCRATCH high)')
    c.wr(BAR0, ID, 0x5566778800000000, 8)
    R.eq(c.rd(BAR0, SCRATCH, 4), 0x55667788, regs, '8-byte write at 0x00 reaches SCRATCH')
    R.eq(c.rd(BAR0, 3, 2), (TESTDEV_ID >> 24) | (0x88 << 8), regs, '2-byte read straddling ID/SCRATCH at 0x03')
    for size in (3, 5, 6, 7, 16):
        R.errno(c.errno_of(REGION_READ, struct.pack('<QII', SCRATCH, BAR0, size)), E.EINVAL, regs, 'read of %d bytes' % size)
        R.errno(c.errno_of(REGION_WRITE, struct.pack('<QII', SCRATCH, BAR0, size) + bytes(size)), E.EINVAL, regs, 'write of %d bytes' % size)
    R.errno(c.errno_of(REGION_READ, struct.pack('<QII', SCRATCH, BAR0, 0)), E.EINVAL, regs, '0-byte read at 0x04 (outside the MSI-X table and PBA)')
    R.errno(c.errno_of(REGION_WRITE, struct.pack('<QII', SCRATCH, BAR0, 0)), E.EINVAL, regs, '0-byte write at 0x04 (outside the MSI-X table and PBA)')
    R.eq(c.rd(BAR0, SCRATCH, 4), 0x55667788, regs, 'the refused writes changed nothing')
    rr = VU('Commands', 'REGION_READ')
    R.errno(c.errno_of(REGION_READ, struct.pack('<QII', 0xffc, BAR0, 8)), E.EINVAL, rr, '8-byte read at 0xffc (past the end)')
    R.errno(c.errno_of(REGION_READ, struct.pack('<QII', 0x1000, BAR0, 4)), E.EINVAL, rr, 'read at 0x1000 (past the end)')
    for off in (0x30, 0x100, 0x7fc, 0xa00, 0xc08, 0xffc):
        c.wr(BAR0, off, 0xdeadbeef, 4)
        R.eq(c.rd(BAR0, off, 4), 0, regs, 'unlisted offset %#x reads 0 after a write' % off)
    R.eq(c.rd(BAR0, DMA_CMD, 4), 0, regs, 'DMA_CMD reads 0')
    R.eq(c.rd(BAR0, IRQ_RAISE, 4), 0, regs, 'IRQ_RAISE reads 0')
    c.wr(BAR0, DMA_STATUS, 0xff, 4)
    R.eq(c.rd(BAR0, DMA_STATUS, 4), 0, regs, 'DMA_STATUS read-only, idle')
    for off, name in ((DMA_ADDR_LO, 'DMA_ADDR_LO'), (DMA_ADDR_HI, 'DMA_ADDR_HI'), (DMA_LEN, 'DMA_LEN')):
        c.wr(BAR0, off, 0x12345678, 4)
        R.eq(c.rd(BAR0, off, 4), 0x12345678, regs, '%s read-write' % name)
        c.wr(BAR0, off, 0, 4)
    rw = VU('Commands', 'REGION_WRITE')
    c.region_write(BAR0, SCRATCH, b'\x01\x02\x03\x04', posted=True)
    R.eq(c.rd(BAR0, SCRATCH, 4), 0x04030201, rw, 'a posted REGION_WRITE is applied before the next request')
    R.errno(c.errno_of(REGION_WRITE, struct.pack('<QII', SCRATCH, BAR0, 4) + bytes(2)), E.EINVAL, rw, 'REGION_WRITE count 4 with 2 data bytes')
    R.errno(c.errno_of(REGION_WRITE, struct.pack('<QII', SCRATCH, BAR0, 2) + bytes(4)), E.EINVAL, rw, 'REGION_WRITE count 2 with 4 data bytes')
    m = c.request(REGION_WRITE, struct.pack('<QII', SCRATCH, BAR0, 4) + bytes(4))
    R.eq(m.payload, struct.pack('<QII', SCRATCH, BAR0, 4), rw, 'REGION_WRITE reply = the 16-byte fixed part')
    m = c.request(REGION_READ, struct.pack('<QII', ID, BAR0, 4) + bytes(8))
    R.check(not m.is_error and m.payload[16:] == TESTDEV_ID.to_bytes(4, 'little'), VU('Commands', 'Payload sizes'),
            'REGION_READ with 8 extra payload bytes (ignored)', m)
    R.errno(c.errno_of(REGION_READ, struct.pack('<QII', 0, BAR1, (1 << 20) + 1)), E.E2BIG, rr, 'REGION_READ count 1 MiB + 1')
    R.check(c.alive(), VU('Limits'), 'the connection goes on after E2BIG')
    R.errno(c.errno_of(REGION_WRITE, struct.pack('<QII', 0, BAR1, (1 << 20) + 1) + bytes(4)), E.E2BIG, rw,
            'REGION_WRITE count 1 MiB + 1 with 4 bytes of data (checked before the data)')
    c.close()


# ######################################################################
# testdev.md § Interrupt: INTx; ISR and IRQ_COUNT; vfio-user.md § Commands: SET_IRQS
# ######################################################################
def t_intx(env):
    R.sec('ISR, IRQ_COUNT, IRQ_RAISE, INTx and SET_IRQS (testdev.md § BAR0 registers, § Interrupt: INTx; vfio-user.md § Commands: SET_IRQS)')
    regs = TD('BAR0 registers')
    intx = TD('Interrupt', 'INTx')
    st3 = TD('Config space', 'STATUS bit 3')
    sirq = VU('Commands', 'SET_IRQS')
    c = new_session(env.sock)
    c.reset()
    R.eq(c.rd(BAR0, IRQ_COUNT, 4), 0, TD('Reset, unmap, detach', 'DEVICE_RESET'), 'IRQ_COUNT 0 after reset')
    R.eq(c.rd(BAR0, ISR, 4), 0, TD('Reset, unmap, detach', 'DEVICE_RESET'), 'ISR 0 after reset')
    c.wr(BAR0, IRQ_RAISE, 1, 4)
    R.eq(c.rd(BAR0, IRQ_COUNT, 4), 1, TD('Interrupt'), 'IRQ_COUNT after a raise')
    R.check(c.rd(CONFIG, 6, 2) & 0x8, st3, 'STATUS bit 3 while INTx is asserted (no eventfd wired)')
    R.eq(c.rd(BAR0, ISR, 4), 1, regs, 'ISR 1 after a raise')
    R.eq(c.rd(BAR0, ISR, 4), 0, regs, 'ISR read-to-clear')
    R.eq(c.rd(CONFIG, 6, 2) & 0x8, 0, st3, 'STATUS bit 3 clear after the ISR read')
    c.wr(BAR0, IRQ_RAISE, 0, 1)
    R.eq(c.rd(BAR0, ISR + 3, 1), 0, regs, '1-byte read at 0x2f (high byte of ISR) reads 0')
    R.eq(c.rd(BAR0, ISR, 4), 0, regs, '... and cleared ISR')
    c.wr(BAR0, IRQ_RAISE, 0, 2)
    R.eq(c.rd(BAR0, IRQ_COUNT, 8) >> 32, 1, regs, '8-byte read at 0x28 returns ISR in the high half')
    R.eq(c.rd(BAR0, ISR, 4), 0, regs, '... and cleared it')
    c.wr(BAR0, IRQ_RAISE, 0, 4)
    c.rd(BAR0, IRQ_COUNT + 3, 2)  # touches 0x2b..0x2c
    R.eq(c.rd(BAR0, ISR, 4), 0, regs, 'a 2-byte read at 0x2b touching ISR clears it')
    c.wr(BAR0, ISR, 0xffffffff, 4)
    R.eq(c.rd(BAR0, ISR, 4), 0, regs, 'ISR not writable')
    cnt = c.rd(BAR0, IRQ_COUNT, 4)
    c.wr(BAR0, IRQ_RAISE - 2, 0x01000000, 4)  # 4-byte write at 0x22 touching IRQ_RAISE
    R.eq(c.rd(BAR0, IRQ_COUNT, 4), cnt + 1, regs, 'a write at 0x22 touching IRQ_RAISE raises')
    c.rd(BAR0, ISR, 4)

    def raise_irq():
        c.wr(BAR0, IRQ_RAISE, 1, 4)

    def unmask():
        c.set_irqs(INTX, DATA_NONE | ACTION_UNMASK, 0, 1)

    ev = Ev()
    c.set_irqs(INTX, DATA_EVENTFD | ACTION_TRIGGER, 0, 1, fds=[ev.fd])
    R.eq(ev.take(0), 0, intx, 'no signal on wiring with the line low')
    raise_irq()
    R.eq(ev.take(1), 1, intx, 'the INTx eventfd is signalled on a raise')
    raise_irq()
    R.eq(ev.take(0), 0, intx, 'a second raise while asserted and automasked: no signal')
    R.eq(c.rd(BAR0, ISR, 4), 1, regs, 'ISR 1')
    unmask()
    R.eq(ev.take(0), 0, intx, 'an unmask with the line low: no signal')
    raise_irq()
    R.eq(ev.take(1), 1, intx, 'a raise after the unmask: a signal')
    unmask()
    R.eq(ev.take(1), 1, intx, 'an unmask while still asserted: another signal')
    c.rd(BAR0, ISR, 4)
    unmask()
    R.eq(ev.take(0), 0, intx, 'after the ISR read and an unmask: quiet')
    raise_irq()
    ev.take(1)
    c.rd(BAR0, ISR, 4)      # deassert
    raise_irq()             # assert again while automasked
    R.eq(ev.take(0), 0, intx, 'an assertion while automasked: no signal yet')
    unmask()
    R.eq(ev.take(1), 1, intx, 'the unmask while asserted: a signal')
    c.rd(BAR0, ISR, 4)
    unmask()
    c.set_irqs(INTX, DATA_NONE | ACTION_MASK, 0, 1)
    raise_irq()
    R.eq(ev.take(0), 0, sirq, 'INTx masked by SET_IRQS MASK: no signal')
    unmask()
    R.eq(ev.take(1), 1, sirq, 'UNMASK after MASK while asserted: a signal')
    c.rd(BAR0, ISR, 4)
    unmask()
    raise_irq()
    ev.take(1)
    c.set_irqs(INTX, DATA_BOOL | ACTION_UNMASK, 0, 1, data=b'\x01')
    R.eq(ev.take(1), 1, sirq, 'a DATA_BOOL unmask while asserted: a signal')
    c.rd(BAR0, ISR, 4)
    unmask()
    # COMMAND's INTx disable holds the signal
    cmd = c.rd(CONFIG, 4, 2)
    c.wr(CONFIG, 4, cmd | 0x400, 2)
    raise_irq()
    R.eq(ev.take(0), 0, intx, 'INTx disable set: the signal is held')
    R.check(c.rd(CONFIG, 6, 2) & 0x8, st3, 'STATUS bit 3 set while asserted under INTx disable')
    c.wr(CONFIG, 4, cmd & ~0x400, 2)
    R.eq(ev.take(1), 1, intx, 'INTx disable cleared: the held signal is delivered')
    c.rd(BAR0, ISR, 4)
    unmask()
    # the unmask eventfd
    ev2 = ev.dup()
    R.errno(c.errno_of(SET_IRQS, struct.pack('<IIIII', 20, DATA_EVENTFD | ACTION_UNMASK, INTX, 0, 1), fds=[ev2]), E.EINVAL, sirq,
            'an INTx unmask eventfd that is the trigger eventfd')
    os.close(ev2)
    ue = Ev()
    e = c.errno_of(SET_IRQS, struct.pack('<IIIII', 20, DATA_EVENTFD | ACTION_UNMASK, INTX, 0, 1), fds=[ue.fd])
    R.errno(e, 0, sirq, 'an INTx unmask eventfd (a separate eventfd)')
    if e == 0:
        raise_irq()
        R.eq(ev.take(1), 1, intx, 'a raise signals the trigger (and the line automasks)')
        c.rd(BAR0, ISR, 4)
        raise_irq()
        R.eq(ev.take(0), 0, intx, 'asserted again while automasked: no signal')
        os.eventfd_write(ue.fd, 1)
        R.eq(ev.take(1), 1, both(sirq, intx), 'signalling the unmask eventfd unmasks: the asserted line signals again')
        c.rd(BAR0, ISR, 4)
        e = c.errno_of(SET_IRQS, struct.pack('<IIIII', 20, DATA_EVENTFD | ACTION_UNMASK, INTX, 0, 1))
        R.errno(e, 0, sirq, 'a zero-fd EVENTFD UNMASK de-assigns the unmask eventfd')
    ue.close()
    unmask()
    e = c.errno_of(SET_IRQS, struct.pack('<IIIII', 20, DATA_EVENTFD | ACTION_TRIGGER, INTX, 0, 1))
    R.errno(e, 0, sirq, 'a zero-fd EVENTFD TRIGGER de-assigns the trigger')
    raise_irq()
    R.eq(ev.take(0), 0, sirq, 'no signal after the de-assign')
    c.rd(BAR0, ISR, 4)
    ev.close()
    # TRIGGER with DATA_NONE from the client: the docs list it but do not say what it does
    t = Ev()
    c.set_irqs(INTX, DATA_EVENTFD | ACTION_TRIGGER, 0, 1, fds=[t.fd])
    e = c.errno_of(SET_IRQS, struct.pack('<IIIII', 20, DATA_NONE | ACTION_TRIGGER, INTX, 0, 1))
    c.barrier()
    R.note(both(sirq, SPEC('SET_IRQS')), 'a client TRIGGER with DATA_NONE on INTx: %s, eventfd signalled %d time(s) (not documented)' % (
        errname(e), t.take(0)))
    c.set_irqs(INTX, DATA_NONE | ACTION_TRIGGER, 0, 0)
    t.close()
    c.rd(BAR0, ISR, 4)
    c.set_irqs(INTX, DATA_NONE | ACTION_UNMASK, 0, 1)

    # SET_IRQS refusals
    ev = Ev()
    for name, payload, fds, want in (
            ('two actions', struct.pack('<IIIII', 20, DATA_NONE | ACTION_MASK | ACTION_UNMASK, INTX, 0, 1), [], E.EINVAL),
            ('two data types', struct.pack('<IIIII', 20, DATA_NONE | DATA_BOOL | ACTION_MASK, INTX, 0, 1) + b'\1', [], E.EINVAL),
            ('flag bit 6', struct.pack('<IIIII', 20, 0x40 | DATA_NONE | ACTION_MASK, INTX, 0, 1), [], E.EINVAL),
            ('bools != count', struct.pack('<IIIII', 22, DATA_BOOL | ACTION_MASK, MSIX, 0, 1) + b'\1\1', [], E.EINVAL),
            ('fds != count', struct.pack('<IIIII', 20, DATA_EVENTFD | ACTION_TRIGGER, MSIX, 0, 2), [ev], E.EINVAL),
            ('fds without EVENTFD', struct.pack('<IIIII', 20, DATA_NONE | ACTION_TRIGGER, MSIX, 0, 1), [ev], E.EINVAL),
            ('start + count beyond the vectors', struct.pack('<IIIII', 20, DATA_NONE | ACTION_MASK, MSIX, 1, 2), [], E.EINVAL),
            ('start + count wraps', struct.pack('<IIIII', 20, DATA_NONE | ACTION_MASK, MSIX, 0xffffffff, 2), [], E.EINVAL),
            ('count 0 MASK', struct.pack('<IIIII', 20, DATA_NONE | ACTION_MASK, MSIX, 0, 0), [], E.EINVAL),
            ('MASK on ERR', struct.pack('<IIIII', 20, DATA_NONE | ACTION_MASK, ERR, 0, 1), [], E.EINVAL),
            ('MASK on REQ', struct.pack('<IIIII', 20, DATA_NONE | ACTION_MASK, REQ, 0, 1), [], E.EINVAL),
            ('MASK on MSI (no per-vector masking)', struct.pack('<IIIII', 20, DATA_NONE | ACTION_MASK, MSI, 0, 1), [], E.EINVAL),
            ('UNMASK on MSI', struct.pack('<IIIII', 20, DATA_NONE | ACTION_UNMASK, MSI, 0, 1), [], E.EINVAL),
            ('argsz 16', struct.pack('<IIIII', 16, DATA_NONE | ACTION_MASK, INTX, 0, 1), [], E.EINVAL),
            ('MASK with an eventfd', struct.pack('<IIIII', 20, DATA_EVENTFD | ACTION_MASK, MSIX, 0, 1), [ev], E.ENOTSUP),
            ('UNMASK with an eventfd on MSI-X', struct.pack('<IIIII', 20, DATA_EVENTFD | ACTION_UNMASK, MSIX, 0, 1), [ev], E.ENOTSUP),
            ('index 5', struct.pack('<IIIII', 20, DATA_NONE | ACTION_TRIGGER, 5, 0, 0), [], E.EINVAL),
            ('TRIGGER DATA_NONE count 0 at start 1', struct.pack('<IIIII', 20, DATA_NONE | ACTION_TRIGGER, INTX, 1, 0), [], E.EINVAL),
            ('payload of 16 bytes', struct.pack('<IIII', 20, DATA_NONE | ACTION_MASK, INTX, 0), [], E.EINVAL)):
        fds2 = [f.dup() for f in fds]
        e = c.errno_of(SET_IRQS, payload, fds=fds2)
        for f in fds2:
            os.close(f)
        R.errno(e, want, sirq, 'SET_IRQS %s' % name)
    r, w = os.pipe()
    R.errno(c.errno_of(SET_IRQS, struct.pack('<IIIII', 20, DATA_EVENTFD | ACTION_TRIGGER, INTX, 0, 1), fds=[r]), E.EINVAL, sirq,
            'SET_IRQS with a pipe instead of an eventfd')
    os.close(r)
    os.close(w)
    ev.close()
    R.errno(c.errno_of(SET_IRQS, struct.pack('<IIIII', 20, DATA_NONE | ACTION_TRIGGER, INTX, 0, 0)), 0, sirq,
            'TRIGGER DATA_NONE count 0 at start 0 (disables the index)')
    R.errno(c.errno_of(SET_IRQS, struct.pack('<IIIII', 20, DATA_NONE | ACTION_TRIGGER, ERR, 0, 0)), 0, sirq, 'disabling the ERR index')
    ev = Ev()
    R.errno(c.errno_of(SET_IRQS, struct.pack('<IIIII', 20, DATA_EVENTFD | ACTION_TRIGGER, REQ, 0, 1), fds=[ev.fd]), 0,
            TD('Config space', 'GET_IRQ_INFO (REQ 1 vector, EVENTFD)'), 'an eventfd on REQ accepted')
    ev.close()
    sizes = VU('Commands', 'Payload sizes')
    R.errno(c.errno_of(SET_IRQS, struct.pack('<IIIII', 1000, DATA_NONE | ACTION_MASK, INTX, 0, 1)), 0, sizes,
            'SET_IRQS with argsz 1000 and a 20-byte payload (only argsz >= 20 is checked)')
    R.errno(c.errno_of(SET_IRQS, struct.pack('<IIIII', 24, DATA_NONE | ACTION_UNMASK, INTX, 0, 1) + b'\xff' * 4), 0, sizes,
            'SET_IRQS DATA_NONE with 4 extra bytes (ignored)')
    ev = Ev(blocking=True)
    c.set_irqs(INTX, DATA_EVENTFD | ACTION_TRIGGER, 0, 1, fds=[ev.fd])
    fl = fcntl.fcntl(ev.fd, fcntl.F_GETFL)
    R.check(fl & os.O_NONBLOCK, sirq, 'a blocking eventfd passed with SET_IRQS is made non-blocking (shared file status flags)', hex(fl))
    c.set_irqs(INTX, DATA_NONE | ACTION_TRIGGER, 0, 0)
    ev.close()
    R.check(c.alive(), sirq, 'the connection is alive after the SET_IRQS refusals')
    c.close()


# ######################################################################
# testdev.md § Interrupt: MSI-X; MSI-X table and PBA
# ######################################################################
def t_msix(env):
    R.sec('MSI-X (testdev.md § Interrupt: MSI-X; § Config space; § BAR0 registers)')
    msx = TD('Interrupt', 'MSI-X')
    regs = TD('BAR0 registers')
    wire = VU('Commands', 'Wire details (region accesses)')
    c = new_session(env.sock)
    c.reset()
    ctl_off = cap_pos(c)[0x11] + 2
    for v in range(2):
        R.eq(c.rd(BAR0, MSIX_TABLE + 16 * v + 12, 4) & 1, 1, msx, 'MSI-X vector %d masked at reset' % v)
    c.wr(BAR0, MSIX_TABLE + 0, 0xfee00000, 4)
    c.wr(BAR0, MSIX_TABLE + 4, 0, 4)
    c.wr(BAR0, MSIX_TABLE + 8, 0x4041, 4)
    c.wr(BAR0, MSIX_TABLE + 16, 0xfee01000, 8)
    c.wr(BAR0, MSIX_TABLE + 24, 0x4042, 4)
    R.eq(c.rd(BAR0, MSIX_TABLE, 4), 0xfee00000, regs, 'MSI-X table entry 0 address read-write')
    R.eq(c.rd(BAR0, MSIX_TABLE + 8, 2), 0x4041, wire, 'MSI-X table 2-byte read')
    R.eq(c.rd(BAR0, MSIX_TABLE + 9, 1), 0x40, wire, 'MSI-X table 1-byte read at an odd offset')
    R.eq(c.rd(BAR0, MSIX_TABLE + 1, 3), 0xfee000, wire, 'MSI-X table 3-byte read (any size)')
    R.eq(c.region_read(BAR0, MSIX_TABLE + 4, 0), b'', wire, '0-byte read in the MSI-X table')
    R.errno(c.errno_of(REGION_WRITE, struct.pack('<QII', MSIX_TABLE, BAR0, 0)), 0, both(regs, wire), '0-byte write in the MSI-X table')
    for off, size, what in ((MSIX_TABLE + 8, 2, '2-byte write'), (MSIX_TABLE + 2, 4, 'unaligned 4-byte write'),
                            (MSIX_TABLE + 4, 8, 'unaligned 8-byte write'), (MSIX_TABLE + 8, 1, '1-byte write')):
        R.errno(c.errno_of(REGION_WRITE, struct.pack('<QII', off, BAR0, size) + bytes(size)), E.EINVAL, both(regs, wire),
                'MSI-X table %s' % what)
    R.eq(c.rd(BAR0, MSIX_TABLE + 8, 4), 0x4041, regs, 'the refused table writes changed nothing')
    edge = TD('Config space', 'an access that straddles the MSI-X table or PBA edge')
    R.errno(c.errno_of(REGION_READ, struct.pack('<QII', MSIX_TABLE + 0x1c, BAR0, 8)), E.EINVAL, edge, 'read straddling the end of the MSI-X table')
    R.errno(c.errno_of(REGION_READ, struct.pack('<QII', MSIX_TABLE - 4, BAR0, 8)), E.EINVAL, edge, 'read straddling the start of the MSI-X table')
    R.errno(c.errno_of(REGION_READ, struct.pack('<QII', MSIX_PBA + 4, BAR0, 8)), E.EINVAL, edge, 'read straddling the end of the PBA')
    R.eq(c.rd(BAR0, MSIX_PBA, 8), 0, regs, 'PBA 0 at start')
    R.eq(c.region_read(BAR0, MSIX_PBA + 3, 3), bytes(3), wire, 'PBA 3-byte read at +3')
    R.errno(c.errno_of(REGION_WRITE, struct.pack('<QII', MSIX_PBA, BAR0, 4) + b'\xff' * 4), 0, regs, 'a PBA write is accepted (and ignored)')
    R.eq(c.rd(BAR0, MSIX_PBA, 8), 0, regs, 'PBA unchanged by a write')
    R.errno(c.errno_of(REGION_WRITE, struct.pack('<QII', MSIX_PBA + 1, BAR0, 3) + b'\xff' * 3), 0, wire, 'a 3-byte PBA write accepted (ignored)')
    R.errno(c.errno_of(REGION_READ, struct.pack('<QII', MSIX_PBA + 1, BAR0, 0)), 0, regs, '0-byte read in the PBA')

    def pba():
        # pending bit 0; waits (up to WAIT) for it to be set, so that only a bit that never
        # comes reads 0
        return wait_reg(c, BAR0, MSIX_PBA, 4, lambda v: v & 1) & 1

    def vctl(v=0):
        return c.rd(BAR0, MSIX_TABLE + 16 * v + 12, 4) & 1

    def raise_irq():
        c.wr(BAR0, IRQ_RAISE, 1, 4)

    c.wr(CONFIG, 4, 0x0006, 2)
    c.wr(CONFIG, ctl_off, 0x8000, 2)
    R.eq(c.rd(CONFIG, ctl_off, 2) & 0xc7ff, 0x8001, TD('Config space'), 'MSI-X enable bit set')
    raise_irq()
    R.eq(pba(), 1, msx, 'a raise while vector 0 is masked sets PBA bit 0')
    R.eq(c.rd(BAR0, ISR, 4), 1, TD('Interrupt'), 'ISR set by a raise under MSI-X')
    R.eq(c.rd(CONFIG, 6, 2) & 8, 0, TD('Config space', 'STATUS bit 3'), 'STATUS bit 3 clear (INTx not used under MSI-X)')
    ev0, ev1 = Ev(), Ev()
    c.set_irqs(MSIX, DATA_EVENTFD | ACTION_TRIGGER, 0, 2, fds=[ev0.fd, ev1.fd])
    R.eq(vctl(), 0, msx, 'SET_IRQS wiring an eventfd unmasks vector 0 (Vector Control reads 0)')
    R.eq(ev0.take(1), 1, msx, 'the raise pending while vector 0 was masked is sent when SET_IRQS wires (and so unmasks) it')
    R.eq(wait_reg(c, BAR0, MSIX_PBA, 4, lambda v: not v & 1) & 1, 0, msx, '... and PBA bit 0 clears')
    raise_irq()
    R.eq(ev0.take(1), 1, msx, 'the vector 0 eventfd fires on a raise')
    R.eq(ev1.take(0), 0, TD('Interrupt'), 'vector 1 quiet (the device interrupt is vector 0)')
    raise_irq()
    raise_irq()
    R.eq(ev0.take(2), 2, msx, 'one message per raise (2 raises, 2 signals)')
    c.rd(BAR0, ISR, 4)
    # masked by Vector Control
    c.wr(BAR0, MSIX_TABLE + 12, 1, 4)
    raise_irq()
    raise_irq()
    R.eq(ev0.take(0), 0, msx, 'masked vector: no message')
    R.eq(pba(), 1, msx, 'masked vector: PBA bit 0')
    c.wr(BAR0, MSIX_TABLE + 12, 0, 4)
    R.eq(ev0.take(1), 1, msx, 'unmasking sends the pending message')
    R.eq(ev0.take(0), 0, TD('Interrupt', 'several raises held at once send one message'), '... one message for the two held raises')
    R.eq(wait_reg(c, BAR0, MSIX_PBA, 4, lambda v: not v & 1) & 1, 0, msx, 'PBA cleared after the delivery')
    # the function mask
    c.wr(CONFIG, ctl_off, 0xc000, 2)
    raise_irq()
    R.eq(ev0.take(0), 0, msx, 'function mask: no message')
    R.eq(pba(), 1, msx, 'function mask: PBA bit 0')
    c.wr(CONFIG, ctl_off, 0x8000, 2)
    R.eq(ev0.take(1), 1, msx, 'function unmask delivers')
    # bus mastering off: held
    c.wr(CONFIG, 4, 0x0002, 2)
    raise_irq()
    raise_irq()
    R.eq(ev0.take(0), 0, TD('DMA', 'Bus mastering'), 'bus mastering off: the MSI-X message is held')
    R.eq(pba(), 1, msx, 'a message held for bus mastering shows in the PBA')
    c.wr(CONFIG, 4, 0x0006, 2)
    R.eq(ev0.take(1), 1, TD('DMA', 'Bus mastering'), 'bus mastering on: the held message is sent')
    R.eq(ev0.take(0), 0, TD('Interrupt', 'several raises held at once send one message'), '... one message for the two raises')
    # SET_IRQS MASK / UNMASK on MSI-X
    R.errno(c.errno_of(SET_IRQS, struct.pack('<IIIII', 20, DATA_NONE | ACTION_MASK, MSIX, 0, 1)), 0, msx, 'SET_IRQS MASK of MSI-X vector 0')
    R.eq(vctl(), 1, msx, 'SET_IRQS MASK sets vector 0\'s Vector Control bit')
    raise_irq()
    R.eq(ev0.take(0), 0, msx, 'after SET_IRQS MASK a raise is not delivered')
    R.eq(pba(), 1, msx, '... and is pending in the PBA')
    R.errno(c.errno_of(SET_IRQS, struct.pack('<IIIII', 20, DATA_NONE | ACTION_UNMASK, MSIX, 0, 1)), 0, msx, 'SET_IRQS UNMASK of MSI-X vector 0')
    R.eq(vctl(), 0, msx, 'SET_IRQS UNMASK clears the Vector Control bit')
    R.eq(ev0.take(1), 1, msx, 'SET_IRQS UNMASK delivers the pending raise')
    # disabling MSI-X clears the PBA
    c.wr(BAR0, MSIX_TABLE + 12, 1, 4)
    raise_irq()
    R.eq(pba(), 1, msx, 'PBA set while masked')
    c.wr(CONFIG, ctl_off, 0, 2)
    R.eq(c.rd(BAR0, MSIX_PBA, 4), 0, msx, 'disabling MSI-X clears the PBA')
    c.wr(CONFIG, ctl_off, 0x8000, 2)
    c.wr(BAR0, MSIX_TABLE + 12, 0, 4)
    R.eq(ev0.take(0), 0, msx, 'nothing delivered after disable, enable and unmask')
    # the DMA completion interrupt goes to MSI-X vector 0
    c.rd(BAR0, ISR, 4)
    run_dma(c, 0, 0, 1, what='zero-length fill')
    R.eq(ev0.take(1), 1, both(TD('DMA'), TD('Interrupt')), 'the DMA completion interrupt arrives on MSI-X vector 0')
    # DATA_EVENTFD | ACTION_TRIGGER without fds (count > 0): unwire and mask
    c.set_irqs(MSIX, DATA_EVENTFD | ACTION_TRIGGER, 0, 1)
    R.eq(vctl(), 1, msx, 'EVENTFD TRIGGER with no fds masks vector 0')
    raise_irq()
    R.eq(ev0.take(0), 0, msx, 'unwired vector 0: no message')
    R.eq(pba(), 1, msx, '... the raise is pending (masked)')
    c.set_irqs(MSIX, DATA_EVENTFD | ACTION_TRIGGER, 0, 2, fds=[ev0.fd, ev1.fd])
    R.eq(ev0.take(1), 1, msx, 'rewiring vector 0 unmasks it and sends the pending raise')
    R.eq((vctl(0), vctl(1)), (0, 0), msx, 'both vectors unmasked by the wiring')
    c.set_irqs(MSIX, DATA_NONE | ACTION_TRIGGER, 0, 0)
    R.eq((vctl(0), vctl(1)), (1, 1), both(TD('Config space'), msx), 'removing them (DATA_NONE, count 0) masks every vector')
    raise_irq()
    R.eq(ev0.take(0), 0, TD('Config space'), 'no message after the removal')
    c.rd(BAR0, ISR, 4)
    # a raise while vector 0 is unmasked by the guest but has no eventfd: lost
    c.wr(CONFIG, ctl_off, 0, 2)          # clears the pending bit
    c.wr(CONFIG, ctl_off, 0x8000, 2)
    c.wr(BAR0, MSIX_TABLE + 12, 0, 4)
    raise_irq()
    R.eq(c.rd(BAR0, MSIX_PBA, 4), 0, msx, 'a raise while vector 0 is unmasked but unwired is lost (PBA 0)')
    c.set_irqs(MSIX, DATA_EVENTFD | ACTION_TRIGGER, 0, 1, fds=[ev0.fd])
    R.eq(ev0.take(0), 0, msx, '... wiring it afterwards delivers nothing')
    c.wr(CONFIG, ctl_off, 0, 2)
    ev0.close()
    ev1.close()
    c.close()


# ######################################################################
# testdev.md § Interrupt: MSI, and the choice of the device interrupt
# ######################################################################
def t_msi(env):
    R.sec('MSI, and which interrupt is "the device interrupt" (testdev.md § Interrupt)')
    ms = TD('Interrupt', 'MSI')
    c = new_session(env.sock)
    c.reset()
    msi = cap_pos(c)[5]
    c.wr(CONFIG, 4, 0x0006, 2)
    c.wr(CONFIG, msi + 4, 0xfee00000, 4)
    c.wr(CONFIG, msi + 8, 0, 4)
    c.wr(CONFIG, msi + 12, 0x4055, 2)
    c.wr(CONFIG, msi + 2, 0x0001, 2)
    R.eq(c.rd(CONFIG, msi + 2, 2) & 0x71, 0x01, TD('Config space'), 'MSI enabled, 1 vector (MME 0)')

    def raise_irq():
        c.wr(BAR0, IRQ_RAISE, 1, 4)
    raise_irq()             # no eventfd wired: lost
    c.rd(BAR0, ISR, 4)
    ev = Ev()
    c.set_irqs(MSI, DATA_EVENTFD | ACTION_TRIGGER, 0, 1, fds=[ev.fd])
    R.eq(ev.take(0), 0, ms, 'a raise while MSI is enabled but no eventfd is wired is lost, not held')
    raise_irq()
    R.eq(ev.take(1), 1, ms, 'the MSI eventfd fires on a raise')
    R.eq(c.rd(CONFIG, 6, 2) & 8, 0, TD('Config space', 'STATUS bit 3'), 'STATUS bit 3 clear under MSI')
    raise_irq()
    raise_irq()
    R.eq(ev.take(2), 2, ms, 'one message per raise (2 raises, 2 signals)')
    c.wr(CONFIG, 4, 0x0002, 2)
    raise_irq()
    raise_irq()
    R.eq(ev.take(0), 0, TD('DMA', 'Bus mastering'), 'MSI held while bus mastering is off')
    c.wr(CONFIG, 4, 0x0006, 2)
    R.eq(ev.take(1), 1, TD('DMA', 'Bus mastering'), 'the held MSI is sent once bus mastering is set')
    R.eq(ev.take(0), 0, TD('Interrupt', 'several raises held at once send one message'), '... one message for two raises')
    c.wr(CONFIG, 4, 0x0002, 2)
    raise_irq()
    c.wr(CONFIG, msi + 2, 0, 2)
    c.wr(CONFIG, 4, 0x0006, 2)
    c.wr(CONFIG, msi + 2, 1, 2)
    R.eq(ev.take(0), 0, ms, 'turning MSI off drops a message held for bus mastering')
    c.rd(BAR0, ISR, 4)
    evx = Ev()
    c.set_irqs(INTX, DATA_EVENTFD | ACTION_TRIGGER, 0, 1, fds=[evx.fd])
    raise_irq()
    got = (ev.take(1), evx.take(0))
    R.eq(got, (1, 0), TD('Interrupt'), 'MSI enabled: the device interrupt is MSI vector 0, not INTx (MSI, INTx signals)')
    c.rd(BAR0, ISR, 4)
    c.wr(CONFIG, msi + 2, 0, 2)
    raise_irq()
    got = (evx.take(1), ev.take(0))
    R.eq(got, (1, 0), TD('Interrupt'), 'MSI disabled: the device interrupt is INTx (INTx, MSI signals)')
    c.rd(BAR0, ISR, 4)
    ev.close()
    evx.close()
    c.close()


# ######################################################################
# testdev.md § DMA (memory mapped with an fd), § DMA: Bus mastering
# ######################################################################
def t_dma(env):
    R.sec('DMA through pinned memfds (testdev.md § DMA)')
    dma = TD('DMA')
    errs = TD('DMA', 'errnos in DMA_RESULT')
    bm = TD('DMA', 'Bus mastering')
    c = new_session(env.sock)
    c.reset()
    c.wr(CONFIG, 4, 0x0006, 2)
    SZ = 2 << 20
    fd = memfd(SZ)
    guest = mmap.mmap(fd, SZ, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    IOVA = 0x100000000
    c.dma_map(IOVA, SZ, DMA_R | DMA_W, fd=fd)
    dma_expect(c, IOVA + 0x1000, 0x3000, 1, 0xa5, 2, 0, dma, 'fill 12 KiB of memfd memory')
    R.check(guest[0x1000:0x4000] == b'\xa5' * 0x3000 and guest[0xfff] == 0 and guest[0x4000] == 0, dma,
            'the fill wrote exactly [addr, addr + len)')
    dma_expect(c, IOVA + 0x5001, 5, 1, 0x1234, 2, 0, dma, 'fill with pattern 0x1234 (odd address, 5 bytes)')
    R.eq(guest[0x5000:0x5007], b'\x00' + b'\x34' * 5 + b'\x00', TD('BAR0 registers', 'DMA_PATTERN'), 'the fill used the low byte only')
    data = bytes((i * 7 + 3) & 0xff for i in range(0x10000))
    guest[0x20000:0x30000] = data
    dma_expect(c, IOVA + 0x20000, 0x10000, 2, 0, 2, sum(data) & 0xffffffff, dma, 'checksum of 64 KiB')
    guest[0:SZ] = bytes(SZ)
    dma_expect(c, IOVA + 0x80000, 0x100000, 1, 0xff, 2, 0, TD('BAR0 registers', 'DMA_LEN'), 'fill of exactly 1 MiB (spanning pages)')
    dma_expect(c, IOVA + 0x80000, 0x100000, 2, 0, 2, (0xff * 0x100000) & 0xffffffff, dma, 'checksum of 1 MiB')
    # an 8-byte write at 0x14 starts a command with its high half
    st, res, saw = run_dma(c, IOVA + 0x40, 16, 1, 0x77, via8=True, what='8-byte write at 0x14')
    R.check((st, res) == (2, 0) and guest[0x40:0x50] == b'\x77' * 16, TD('BAR0 registers'),
            'an 8-byte write at 0x14: the pattern is its low half, the command its high half', (fmt_dma(st, res), guest[0x40:0x50]))
    c.rd(BAR0, ISR, 4)
    dma_expect(c, IOVA, 0, 1, 0x11, 2, 0, bm, 'fill of length 0')
    dma_expect(c, IOVA, 0x100001, 1, 0, 3, E.EINVAL, errs, 'fill of 1 MiB + 1')
    dma_expect(c, IOVA, 16, 3, 0, 3, E.EINVAL, errs, 'DMA_CMD 3')
    dma_expect(c, IOVA, 16, 0, 0, 3, E.EINVAL, errs, 'DMA_CMD 0')
    dma_expect(c, 0x900000000, 16, 1, 0, 3, E.EFAULT, errs, 'fill of an unmapped address')
    dma_expect(c, IOVA + SZ - 8, 16, 1, 0, 3, E.EFAULT, errs, 'fill running past the end of the mapping')
    dma_expect(c, 0xfffffffffffffff0, 0x20, 2, 0, 3, E.EFAULT, errs, 'checksum whose range wraps')
    # DMA_CMD holds no value: a write of part of it merges with 0
    merge = TD('DMA', 'DMA_CMD holds no value')
    c.wr(BAR0, DMA_ADDR_LO, IOVA & 0xffffffff, 4)
    c.wr(BAR0, DMA_ADDR_HI, IOVA >> 32, 4)
    c.wr(BAR0, DMA_LEN, 16, 4)
    for off, byte, want, what in ((DMA_CMD, 1, (2, 0), 'a 1-byte write of 1 at 0x18 is command 1 (fill)'),
                                  (DMA_CMD + 2, 0, (3, E.EINVAL), 'after a fill, a 1-byte write of 0 at 0x1a is command 0 (refused)'),
                                  (DMA_CMD + 1, 1, (3, E.EINVAL), 'a 1-byte write of 1 at 0x19 is command 0x100 (refused)')):
        if off == DMA_CMD + 2:
            run_dma(c, IOVA, 16, 1, 0x11, what='fill')
            c.rd(BAR0, ISR, 4)
        c.irq_before = c.rd(BAR0, IRQ_COUNT, 4)
        c.region_write(BAR0, off, bytes([byte]))
        st, res, saw = poll_dma(c, what)
        c.rd(BAR0, ISR, 4)
        R.check((st, res) == want, merge, what, fmt_dma(st, res))
    # refused at once, whatever bus mastering
    c.wr(CONFIG, 4, 0x0002, 2)
    dma_expect(c, IOVA, 16, 3, 0, 3, E.EINVAL, errs, 'a bad command with bus mastering off (refused at once)')
    dma_expect(c, IOVA, 0x100001, 1, 0, 3, E.EINVAL, errs, 'a length over 1 MiB with bus mastering off')
    c.wr(CONFIG, 4, 0x0006, 2)
    dma_expect(c, 0x9000000000, 0x100001, 1, 0, 3, E.EINVAL, errs, 'a length over 1 MiB at an unmapped address')
    # bus mastering off
    guest[0:16] = bytes(16)
    c.wr(CONFIG, 4, 0x0002, 2)
    dma_expect(c, IOVA, 16, 1, 0x99, 3, E.EACCES, both(errs, bm), 'fill with bus mastering off')
    R.eq(guest[0:16], bytes(16), bm, 'nothing written with bus mastering off')
    dma_expect(c, IOVA, 16, 2, 0, 3, E.EACCES, both(errs, bm), 'checksum with bus mastering off')
    dma_expect(c, IOVA, 0, 1, 0x99, 2, 0, bm, 'length 0 with bus mastering off')
    c.wr(CONFIG, 4, 0x0006, 2)
    # read-only and write-only mappings
    fd2 = memfd(0x10000, 'ro')
    ro = mmap.mmap(fd2, 0x10000, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    ro[0:0x10000] = b'\x02' * 0x10000
    RO = 0x200000000
    c.dma_map(RO, 0x10000, DMA_R, fd=fd2)
    dma_expect(c, RO, 0x100, 1, 0x55, 3, E.EPERM, errs, 'fill of a read-only mapping')
    R.eq(ro[0:0x100], b'\x02' * 0x100, errs, 'the read-only mapping is untouched')
    dma_expect(c, RO, 0x100, 2, 0, 2, 0x200, dma, 'checksum of a read-only mapping')
    fd3 = memfd(0x10000, 'wo')
    WO = 0x300000000
    c.dma_map(WO, 0x10000, DMA_W, fd=fd3)
    dma_expect(c, WO, 0x100, 2, 0, 3, E.EPERM, errs, 'checksum of a write-only mapping')
    dma_expect(c, WO, 0x100, 1, 0x3c, 2, 0, dma, 'fill of a write-only mapping')
    c.dma_unmap(0, 0, flags=UNMAP_ALL)
    # a range over two adjacent mappings of one memfd
    c.dma_map(0x1000000, 0x10000, fd=fd)
    c.dma_map(0x1010000, 0x10000, fd=fd, offset=0x10000)
    guest[0:0x20000] = bytes(0x20000)
    dma_expect(c, 0x100f000, 0x2000, 1, 0x22, 2, 0, dma, 'fill across two adjacent memfd mappings')
    R.eq(guest[0xf000:0x11000], b'\x22' * 0x2000, dma, 'both mappings filled')
    c.dma_unmap(0, 0, flags=UNMAP_ALL)
    # the client truncates the memfd behind a mapping
    tfd = memfd(0x10000, 'trunc')
    c.dma_map(0x1000000, 0x10000, fd=tfd)
    os.ftruncate(tfd, 0)
    st, res, saw = run_dma(c, 0x1000000, 0x1000, 2, 0, what='checksum of truncated')
    c.rd(BAR0, ISR, 4)
    R.check((st, res) == (3, E.EFAULT), errs, 'checksum of memory whose memfd the client truncated -> EFAULT', fmt_dma(st, res))
    st, res, saw = run_dma(c, 0x1000000, 0x1000, 1, 0x44, what='fill of truncated')
    c.rd(BAR0, ISR, 4)
    R.check((st, res) == (3, E.EFAULT), errs, 'fill of memory whose memfd the client truncated -> EFAULT', fmt_dma(st, res))
    R.check(c.alive(), errs, 'the server is alive after DMA into a truncated memfd')
    c.dma_unmap(0, 0, flags=UNMAP_ALL)
    guest.close()
    ro.close()
    for f in (fd, fd2, fd3, tfd):
        os.close(f)
    c.close()


# ######################################################################
# vfio-user.md § Commands: DMA_MAP, DMA_UNMAP
# ######################################################################
def fs_type(path):
    """The file system type of path, from /proc/self/mountinfo (None if unknown)."""
    path = os.path.realpath(path)
    best, kind = '', None
    try:
        with open('/proc/self/mountinfo') as f:
            for line in f:
                left, _, right = line.partition(' - ')
                mnt = left.split()[4].replace('\\040', ' ')
                if (path == mnt or path.startswith(mnt.rstrip('/') + '/')) and len(mnt) >= len(best):
                    best, kind = mnt, right.split()[0]
    except OSError:
        return None
    return kind


DMA_MAP_FS_OK = {'tmpfs', 'hugetlbfs', 'ramfs', 'ext2', 'ext3', 'ext4', 'xfs', 'btrfs', 'f2fs', 'bcachefs'}
DMA_MAP_FS_REFUSED = {'overlay', 'fuse', 'fuseblk', 'virtiofs', 'nfs', 'nfs4', 'cifs', 'smb3', '9p', 'ceph',
                      'glusterfs', 'ecryptfs', 'aufs'}


def t_dma_map(env):
    R.sec('DMA_MAP and DMA_UNMAP (vfio-user.md § Commands: DMA_MAP, DMA_UNMAP)')
    dmap = VU('Commands', 'DMA_MAP')
    dunmap = VU('Commands', 'DMA_UNMAP')
    c = new_session(env.sock)
    c.wr(CONFIG, 4, 6, 2)
    SZ = 2 << 20
    fd = memfd(SZ)
    IOVA = 0x100000000
    m = c.request(DMA_MAP, struct.pack('<IIQQQ', 32, 3, 0, IOVA, SZ), fds=[fd])
    R.check(not m.is_error and m.payload == b'', both(dmap, VU('Commands', 'Wire details')), 'DMA_MAP of a memfd: success, an empty reply', m)
    R.errno(c.errno_of(DMA_MAP, struct.pack('<IIQQQ', 32, 3, 0, IOVA + 0x1000, 0x1000), fds=[os.dup(fd)]), E.EEXIST, dmap,
            'DMA_MAP overlapping an existing mapping')
    for name, payload, want in (
            ('size 0', struct.pack('<IIQQQ', 32, 3, 0, 0x500000000, 0), E.EINVAL),
            ('unaligned iova', struct.pack('<IIQQQ', 32, 3, 0, 0x500000800, 0x1000), E.EINVAL),
            ('unaligned size', struct.pack('<IIQQQ', 32, 3, 0, 0x500000000, 0x800), E.EINVAL),
            ('unaligned offset', struct.pack('<IIQQQ', 32, 3, 0x800, 0x500000000, 0x1000), E.EINVAL),
            ('no access flags', struct.pack('<IIQQQ', 32, 0, 0, 0x500000000, 0x1000), E.EINVAL),
            ('unknown flag 4', struct.pack('<IIQQQ', 32, 7, 0, 0x500000000, 0x1000), E.EINVAL),
            ('past EOF', struct.pack('<IIQQQ', 32, 3, SZ, 0x500000000, 0x1000), E.EINVAL),
            ('iova wraps', struct.pack('<IIQQQ', 32, 3, 0, 0xfffffffffffff000, 0x2000), E.EINVAL),
            ('argsz 24', struct.pack('<IIQQQ', 24, 3, 0, 0x500000000, 0x1000), E.EINVAL),
            ('payload 24', struct.pack('<IIQQ', 32, 3, 0, 0x500000000), E.EINVAL),
            ('payload > argsz', struct.pack('<IIQQQ', 32, 3, 0, 0x500000000, 0x1000) + bytes(8), E.EINVAL)):
        e = c.errno_of(DMA_MAP, payload, fds=[os.dup(fd)])
        R.errno(e, want, dmap, 'DMA_MAP %s' % name)
        if e == 0 and len(payload) >= 32:
            c.dma_unmap(struct.unpack_from('<Q', payload, 16)[0], struct.unpack_from('<Q', payload, 24)[0])
    R.errno(c.errno_of(DMA_MAP, struct.pack('<IIQQQ', 32, 3, 0, 0x500000000, 0x1000), fds=[os.dup(fd), os.dup(fd)]), E.EINVAL, dmap,
            'DMA_MAP with 2 fds')
    r, w = os.pipe()
    R.errno(c.errno_of(DMA_MAP, struct.pack('<IIQQQ', 32, 3, 0, 0x500000000, 0x1000), fds=[r]), E.EINVAL, dmap,
            'DMA_MAP of a pipe (not a regular file)')
    os.close(r)
    os.close(w)
    R.errno(c.errno_of(DMA_MAP, struct.pack('<IIQQQ', 40, 3, 0, 0x500000000, 0x1000) + bytes(8), fds=[os.dup(fd)]), 0,
            VU('Commands', 'Payload sizes'), 'DMA_MAP payload 40 with argsz 40 (extra bytes ignored)')
    m = c.request(DMA_UNMAP, struct.pack('<IIQQ', 24, 0, 0x500000000, 0x1000))
    R.check(not m.is_error and m.payload == struct.pack('<IIQQ', 24, 0, 0x500000000, 0x1000), both(dunmap, VU('Commands', 'Wire details')),
            'the DMA_UNMAP reply carries the request\'s fields', m.payload.hex() if not m.is_error else errname(m.error))
    for flags, iova, size, argsz, extra, want, what in (
            (0, 0x500000000, 0x1000, 24, b'', E.ENOENT, 'DMA_UNMAP of nothing mapped'),
            (0, IOVA, 0x1000, 24, b'', E.EINVAL, 'DMA_UNMAP cutting a mapping'),
            (0, IOVA + 0x800, 0x1000, 24, b'', E.EINVAL, 'DMA_UNMAP unaligned'),
            (UNMAP_ALL, IOVA, SZ, 24, b'', E.EINVAL, 'DMA_UNMAP ALL with an address'),
            (4, IOVA, SZ, 24, b'', E.EINVAL, 'DMA_UNMAP unknown flag 4'),
            (UNMAP_DIRTY, IOVA, SZ, 24, b'', E.ENOTSUP, 'DMA_UNMAP with the dirty bitmap flag'),
            (0, IOVA, 0, 24, b'', E.EINVAL, 'DMA_UNMAP size 0'),
            (0, IOVA, SZ, 16, b'', E.EINVAL, 'DMA_UNMAP argsz 16')):
        m = c.request(DMA_UNMAP, struct.pack('<IIQQ', argsz, flags, iova, size) + extra)
        R.errno(err_of(m), want, dunmap, what)
    m = c.request(DMA_UNMAP, struct.pack('<IIQQ', 32, 0, IOVA, SZ) + bytes(8))
    R.check(not m.is_error and len(m.payload) <= 24 and struct.unpack_from('<I', m.payload)[0] <= 24, both(dunmap, VU('Commands', 'Wire details')),
            'DMA_UNMAP with argsz 32 (payload 32): the reply\'s argsz is at most 24', m.payload.hex() if not m.is_error else errname(m.error))
    if not m.is_error:
        dma_expect(c, IOVA, 16, 1, 0, 3, E.EFAULT, TD('DMA', 'errnos in DMA_RESULT'), 'fill after the DMA_UNMAP')
    c.dma_map(0x600000000, 0x1000, fd=os.dup(fd))
    c.dma_map(0x600001000, 0x1000, fd=os.dup(fd), offset=0x1000)
    R.errno(err_of(c.request(DMA_UNMAP, struct.pack('<IIQQ', 24, 0, 0x600000000, 0x2000))), 0, dunmap,
            'DMA_UNMAP of two whole mappings in one range')
    c.dma_map(0x700000000, 0x1000, fd=os.dup(fd))
    R.errno(c.errno_of(DMA_UNMAP, struct.pack('<IIQQ', 24, 0, 0x700000000, 0x1000), fds=[os.dup(fd)]), 0, dunmap,
            'DMA_UNMAP with an fd attached (closed unused)')
    c.dma_map(0x800000000, 0x10000, DMA_R, fd=os.dup(fd))
    R.errno(err_of(c.request(DMA_UNMAP, struct.pack('<IIQQ', 24, UNMAP_ALL, 0, 0))), 0, dunmap, 'DMA_UNMAP ALL')
    dma_expect(c, 0x800000000, 16, 2, 0, 3, E.EFAULT, TD('DMA', 'errnos in DMA_RESULT'), 'checksum after UNMAP ALL')
    R.errno(err_of(c.request(DMA_UNMAP, struct.pack('<IIQQ', 24, UNMAP_ALL, 0, 0))), 0, dunmap, 'DMA_UNMAP ALL with nothing mapped')
    # an O_RDONLY fd
    rofd = os.open('/proc/self/fd/%d' % fd, os.O_RDONLY)
    R.errno(c.errno_of(DMA_MAP, struct.pack('<IIQQQ', 32, 3, 0, 0x2000000, 0x10000), fds=[rofd]), E.EACCES, dmap,
            'DMA_MAP read-write of an O_RDONLY fd (mmap failure: its errno)')
    R.errno(c.errno_of(DMA_MAP, struct.pack('<IIQQQ', 32, 1, 0, 0x2000000, 0x10000), fds=[rofd]), 0, dmap,
            'DMA_MAP read-only of an O_RDONLY fd')
    os.close(rofd)
    c.dma_unmap(0, 0, flags=UNMAP_ALL)
    # a regular file in this run's directory: accepted on a local disk file system or tmpfs,
    # refused (EINVAL) on FUSE, a network or a stacked one
    path = env.path('dmafile.bin')
    with open(path, 'wb') as f:
        f.write(bytes(0x10000))
    kind = fs_type(path)
    ffd = os.open(path, os.O_RDWR)
    e = c.errno_of(DMA_MAP, struct.pack('<IIQQQ', 32, 3, 0, 0x4000000, 0x10000), fds=[ffd])
    if kind in DMA_MAP_FS_OK:
        R.errno(e, 0, dmap, 'DMA_MAP of a regular file on %s' % kind)
        if e == 0:
            st, res, saw = run_dma(c, 0x4000000, 0x2000, 1, 0x7e, what='fill of a file mapping')
            c.rd(BAR0, ISR, 4)
            R.check((st, res) == (2, 0) and os.pread(ffd, 4, 0x1ffc) == b'\x7e' * 4, dmap, 'a fill into the %s file mapping' % kind, fmt_dma(st, res))
    elif kind in DMA_MAP_FS_REFUSED:
        R.errno(e, E.EINVAL, dmap, 'DMA_MAP of a regular file on %s (FUSE, network or stacked)' % kind)
    else:
        R.note(dmap, 'DMA_MAP of a regular file on %s (a file system the docs do not name): %s' % (kind, errname(e)))
    if e == 0:
        c.dma_unmap(0x4000000, 0x10000)
    os.close(ffd)
    os.unlink(path)
    # DMA_UNMAP racing a 1 MiB fill of a memfd mapping
    race = TD('Reset, unmap, detach', 'DMA_UNMAP')
    c.dma_map(IOVA, SZ, fd=os.dup(fd))
    results = []
    busy = 0
    for i in range(5):
        start_dma(c, IOVA, 0x100000, 1, 0x5f)
        deadline = time.monotonic() + WAIT
        while True:
            m = c.request(DMA_UNMAP, struct.pack('<IIQQ', 24, 0, IOVA, SZ))
            if not (m.is_error and m.error == E.EBUSY) or time.monotonic() > deadline:
                break
            busy += 1      # pins not dropped within the unmap timeout: documented, try again
        st, res, saw = poll_dma(c, 'fill racing an unmap')
        results.append((errname(err_of(m)), st, errname(res) if st == ST_ERROR and res is not None else res))
        c.rd(BAR0, ISR, 4)
        c.dma_map(IOVA, SZ, fd=os.dup(fd))
    okset = {(2, 0)} | {(3, errname(x)) for x in (E.ECANCELED, E.EFAULT, E.EBUSY, E.EINVAL)}
    R.check(all(u == '0(ok)' and (s, r) in okset for u, s, r in results), race,
            'DMA_UNMAP racing a 1 MiB memfd fill: the unmap succeeds, the fill ends done or ECANCELED/EFAULT/EBUSY/EINVAL', results)
    if busy:
        R.note(race, 'the racing DMA_UNMAP got EBUSY %d time(s) before succeeding' % busy)
    c.dma_unmap(0, 0, flags=UNMAP_ALL)
    os.close(fd)
    c.close()


# ######################################################################
# vfio-user.md § Server-to-client DMA; testdev.md § DMA (memory mapped without an fd)
# ######################################################################
def settle_dma(c):
    """Before an attempt (and after a void one): let whatever command runs end, then run a
    zero-length fill and wait for its interrupt. The device's worker runs one command at a
    time, so every interrupt of an earlier command has been raised by then."""
    c.dma_policy = 'answer'
    c.release_held()
    wait_until(lambda: c.rd(BAR0, DMA_STATUS, 4) != ST_BUSY)
    run_dma(c, 0, 0, 1, what='zero-length fill (settle)')
    c.rd(BAR0, ISR, 4)


def t_client_dma(env):
    R.sec('DMA through DMA_READ/DMA_WRITE messages (vfio-user.md § Server-to-client DMA; testdev.md § DMA)')
    sdma = VU('Server-to-client DMA')
    chunks = VU('Server-to-client DMA', 'Chunking')
    accepts = VU('Server-to-client DMA', 'Replies the server accepts')
    dma = TD('DMA')
    errs = TD('DMA', 'errnos in DMA_RESULT')
    wire = VU('Commands', 'Wire details')
    c = new_session(env.sock)
    c.wr(CONFIG, 4, 0x0006, 2)
    MSZ = 0x200000
    MIOVA = 0x400000000
    mem = bytearray(MSZ)
    c.mem.append((MIOVA, mem))
    R.errno(c.errno_of(DMA_MAP, struct.pack('<IIQQQ', 32, DMA_R | DMA_W, 0, MIOVA, MSZ)), 0, VU('Commands', 'DMA_MAP'),
            'DMA_MAP without an fd (a message-only region)')
    dma_expect(c, MIOVA + 0x1000, 0x100, 1, 0x5a, 2, 0, dma, 'fill of fd-less memory')
    reqs = list(c.server_reqs)
    R.check(mem[0x1000:0x1100] == b'\x5a' * 0x100 and mem[0xfff] == 0 and mem[0x1100] == 0, dma,
            'the fill reached fd-less memory')
    R.check(reqs and all(m.cmd == DMA_WRITE for m in reqs), dma, 'the fill used DMA_WRITE messages', [(m.id, m.cmd) for m in reqs])
    if reqs:
        R.eq(reqs[0].id, 0, wire, "the server's first request of the session has id 0")
        R.eq(reqs[0].flags, 0, wire, "the server's request header flags (a command)")
    n0 = len(c.server_reqs)
    dma_expect(c, MIOVA, 0x100000, 1, 0xc3, 2, 0, dma, 'fill of 1 MiB of fd-less memory')
    reqs = c.server_reqs[n0:]
    counts = [struct.unpack_from('<QQ', m.payload)[1] for m in reqs]
    R.check(mem[:0x100000] == b'\xc3' * 0x100000 and mem[0x100000] == 0, dma, '1 MiB filled correctly')
    R.check(counts and max(counts) <= 0x10000 and sum(counts) == 0x100000, both(dma, chunks),
            'chunks of at most 64 KiB', '%d chunks, max %#x, sum %#x' % (len(counts), max(counts or [0]), sum(counts)))
    ids = [m.id for m in reqs]
    R.check(all(b == a + 1 for a, b in zip(ids, ids[1:])), wire, "the server's request ids count up", ids[:5])
    for i in range(0, 0x100000, 4096):
        mem[i:i + 4096] = bytes((j + i) & 0xff for j in range(4096)) if i % 0x20000 == 0 else b'\x01' * 4096
    want = sum(mem[0x10:0x100010]) & 0xffffffff
    n0 = len(c.server_reqs)
    dma_expect(c, MIOVA + 0x10, 0x100000, 2, 0, 2, want, dma, 'checksum of 1 MiB of fd-less memory')
    reqs = c.server_reqs[n0:]
    counts = [struct.unpack_from('<QQ', m.payload)[1] for m in reqs]
    R.check(reqs and all(m.cmd == DMA_READ for m in reqs) and max(counts) <= 0x10000, both(dma, chunks),
            'the checksum used DMA_READ chunks of at most 64 KiB', '%d chunks max %#x' % (len(counts), max(counts or [0])))
    R.check(all(len(m.payload) == 16 for m in reqs), SPEC('DMA_READ'), 'a DMA_READ request\'s payload is 16 bytes (address, count)',
            sorted(set(len(m.payload) for m in reqs)))
    for style, what in (('bare', 'a bare header (QEMU\'s)'), ('16', 'address and count in 16 bytes (libvfio-user\'s)'),
                        ('12', 'address and a 4-byte count, 12 bytes (the specification\'s)')):
        c.dma_write_reply = style
        st, res, saw = run_dma(c, MIOVA, 0x100, 1, 0x10, what='fill')
        c.rd(BAR0, ISR, 4)
        R.check((st, res) == (2, 0), accepts, 'a DMA_WRITE answered with %s is accepted' % what, fmt_dma(st, res))
    c.dma_write_reply = '16'
    for pol, err, want, what in (
            ('error', E.ENODEV, E.ENODEV, 'the client refuses a DMA_WRITE with ENODEV'),
            ('error', E.EPROTO, E.EPROTO, 'the client refuses a DMA_WRITE with EPROTO (the client\'s errno)'),
            ('error', 0, E.EIO, 'an error reply with errno 0 -> EIO'),
            ('malformed', 0, E.EIO, 'a malformed DMA_WRITE reply (the wrong address) -> EIO')):
        c.dma_policy = pol
        c.dma_errno = err
        dma_expect(c, MIOVA, 0x100, 1, 0x10, 3, want, both(errs, accepts), what)
    c.dma_policy = 'malformed'
    dma_expect(c, MIOVA, 0x100, 2, 0, 3, E.EIO, both(errs, accepts), 'a malformed DMA_READ reply (one byte short) -> EIO')
    c.dma_policy = 'answer'
    dma_expect(c, MIOVA, 0x100, 1, 0x11, 2, 0, errs, 'the next command runs normally')
    R.check(c.alive(), errs, 'the connection is alive after the malformed replies')

    # busy while a chunk is outstanding; DMA_CMD while busy is ignored
    def busy(a):
        settle_dma(c)
        mem[:0x20000] = bytes(0x20000)
        c.dma_policy = 'hold'
        cnt0 = c.rd(BAR0, IRQ_COUNT, 4)
        start_dma(c, MIOVA, 0x20000, 1, 0x61)
        c.wait_held()
        a.eq(c.rd(BAR0, DMA_STATUS, 4), ST_BUSY, dma, 'DMA_STATUS busy (1) while a chunk is outstanding')
        a.check(len(c.held) == 1, TD('Reset, unmap, detach', 'the chunk it was copying'), 'one chunk outstanding at a time', len(c.held))
        c.wr(BAR0, DMA_PATTERN, 0x62, 4)
        c.wr(BAR0, DMA_CMD, 2, 4)
        a.check(c.alive(), VU('Server-to-client DMA', 'Replies keep flowing'), 'requests are served while a DMA request is outstanding')
        c.dma_policy = 'answer'
        a.held(c.release_held())
        st, res, saw = poll_dma(c, 'busy fill')
        a.check((st, res) == (2, 0) and mem[:0x20000] == b'\x61' * 0x20000, dma,
                'a DMA_CMD written while busy is ignored; the first command finishes', fmt_dma(st, res))
        a.eq(wait_irq_count(c, cnt0 + 1) - cnt0, 1, dma, 'one completion interrupt')
        c.rd(BAR0, ISR, 4)
    attempt(dma, 'busy while a chunk is outstanding', busy)

    # a DMA_UNMAP of the range while a chunk is outstanding cancels the transfer
    def cancel(a):
        settle_dma(c)
        c.dma_unmap(0, 0, flags=UNMAP_ALL)
        c.dma_map(MIOVA, MSZ)
        mem[:] = bytes(MSZ)
        c.dma_policy = 'hold'
        cnt0 = c.rd(BAR0, IRQ_COUNT, 4)
        start_dma(c, MIOVA, 0x20000, 1, 0x66)
        c.wait_held()
        n0 = len(c.server_reqs)
        m = c.request(DMA_UNMAP, struct.pack('<IIQQ', 24, 0, MIOVA, MSZ))
        a.check(not m.is_error, TD('Reset, unmap, detach', 'DMA_UNMAP'),
                'DMA_UNMAP of the fd-less region succeeds while a chunk of a transfer there is outstanding', errname(err_of(m)))
        c.dma_policy = 'answer'
        a.held(c.release_held())
        st, res, saw = poll_dma(c, 'cancelled fill')
        a.check(st == ST_ERROR and res in (E.ECANCELED, E.EFAULT, E.EBUSY, E.EINVAL), TD('Reset, unmap, detach', 'DMA_UNMAP'),
                'a transfer overlapping an unmap ends with ECANCELED (or EFAULT/EBUSY/EINVAL)', fmt_dma(st, res))
        a.check(len(c.server_reqs) == n0 and mem[0x10000:0x20000] == bytes(0x10000), TD('Reset, unmap, detach', 'DMA_UNMAP'),
                'the transfer stopped before its next chunk', '%d more requests' % (len(c.server_reqs) - n0))
        a.eq(wait_irq_count(c, cnt0 + 1) - cnt0, 1, TD('Reset, unmap, detach', 'DMA_UNMAP'), 'the cancelled transfer raised the interrupt')
        c.rd(BAR0, ISR, 4)
    attempt(TD('Reset, unmap, detach', 'DMA_UNMAP'), 'DMA_UNMAP during a message transfer', cancel)

    # a read-only fd-less mapping
    settle_dma(c)
    c.dma_unmap(0, 0, flags=UNMAP_ALL)
    c.dma_map(MIOVA, 0x10000, DMA_R)
    n0 = len(c.server_reqs)
    dma_expect(c, MIOVA, 0x100, 1, 0x13, 3, E.EPERM, errs, 'fill of a read-only fd-less mapping')
    R.eq(len(c.server_reqs) - n0, 0, errs, 'no DMA_WRITE sent for a read-only fd-less mapping')
    c.dma_unmap(MIOVA, 0x10000)

    # a reply with an fd, and garbage in the high half of a DMA_READ reply's count
    def reply_fd(a):
        settle_dma(c)
        c.dma_unmap(0, 0, flags=UNMAP_ALL)
        mem[:0x10000] = b'\x03' * 0x10000
        c.dma_map(MIOVA, 0x10000)
        c.dma_policy = 'hold'
        start_dma(c, MIOVA, 0x100, 2)
        c.wait_held()
        m = c.held.pop()
        c.dma_policy = 'answer'
        addr, count = struct.unpack_from('<QQ', m.payload)
        ev = Ev()
        a.held(time.monotonic() - m.t_recv)
        c.send_raw(HDR.pack(m.id, DMA_READ, 32 + count, T_REPLY, 0) + struct.pack('<QQ', addr, count | (0xdead << 32)) +
                   bytes(mem[:count]), [ev.fd])
        ev.close()
        st, res, saw = poll_dma(c, 'checksum')
        c.rd(BAR0, ISR, 4)
        a.check((st, res) == (2, 0x300), both(VU('Framing', 'Which messages take fds'), accepts),
                'a DMA_READ reply with an fd attached and garbage in count\'s high 32 bits is accepted', fmt_dma(st, res))
    attempt(accepts, 'DMA_READ reply with an fd', reply_fd)

    # bus mastering cleared during a transfer
    def bm_off(a):
        settle_dma(c)
        c.wr(CONFIG, 4, 0x0006, 2)
        c.dma_unmap(0, 0, flags=UNMAP_ALL)
        mem[:0x40000] = bytes(0x40000)
        c.dma_map(MIOVA, 0x40000)
        c.dma_policy = 'hold'
        start_dma(c, MIOVA, 0x30000, 1, 0x44)
        c.wait_held()
        n0 = len(c.server_reqs)
        c.wr(CONFIG, 4, 0x0002, 2)
        c.dma_policy = 'answer'
        a.held(c.release_held())
        st, res, saw = poll_dma(c, 'fill losing bus mastering')
        c.rd(BAR0, ISR, 4)
        a.check((st, res) == (3, E.EACCES) and len(c.server_reqs) == n0 and mem[0x10000] == 0, errs,
                'bus mastering cleared during a transfer: EACCES, it stops before its next chunk',
                (fmt_dma(st, res), '%d more requests' % (len(c.server_reqs) - n0)))
        c.wr(CONFIG, 4, 0x0006, 2)
    attempt(errs, 'bus mastering cleared during a transfer', bm_off)

    # an fd mapping next to an fd-less one
    settle_dma(c)
    c.dma_unmap(0, 0, flags=UNMAP_ALL)
    fd = memfd(0x20000)
    g = mmap.mmap(fd, 0x20000)
    c.dma_map(0x1010000, 0x10000, fd=fd, offset=0x10000)
    side = bytearray(0x10000)
    c.mem.append((0x1020000, side))
    c.dma_map(0x1020000, 0x10000)
    dma_expect(c, 0x101f000, 0x2000, 1, 0x33, 2, 0, dma, 'fill across an fd mapping and an adjacent fd-less mapping')
    R.check(g[0x1f000:0x20000] == b'\x33' * 0x1000 and side[:0x1000] == b'\x33' * 0x1000, dma, 'both parts filled')
    c.dma_unmap(0, 0, flags=UNMAP_ALL)
    g.close()
    os.close(fd)

    # no reply at all: the command ends with ENOTCONN after the server's wait; a late reply
    # is dropped. (Only the outcome is checked, not how long the wait lasts.)
    c.dma_map(MIOVA, 0x10000)
    c.dma_policy = 'hold'
    start_dma(c, MIOVA, 0x100, 1, 0x12)
    c.wait_held()
    st, res, saw = poll_dma(c, 'unanswered fill', step=0.05)
    R.check((st, res) == (3, E.ENOTCONN), both(errs, VU('Server-to-client DMA', 'Timeout')),
            'a DMA_WRITE the client never answers ends the command with ENOTCONN', fmt_dma(st, res))
    c.dma_policy = 'answer'
    c.release_held()
    R.check(c.alive(), errs, 'the late reply is dropped; the connection goes on')
    c.rd(BAR0, ISR, 4)
    dma_expect(c, MIOVA, 0x100, 1, 0x12, 2, 0, errs, 'DMA works after the timeout')
    c.dma_unmap(0, 0, flags=UNMAP_ALL)
    c.close()


def t_client_dma_small(env):
    R.sec("A client offering max_data_xfer_size 4096 (vfio-user.md § Server-to-client DMA: Chunking; § Connections: Departures)")
    c = new_session(env.sock, {'max_msg_fds': 16, 'max_data_xfer_size': 4096})
    c.wr(CONFIG, 4, 0x0006, 2)
    mem = bytearray(0x20000)
    c.mem.append((0x10000000, mem))
    c.dma_map(0x10000000, 0x20000)
    st, res, saw = run_dma(c, 0x10000000, 0x10000, 1, 0x42, what='fill')
    counts = [struct.unpack_from('<QQ', m.payload)[1] for m in c.server_reqs]
    R.check((st, res) == (2, 0) and mem[:0x10000] == b'\x42' * 0x10000, TD('DMA'), 'fill of 64 KiB with a 4 KiB client limit', fmt_dma(st, res))
    R.check(counts and max(counts) <= 4096, VU('Server-to-client DMA', 'Chunking'), "chunks no larger than the client's max_data_xfer_size",
            '%d chunks max %#x' % (len(counts), max(counts or [0])))
    e = c.errno_of(REGION_READ, struct.pack('<QII', 0, BAR1, 8192))
    R.errno(e, 0, VU('Connections', 'Departures from the specification'),
            "an 8 KiB REGION_READ after offering 4096 (the server applies its own max_data_xfer_size)")
    c.close()


# ######################################################################
# testdev.md § BAR1, § BAR2 (I/O), absent regions (§ Regions)
# ######################################################################
def t_bar1(env):
    R.sec('BAR1: sparse mmap and messages (testdev.md § BAR1)')
    b1 = TD('BAR1')
    c = new_session(env.sock)
    ri = c.region_info(BAR1, argsz=256)
    if not ri['fds'] or not ri['caps']:
        R.check(False, VU('Commands', 'GET_REGION_INFO'), 'BAR1 comes with its fd and sparse-mmap capability', ri)
        c.close()
        return
    fd = ri['fds'][0]
    for extra in ri['fds'][1:]:
        os.close(extra)
    R.check(os.fstat(fd).st_size >= 8192, b1, 'the BAR1 fd is at least 8 KiB', os.fstat(fd).st_size)
    area_off, area_size = ri['caps'][0]['areas'][0]
    mm = mmap.mmap(fd, area_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=ri['offset'] + area_off)
    mm[0:16] = b'hello, testdev!!'
    R.eq(c.region_read(BAR1, 0, 16), b'hello, testdev!!', b1, 'REGION_READ sees what was written through the mapping')
    c.region_write(BAR1, 100, b'\xde\xad\xbe')
    R.eq(mm[100:103], b'\xde\xad\xbe', b1, 'the mapping sees a REGION_WRITE to the first page')
    c.region_write(BAR1, 4096, b'second page')
    R.eq(c.region_read(BAR1, 4096, 11), b'second page', b1, 'the second page by messages')
    c.region_write(BAR1, 4100, b'\x01\x02\x03\x04\x05')
    R.eq(c.region_read(BAR1, 4099, 7), b'o\x01\x02\x03\x04\x05g', b1, 'any access size (5 bytes at 4100, 7 at 4099)')
    R.eq(os.pread(fd, 11, 4096)[:3], b'sec', b1, 'the second page lives in the memfd at 4096')
    R.eq(len(c.region_read(BAR1, 4090, 12)), 12, b1, 'a read straddling the two pages')
    R.eq(len(c.region_read(BAR1, 0, 8192)), 8192, b1, 'a whole-BAR read')
    R.errno(c.errno_of(REGION_READ, struct.pack('<QII', 8190, BAR1, 4)), E.EINVAL, VU('Commands', 'REGION_READ'), 'a BAR1 read past the end')
    R.eq(c.region_read(BAR1, 10, 0), b'', b1, 'a BAR1 0-byte read ("any access size")')
    try:
        whole = mmap.mmap(fd, 8192, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        R.check(True, b1, 'the BAR1 fd can be mapped whole (8 KiB)')
        whole[4096:4100] = b'PG2!'
        R.eq(c.region_read(BAR1, 4096, 4), b'PG2!', b1, 'a write to the second page through the whole mapping is what REGION_READ reads')
        c.region_write(BAR1, 8000, b'msg')
        R.eq(whole[8000:8003], b'msg', b1, 'a REGION_WRITE to the second page shows in the whole mapping')
        whole.close()
    except OSError as ex:
        R.check(False, b1, 'the BAR1 fd can be mapped whole (8 KiB)', repr(ex))
    mm.close()
    os.close(fd)
    c.close()


def t_bar2(env):
    R.sec('BAR2 (I/O) and absent regions (testdev.md § BAR2 (I/O), § Regions)')
    b2 = TD('BAR2 (I/O)')
    c = new_session(env.sock)
    R.eq(c.rd(BAR2, 4, 4), TESTDEV_ID, b2, 'BAR2 ID')
    c.wr(BAR2, 0, 0xcafef00d, 4)
    R.eq(c.rd(BAR2, 0, 4), 0xcafef00d, b2, 'BAR2 SCRATCH')
    c.wr(BAR2, 1, 0x55, 1)
    R.eq(c.rd(BAR2, 0, 4), 0xcafe550d, b2, 'BAR2 1-byte write at 1')
    R.eq(c.rd(BAR2, 3, 2), (TESTDEV_ID & 0xff) << 8 | 0xca, b2, 'BAR2 2-byte read at 3 (straddling)')
    c.wr(BAR2, 4, 0, 4)
    R.eq(c.rd(BAR2, 4, 4), TESTDEV_ID, b2, 'BAR2 ID read-only')
    c.wr(BAR2, 8, 0xffffffff, 4)
    R.eq(c.rd(BAR2, 8, 4), 0, b2, 'BAR2 reserved reads 0')
    for size in (0, 3, 8):
        R.errno(c.errno_of(REGION_READ, struct.pack('<QII', 0, BAR2, size)), E.EINVAL, b2, 'BAR2 %d-byte read' % size)
        R.errno(c.errno_of(REGION_WRITE, struct.pack('<QII', 0, BAR2, size) + bytes(size)), E.EINVAL, b2, 'BAR2 %d-byte write' % size)
    R.errno(c.errno_of(REGION_READ, struct.pack('<QII', 14, BAR2, 4)), E.EINVAL, VU('Commands', 'REGION_READ'), 'BAR2 read past the end')
    for reg in (BAR3, BAR4, BAR5, ROM, VGA):
        R.errno(c.errno_of(REGION_READ, struct.pack('<QII', 0, reg, 4)), E.EPERM, TD('Regions'), 'REGION_READ of absent region %d' % reg)
        R.errno(c.errno_of(REGION_WRITE, struct.pack('<QII', 0, reg, 4) + bytes(4)), E.EPERM, TD('Regions'), 'REGION_WRITE of absent region %d' % reg)
    R.errno(c.errno_of(REGION_READ, struct.pack('<QII', 0, 9, 4)), E.EINVAL, VU('Commands', 'REGION_READ'), 'REGION_READ of region 9 (bad region)')
    c.close()


# ######################################################################
# testdev.md § Reset, unmap, detach: DEVICE_RESET
# ######################################################################
def t_reset(env):
    R.sec('DEVICE_RESET (testdev.md § Reset, unmap, detach)')
    rst = TD('Reset, unmap, detach', 'DEVICE_RESET')
    c = new_session(env.sock)
    power_on = c.region_read(CONFIG, 0, 256)     # a new client finds the device as after a reset
    pos = cap_pos(c)
    ri = c.region_info(BAR1, argsz=256)
    fd = ri['fds'][0]
    mm = mmap.mmap(fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    c.wr(BAR0, SCRATCH, 0x1234, 4)
    c.wr(BAR0, DMA_LEN, 0x55, 4)
    c.wr(BAR2, 0, 0x99, 4)
    c.wr(BAR0, IRQ_RAISE, 1, 4)
    c.wr(CONFIG, 4, 0x0407, 2)
    c.wr(CONFIG, 0x0c, 0x10, 1)
    c.wr(CONFIG, 0x10, 0xfebf0000, 4)
    c.wr(CONFIG, pos[5] + 2, 1, 2)
    c.wr(CONFIG, 0x3c, 0x0b, 1)
    c.wr(CONFIG, pos[1] + 4, 3, 2)
    c.wr(BAR0, MSIX_TABLE, 0xfee00000, 4)
    c.wr(BAR0, MSIX_TABLE + 8, 0x1234, 4)
    c.wr(BAR0, MSIX_TABLE + 12, 0, 4)
    mm[0:4] = b'abcd'
    c.region_write(BAR1, 5000, b'xyz')
    ev = Ev()
    c.set_irqs(INTX, DATA_EVENTFD | ACTION_TRIGGER, 0, 1, fds=[ev.fd])
    ev.take(0)
    c.reset()
    regs = [c.rd(BAR0, o, 4) for o in range(0x4, 0x30, 4)]
    R.eq(regs, [0] * len(regs), rst, 'every BAR0 register from 0x04 to 0x2c is 0 after a reset')
    R.eq(c.rd(BAR0, ID, 4), TESTDEV_ID, rst, 'the read-only ID keeps its value')
    R.eq((c.rd(BAR2, 0, 4), c.rd(BAR2, 4, 4)), (0, TESTDEV_ID), rst, 'BAR2 SCRATCH 0 (its ID stays)')
    tab = [c.rd(BAR0, MSIX_TABLE + o, 4) for o in range(0, 32, 4)]
    R.check(tab[0] == 0 and tab[2] == 0 and tab[3] & 1 and tab[7] & 1, rst, 'MSI-X table: address and data 0, mask bits 1',
            [hex(x) for x in tab])
    got = (bytes(mm[0:4]), c.region_read(BAR1, 5000, 3))
    R.eq(got, (bytes(4), bytes(3)), rst, 'BAR1 zeroed (both pages)')
    cfg = c.region_read(CONFIG, 0, 256)
    R.eq(struct.unpack_from('<H', cfg, 4)[0], 0, rst, 'COMMAND 0 after a reset')
    R.eq(struct.unpack_from('<I', cfg, 0x10)[0], 0, rst, 'BAR0 0 after a reset')
    R.eq(cfg[pos[5] + 2] & 1, 0, rst, 'MSI disabled after a reset')
    R.eq(cfg[0x3c], power_on[0x3c], rst, 'INTERRUPT_LINE back to its power-on value')
    diff = ['%#x: %#x != %#x' % (i, cfg[i], power_on[i]) for i in range(256) if cfg[i] != power_on[i]]
    R.check(not diff, rst, 'the whole config space is back to its power-on state (as a new client finds it)', diff[:8])
    R.eq(c.rd(CONFIG, 6, 2) & 8, 0, rst, 'INTx deasserted (STATUS bit 3)')
    c.wr(BAR0, IRQ_RAISE, 1, 4)
    R.eq(ev.take(0), 0, rst, 'the interrupt eventfds are dropped by a reset')
    c.rd(BAR0, ISR, 4)
    ev.close()
    mm.close()
    os.close(fd)

    # a reset while a DMA chunk is outstanding
    mem = bytearray(0x40000)
    c.mem.append((0x700000000, mem))

    def outstanding(a):
        settle_dma(c)
        c.reset()
        c.dma_unmap(0, 0, flags=UNMAP_ALL)
        mem[:] = bytes(len(mem))
        c.dma_map(0x700000000, 0x40000)
        c.wr(CONFIG, 4, 0x0006, 2)
        c.dma_policy = 'hold'
        start_dma(c, 0x700000000, 0x30000, 1, 0x31)
        c.wait_held()
        n0 = len(c.server_reqs)
        m = c.request(DEVICE_RESET)
        a.check(not m.is_error, rst, 'DEVICE_RESET returns while a DMA chunk is outstanding', m)
        c.dma_policy = 'answer'
        a.held(c.release_held())
        regs = (c.rd(BAR0, DMA_STATUS, 4), c.rd(BAR0, DMA_RESULT, 4), c.rd(BAR0, IRQ_COUNT, 4), c.rd(BAR0, ISR, 4))
        a.eq(regs, (0, 0, 0, 0), TD('Reset, unmap, detach'),
             'after resetting a running command: DMA_STATUS idle, DMA_RESULT, IRQ_COUNT and ISR 0 (no interrupt)')
        # the device's worker runs one command at a time: one started now ends after the cancelled one
        st, res, saw = run_dma(c, 0, 0, 1, what='zero-length fill after a reset')
        cnt = wait_irq_count(c, 1)
        a.check((st, res) == (2, 0) and cnt == 1, TD('Reset, unmap, detach'),
                'a command after the reset completes and its interrupt is the only one (the cancelled command raised none)',
                (fmt_dma(st, res), 'IRQ_COUNT %d' % cnt))
        a.check(mem[0x10000:0x30000] == bytes(0x20000) and len(c.server_reqs) == n0, TD('Reset, unmap, detach'),
                'the cancelled transfer did not go on past the chunk it was copying', '%d more requests' % (len(c.server_reqs) - n0))
        c.rd(BAR0, ISR, 4)
    attempt(TD('Reset, unmap, detach'), 'reset while a chunk is outstanding', outstanding)
    c.dma_unmap(0, 0, flags=UNMAP_ALL)
    c.close()


# ######################################################################
# vfio-user.md § Connections: One client per instance, Handover, Disconnect; testdev.md detach
# ######################################################################
def t_clients(env):
    R.sec('One client per instance, handover, detach (vfio-user.md § Connections; README.md § Serving devices to QEMU)')
    one = both(VU('Connections', 'One client per instance'), RM('Serving devices to QEMU', 'One client at a time'))
    hand = VU('Connections', 'Handover')
    detach = both(VU('Connections', 'Disconnect'), TD('Reset, unmap, detach', 'Detach'))

    def served(ref, what):
        """A new session, checked to be served (reconnecting if turned away, see _served)."""
        try:
            c = new_session(env.sock)
        except (Closed, OSError) as ex:
            R.check(False, ref, what, repr(ex))
            return None
        R.check(True, ref, what)
        if c.attempts > 1:
            R.note(hand, '%s: served on connection %d (the earlier ones were turned away, as the docs allow when the '
                         'cleanup outlasts the deadline)' % (what, c.attempts))
        return c

    c1 = new_session(env.sock)
    c1.wr(BAR0, SCRATCH, 0xabcdef, 4)
    ri = c1.region_info(BAR1, 256)
    ino1 = os.fstat(ri['fds'][0]).st_ino
    mm1 = mmap.mmap(ri['fds'][0], 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    for f in ri['fds']:
        os.close(f)
    mm1[0:4] = b'OLD!'
    c2 = connect(env.sock)
    try:
        payload = struct.pack('<HH', 0, 0) + json.dumps({'capabilities': {'max_msg_fds': 16}}).encode() + b'\0'
        c2.send_raw(HDR.pack(c2.next_id(), VERSION, 16 + len(payload), 0, 0) + payload)
    except OSError:
        pass        # already closed
    closed = c2.wait_eof()
    R.check(closed and not c2.replies and c2.eof_kind() in ('EOF', 'ECONNRESET'), one,
            'a second client while one is live is closed before any reply (end-of-file, or ECONNRESET once its VERSION had reached the server)',
            '%s, %d replies' % (c2.eof_kind(), len(c2.replies)))
    c2.close()
    R.check(c1.alive(), one, 'the first client is unaffected')
    # the first client leaves mid-header
    c1.send_raw(b'\x01\x00\x04')
    c1.close()
    c3 = served(both(hand, RM('Serving devices to QEMU', 'One client at a time')), 'a client after one that left mid-header is served')
    if c3 is None:
        mm1.close()
        return
    R.eq(c3.rd(BAR0, SCRATCH, 4), 0, detach, 'the device was reset on detach (SCRATCH 0)')
    ri = c3.region_info(BAR1, 256)
    ino3 = os.fstat(ri['fds'][0]).st_ino
    for f in ri['fds']:
        os.close(f)
    R.check(ino3 != ino1, TD('BAR1'), 'the new client gets a new BAR1 memfd', (ino1, ino3))
    R.eq(c3.region_read(BAR1, 0, 4), b'\0\0\0\0', TD('BAR1'), "the new BAR1 does not have the old mapping's bytes")
    mm1[0:4] = b'OLD2'
    R.eq(c3.region_read(BAR1, 0, 4), b'\0\0\0\0', TD('BAR1'), 'the old mapping no longer reaches the device')
    R.eq(c3.rd(BAR0, ID, 4), TESTDEV_ID, TD('BAR0 registers'), 'the new client works')
    mm1.close()
    c3.close()
    # a burst of connections that close at once, then a real client
    for _ in range(5):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(env.sock)
        s.close()
    c4 = served(hand, 'a client after a burst of connections that closed at once is served')
    if c4 is None:
        return
    # leave with DMA mappings, eventfds and a pending DMA_WRITE
    fd = memfd(0x10000)
    c4.dma_map(0x1000000, 0x10000, fd=fd)
    os.close(fd)
    ev = Ev()
    c4.set_irqs(INTX, DATA_EVENTFD | ACTION_TRIGGER, 0, 1, fds=[ev.fd])
    c4.mem.append((0x2000000, bytearray(0x10000)))
    c4.dma_map(0x2000000, 0x10000)
    c4.wr(CONFIG, 4, 6, 2)
    c4.dma_policy = 'hold'
    start_dma(c4, 0x2000000, 0x100, 1, 0)
    pending = c4.wait_held()
    R.check(pending, TD('DMA'), 'the leaving client has a DMA_WRITE pending')
    c4.close()
    c5 = served(hand, 'a client after one that left with mappings, eventfds and a pending DMA_WRITE is served')
    if c5 is None:
        ev.close()
        return
    R.eq((c5.rd(BAR0, DMA_STATUS, 4), c5.rd(BAR0, IRQ_COUNT, 4)), (0, 0), detach, 'the device was reset for the new client')
    R.errno(err_of(c5.request(DMA_UNMAP, struct.pack('<IIQQ', 24, 0, 0x1000000, 0x10000))), E.ENOENT, detach,
            "the previous client's mappings are gone")
    c5.wr(CONFIG, 4, 6, 2)
    st, res, saw = run_dma(c5, 0x1000000, 16, 1, 0, what='fill at the old IOVA')
    R.check((st, res) == (3, E.EFAULT), both(detach, TD('DMA', 'errnos in DMA_RESULT')),
            "DMA to the previous client's IOVA fails (EFAULT: not mapped)", fmt_dma(st, res))
    ev.close()
    c5.close()


# ######################################################################
# vfio-user.md § Limits, § Framing (a server started with small limits); default map count
# ######################################################################
def t_limits(env):
    R.sec('Limits (vfio-user.md § Limits, § Framing): default map count; a server with --max-data-xfer 4096 --max-dma-maps 8 --max-msg-fds 2')
    lim = VU('Limits')
    c = new_session(env.sock)
    n, err = 0, 0
    for i in range(4097):
        m = c.request(DMA_MAP, struct.pack('<IIQQQ', 32, 3, 0, 0x10000000 + i * 0x2000, 0x1000))
        if m.is_error:
            err = m.error
            break
        n += 1
    R.check(n == 4096 and err == E.ENOSPC, both(lim, VU('Commands', 'DMA_MAP')), 'the 4097th DMA_MAP (mappings without fd count too) gets ENOSPC',
            '%d mapped, then %s' % (n, errname(err)))
    c.dma_unmap(0, 0, flags=UNMAP_ALL)
    c.close()

    sock = env.path('limits.sock')
    p = env.start_server(sock, ['--max-data-xfer', '4096', '--max-dma-maps', '8', '--max-msg-fds', '2'], log='server-limits')
    try:
        c = raw_client(sock)
        major, minor, js, m = c.negotiate()
        cap = js['capabilities']
        R.eq((cap.get('max_data_xfer_size'), cap.get('max_dma_maps'), cap.get('max_msg_fds')), (4096, 8, 2),
             VU('VERSION capabilities', 'What the server offers'), "the offered limits are the instance's")
        R.errno(c.errno_of(REGION_READ, struct.pack('<QII', 0, BAR1, 4097)), E.E2BIG, lim, 'REGION_READ of 4097 bytes')
        R.eq(len(c.region_read(BAR1, 0, 4096)), 4096, lim, 'REGION_READ of 4096 bytes')
        for k in (5000, 16352):
            R.errno(c.errno_of(REGION_WRITE, struct.pack('<QII', 0, BAR1, k) + bytes(k)), E.E2BIG, VU('Framing'),
                    'REGION_WRITE carrying %d bytes (over the limit, at most 16352)' % k)
        R.check(c.alive(), VU('Framing'), 'the connection goes on')
        c.wr(CONFIG, 4, 6, 2)
        mem = bytearray(0x20000)
        c.mem.append((0x10000000, mem))
        c.dma_map(0x10000000, 0x20000)
        st, res, saw = run_dma(c, 0x10000000, 0x10000, 1, 0x42, what='fill')
        counts = [struct.unpack_from('<QQ', q.payload)[1] for q in c.server_reqs]
        R.check((st, res) == (2, 0) and counts and max(counts) <= 4096, VU('Server-to-client DMA', 'Chunking'),
                "the server's DMA chunks are no larger than its own max_data_xfer_size",
                '%s, %d chunks max %#x' % (fmt_dma(st, res), len(counts), max(counts or [0])))
        n, err = 1, 0
        for i in range(1, 9):
            q = c.request(DMA_MAP, struct.pack('<IIQQQ', 32, 3, 0, 0x20000000 + i * 0x2000, 0x1000))
            if q.is_error:
                err = q.error
                break
            n += 1
        R.check(n == 8 and err == E.ENOSPC, both(lim, VU('Commands', 'DMA_MAP')), '--max-dma-maps 8: the 9th DMA_MAP gets ENOSPC',
                '%d mapped, then %s' % (n, errname(err)))
        evs = [Ev() for _ in range(3)]
        R.errno(c.errno_of(SET_IRQS, struct.pack('<IIIII', 20, DATA_EVENTFD | ACTION_TRIGGER, MSIX, 0, 2), fds=[e.fd for e in evs[:2]]), 0,
                VU('Framing', 'fd limits'), 'SET_IRQS with 2 fds (= max_msg_fds)')
        R.errno(c.errno_of(SET_IRQS, struct.pack('<IIIII', 20, DATA_EVENTFD | ACTION_TRIGGER, MSIX, 0, 2), fds=[e.fd for e in evs]), E.EINVAL,
                VU('Framing', 'fd limits'), 'SET_IRQS with 3 fds (> max_msg_fds 2)')
        for e in evs:
            e.close()
        c.send_raw(HDR.pack(c.next_id(), REGION_WRITE, 32 + 16353, 0, 0) + struct.pack('<QII', 0, BAR1, 16353) + bytes(16353))
        R.check(c.wait_eof(), VU('Framing'), 'a REGION_WRITE carrying 16353 bytes closes the connection', c.eof_kind())
        c.close()
    finally:
        env.stop(p)


# ######################################################################
# README.md § Serving devices to QEMU (the daemon: start, stats, stop); counters named in
# vfio-user.md (protocol.rejected, stray_replies)
# ######################################################################
def t_daemon(env):
    R.sec('A daemon instance: start, stats counters, stop (README.md § Serving devices to QEMU; vfio-user.md § Connections, § Commands)')
    run, state = env.path('run'), env.path('state')
    d = env.spawn(['daemon', '--run-dir', run, '--state-dir', state], 'daemon')
    try:
        out = ''

        def started():
            nonlocal out
            if d.poll() is not None:
                return True
            p = subprocess.run([env.bin, 'start', '-t', 'testdev', '--run-dir', run, '--state-dir', state],
                               capture_output=True, text=True, timeout=WAIT + 60)
            out = p.stdout + p.stderr
            return p.returncode == 0
        wait_until(started, step=0.1)
        R.info('start: %s' % out.strip())
        mu = re.search(r'[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}', out)
        ms = re.search(r'(/\S+\.sock)', out)
        ok = R.check(mu and ms, RM('Serving devices to QEMU', 'umdev start'), 'start prints the UUID and its socket', out.strip()[:200])
        if not ok:
            return
        uuid, sock = mu.group(0), ms.group(1)
        c = new_session(sock)
        c2 = connect(sock)
        R.check(c2.wait_eof() and c2.eof_kind() in ('EOF', 'ECONNRESET'), VU('Connections', 'One client per instance'),
                'a second client is closed', c2.eof_kind())
        c2.close()
        c.send_raw(HDR.pack(0x4321, DMA_WRITE, 16, T_REPLY, 0))
        c.barrier()
        p = subprocess.run([env.bin, 'stop', '-u', uuid, '--run-dir', run], capture_output=True, text=True, timeout=WAIT + 60)
        R.check(p.returncode != 0, RM('Serving devices to QEMU', 'umdev stop'), 'stop is refused while a client is connected',
                (p.stdout + p.stderr).strip()[:200])
        found = {}

        def find(o, key, path=''):
            if isinstance(o, dict):
                for k, v in o.items():
                    if k == key:
                        yield path + k, v
                    yield from find(v, key, path + k + '.')

        def counted():
            p = subprocess.run([env.bin, 'stats', '-u', uuid, '--run-dir', run], capture_output=True, text=True, timeout=WAIT + 60)
            try:
                st = json.loads(p.stdout)
            except ValueError:
                return False
            found['stats'] = st
            found['rejected'] = list(find(st, 'rejected'))
            found['stray'] = list(find(st, 'stray_replies'))
            return any(k == 'protocol.rejected' and v >= 1 for k, v in found['rejected']) and any(v >= 1 for _, v in found['stray'])
        wait_until(counted, step=0.1)
        st = found.get('stats')
        R.check(any(k == 'protocol.rejected' and v >= 1 for k, v in found.get('rejected', [])), VU('Connections', 'One client per instance'),
                'stats: protocol.rejected counts the second client', found.get('rejected'))
        R.check(any(v >= 1 for _, v in found.get('stray', [])), VU('Commands', 'a reply matching none of our requests'),
                'stats: stray_replies counts the stray reply', found.get('stray'))
        R.check(st is not None and st.get('uuid') == uuid, RM('Serving devices to QEMU', 'umdev stats'), 'the stats JSON carries its uuid',
                st and st.get('uuid'))
        c.close()
        res = {}

        def stopped():
            p = subprocess.run([env.bin, 'stop', '-u', uuid, '--run-dir', run], capture_output=True, text=True, timeout=WAIT + 60)
            res['out'] = (p.stdout + p.stderr).strip()[:200]
            return p.returncode == 0
        ok = wait_until(stopped, step=0.05)
        R.check(ok and not os.path.exists(sock), RM('Serving devices to QEMU', 'umdev stop'),
                'stop succeeds once the client left; the socket is removed', res.get('out'))
    finally:
        env.stop(d)


# ######################################################################
# vfio-user.md § Connections: Sockets; README.md § Serving devices to QEMU: Stopping
# ######################################################################
def t_lifecycle(env):
    R.sec('Sockets and signals (vfio-user.md § Connections: Sockets; README.md § Serving devices to QEMU)')
    sockets = VU('Connections', 'Sockets')
    stopping = RM('Serving devices to QEMU', 'Stopping')
    R.eq(oct(os.stat(env.sock).st_mode & 0o777), oct(0o600), sockets, 'the socket is created mode 0600')
    p = subprocess.run([env.bin, 'run', '--type', 'testdev', '--socket', env.sock], capture_output=True, text=True, timeout=WAIT + 60)
    R.check(p.returncode != 0 and 'in use' in (p.stderr + p.stdout), sockets, 'a second server on a live socket is refused ("in use")',
            'rc %d: %s' % (p.returncode, (p.stderr + p.stdout).strip()[:200]))
    path = env.path('notasocket')
    open(path, 'w').close()
    p = subprocess.run([env.bin, 'run', '--type', 'testdev', '--socket', path], capture_output=True, text=True, timeout=WAIT + 60)
    R.check(p.returncode != 0 and os.path.isfile(path), sockets, 'a path that is not a socket is refused (and left alone)',
            'rc %d: %s' % (p.returncode, (p.stderr + p.stdout).strip()[:200]))
    os.unlink(path)
    path = env.path('stale.sock')
    p = env.start_server(path, log='server-stale')
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    R.check(os.path.exists(path), sockets, 'a SIGKILLed server leaves its socket file (the stale file for the next check)')
    p = env.start_server(path, log='server-stale', unlink=False)
    ok = False
    try:
        c = new_session(path)
        ok = c.rd(BAR0, ID, 4) == TESTDEV_ID
        c.close()
    except (Closed, OSError, VfioErr) as ex:
        ok = repr(ex)
    R.check(ok is True, sockets, 'a stale socket file left by a dead server is replaced at start', ok)
    rc = env.stop(p, signal.SIGINT)
    R.check(rc == 0 and not os.path.exists(path), stopping, 'SIGINT stops the server (status 0) and removes the socket',
            'rc %s, socket exists %s' % (rc, os.path.exists(path)))


# ######################################################################
# Checks over the whole run
# ######################################################################
def t_whole_run(env):
    R.sec('Over the whole run (vfio-user.md § Commands; testdev.md § DMA)')
    R.check(not BAD_REPLIES, both(VU('Commands', 'error replies'), SPEC('Header')),
            'every reply: the request\'s command, the reply type, an errno only with the error flag, error replies a bare header',
            BAD_REPLIES[:5])
    n = DMA_POLLS['commands']
    if n:
        R.check(not DMA_POLLS['idle_after_cmd'], TD('DMA', 'DMA_STATUS reads 1 from the moment the DMA_CMD write completes'),
                'DMA_STATUS never read idle (0) once a DMA_CMD write\'s reply had come (%d commands polled)' % n,
                DMA_POLLS['idle_after_cmd'][:5])


# ######################################################################
# Running it
# ######################################################################
GROUPS = [
    ('version', [t_pre_version, t_version_caps, t_version_keys]),
    ('framing', [t_framing, t_fds]),
    ('info', [t_info]),
    ('commands', [t_commands]),
    ('config', [t_config]),
    ('bar0', [t_bar0]),
    ('intx', [t_intx]),
    ('msix', [t_msix]),
    ('msi', [t_msi]),
    ('dma', [t_dma]),
    ('dmamap', [t_dma_map]),
    ('clientdma', [t_client_dma, t_client_dma_small]),
    ('bar1', [t_bar1]),
    ('bar2', [t_bar2]),
    ('reset', [t_reset]),
    ('clients', [t_clients]),
    ('limits', [t_limits]),
    ('daemon', [t_daemon]),
    ('lifecycle', [t_lifecycle]),
]


class Interrupted(BaseException):
    pass


def contract_main(name, description, groups, harness_of, env_of=lambda h: h, after_each=None, at_end=None,
                  kept='sockets and logs', setup_errors_abort=True):
    """The command line and run loop every contract script here shares: --bin, --socket-dir,
    --only, --list, --timeout and -q; exit 0, 1, 2 or 130 (module docstring); servers stopped
    and files removed on every exit path.

    harness_of(binary, socket_dir) makes the run's directory (a Harness or one like it);
    env_of(harness) is what each group function is given; after_each(env, fn) runs after each
    group function, at_end(env) after the last. A SetupError aborts the run, unless
    setup_errors_abort is False: then one raised by a group function only fails that function."""
    global WAIT
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument('--bin', default=os.environ.get('UMDEV_BIN', 'target/release/umdev'), help='the umdev binary')
    ap.add_argument('--socket-dir', default=None,
                    help='directory in which this run makes its own fresh directory (default: the system temp dir)')
    ap.add_argument('--only', default='', help='comma-separated test groups (see --list)')
    ap.add_argument('--list', action='store_true', help='list the test groups and exit')
    ap.add_argument('--timeout', type=float, default=WAIT, help='bound on every wait for an event, in seconds (default %(default)s)')
    ap.add_argument('-q', '--quiet', action='store_true', help='print only FAIL and NOTE lines and the summary')
    a = ap.parse_args()
    if a.list:
        for gname, fns in groups:
            print('%-10s %s' % (gname, ', '.join(f.__name__ for f in fns)))
        return 0
    WAIT = a.timeout
    R.quiet = a.quiet
    binary = os.path.abspath(a.bin)
    if not (os.path.isfile(binary) and os.access(binary, os.X_OK)):
        print('%s_contract: %s is not an executable (use --bin)' % (name, binary), file=sys.stderr)
        return 2
    only = set(filter(None, a.only.split(',')))
    unknown = only - {n for n, _ in groups}
    if unknown:
        print('%s_contract: unknown group(s) %s (see --list)' % (name, ', '.join(sorted(unknown))), file=sys.stderr)
        return 2
    if a.socket_dir:
        os.makedirs(a.socket_dir, exist_ok=True)

    def on_signal(signum, frame):
        raise Interrupted(signum)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    t0 = time.monotonic()
    h = None
    status = None
    try:
        h = harness_of(binary, a.socket_dir)
        # the daemon's instance sockets are <dir>/run/<uuid>.sock: within sun_path's 108 bytes?
        if len(h.path('run')) + len('/%s.sock' % ('0' * 36)) >= 108:
            raise SetupError('%s is too long a directory for UNIX socket paths; use a shorter --socket-dir' % h.dir)
        print('umdev %s contract: %s; %s in %s' % (name, binary, kept, h.dir), flush=True)
        env = env_of(h)
        for gname, fns in groups:
            if only and gname not in only:
                continue
            for fn in fns:
                try:
                    fn(env)
                except Exception as ex:
                    if setup_errors_abort and isinstance(ex, SetupError):
                        raise
                    traceback.print_exc()
                    R.check(False, 'harness', '%s aborted by an exception' % fn.__name__, traceback.format_exc().splitlines()[-1])
                if after_each:
                    after_each(env, fn)
        if at_end:
            at_end(env)
    except Interrupted:
        print('\ninterrupted: stopping the servers and removing the run directory', flush=True)
        status = 130
    except SetupError as ex:
        R.check(False, 'harness', 'setup', str(ex))
        status = 2 if not R.count('PASS') else None
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if h:
            if R.count('FAIL'):
                h.dump_logs()
            h.cleanup()
    fails = R.summary(time.monotonic() - t0)
    if status is not None:
        return status
    return 1 if fails else 0


def main():
    def started(env):
        env.main_srv = env.start_server(env.sock)
        return env

    def after_each(env, fn):
        if env.main_srv.poll() is not None:
            raise SetupError('the server exited (status %s) during %s' % (env.main_srv.returncode, fn.__name__))

    def at_end(env):
        t_whole_run(env)
        rc = env.stop(env.main_srv)
        R.check(rc == 0 and not os.path.exists(env.sock), RM('Serving devices to QEMU', 'Stopping'),
                'SIGTERM stops the server (status 0) and removes the socket', 'rc %s, socket exists %s' % (rc, os.path.exists(env.sock)))
    return contract_main('testdev', 'Contract test of `umdev run --type testdev`, written from the docs alone (see the module docstring).',
                         GROUPS, Harness, started, after_each, at_end, setup_errors_abort=False)


if __name__ == '__main__':
    sys.exit(main())
