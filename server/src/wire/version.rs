//! VERSION: the capability JSON a client offers, and the one the server answers with.
//!
//! The answer is trimmed to be no longer than the client's request: QEMU receives the reply
//! into its request buffer and fails realize if it does not fit. Optional keys are dropped,
//! least important first, until it fits.

use serde_json::{Map, Value};
use thiserror::Error;
use vm_memory::{ByteValued, Le16};

use super::structs::{read_struct, Version};
use super::Limits;

/// The only major version there is.
pub const MAJOR: u16 = 0;
/// The minor version this server speaks.
pub const MINOR: u16 = 0;
/// The page size the server works in, the only one in `pgsizes`.
pub const PAGE_SIZE: u64 = 4096;

/// Why a VERSION request was refused (errno EINVAL, or ENOTSUP for the major).
#[derive(Debug, Error, PartialEq, Eq)]
pub enum VersionError {
    /// Fewer than the 4 bytes of major and minor.
    #[error("VERSION payload of {0} bytes is too short")]
    Short(usize),
    /// A major version other than 0.
    #[error("unsupported major version {0}")]
    Major(u16),
    /// The capability string is not NUL-terminated.
    #[error("capabilities are not NUL-terminated")]
    NoNul,
    /// The capability string is not a JSON object of the expected shape.
    #[error("malformed capabilities: {0}")]
    Json(String),
    /// A capability has a value the server cannot work with.
    #[error("capability {key}: {why}")]
    Value {
        /// The key.
        key: &'static str,
        /// What is wrong.
        why: &'static str,
    },
}

impl VersionError {
    /// The errno for the error reply.
    pub fn errno(&self) -> i32 {
        match self {
            VersionError::Major(_) => libc::ENOTSUP,
            _ => libc::EINVAL,
        }
    }
}

/// What the client said about itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientCaps {
    /// The client's minor version.
    pub minor: u16,
    /// Most fds the client accepts per message (default 1).
    pub max_msg_fds: u32,
    /// Most data bytes the client accepts in one DMA_READ/DMA_WRITE (default 1 MiB).
    pub max_data_xfer_size: u32,
    /// The client asked for REGION_WRITE_MULTI.
    pub write_multiple: bool,
    /// Bytes of the client's request: the reply must not be longer.
    pub request_size: usize,
    /// The request held a `capabilities` object.
    pub capabilities: bool,
}

fn uint(caps: &Map<String, Value>, key: &'static str, max: u64) -> Result<Option<u64>, VersionError> {
    match caps.get(key) {
        None => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if n <= max => Ok(Some(n)),
            Some(_) => Err(VersionError::Value { key, why: "too large" }),
            None => Err(VersionError::Value { key, why: "not an unsigned integer" }),
        },
    }
}

/// Parses a VERSION payload (`major u16, minor u16, JSON + NUL`, the JSON optional).
/// `request_size` is the whole message's size.
pub fn parse_client(payload: &[u8], request_size: usize) -> Result<ClientCaps, VersionError> {
    let Some(fixed) = read_struct::<Version>(payload) else {
        return Err(VersionError::Short(payload.len()));
    };
    let (major, minor) = (fixed.major.to_native(), fixed.minor.to_native());
    if major != MAJOR {
        return Err(VersionError::Major(major));
    }
    let mut client = ClientCaps {
        minor,
        max_msg_fds: 1,
        max_data_xfer_size: 1 << 20,
        write_multiple: false,
        request_size,
        capabilities: false,
    };
    let json = &payload[size_of::<Version>()..];
    if json.is_empty() {
        return Ok(client);
    }
    let Some((&0, text)) = json.split_last() else {
        return Err(VersionError::NoNul);
    };
    let value: Value = serde_json::from_slice(text).map_err(|e| VersionError::Json(e.to_string()))?;
    let Value::Object(top) = value else {
        return Err(VersionError::Json("not an object".into()));
    };
    let caps = match top.get("capabilities") {
        None => return Ok(client),
        Some(Value::Object(caps)) => caps,
        Some(_) => return Err(VersionError::Json("capabilities is not an object".into())),
    };
    client.capabilities = true;
    if let Some(n) = uint(caps, "max_msg_fds", 1024)? {
        client.max_msg_fds = n as u32;
    }
    if let Some(n) = uint(caps, "max_data_xfer_size", u64::from(u32::MAX))? {
        if n == 0 {
            return Err(VersionError::Value { key: "max_data_xfer_size", why: "zero" });
        }
        client.max_data_xfer_size = n as u32;
    }
    if let Some(sizes) = uint(caps, "pgsizes", u64::MAX)? {
        if sizes & PAGE_SIZE == 0 {
            return Err(VersionError::Value { key: "pgsizes", why: "4 KiB pages not offered" });
        }
    }
    uint(caps, "max_dma_maps", u64::from(u32::MAX))?;
    match caps.get("migration") {
        None | Some(Value::Object(_)) => {}
        Some(_) => return Err(VersionError::Value { key: "migration", why: "not an object" }),
    }
    match caps.get("write_multiple") {
        None => {}
        Some(Value::Bool(b)) => client.write_multiple = *b,
        Some(_) => return Err(VersionError::Value { key: "write_multiple", why: "not a boolean" }),
    }
    match caps.get("twin_socket") {
        None | Some(Value::Object(_)) => {}
        Some(_) => return Err(VersionError::Value { key: "twin_socket", why: "not an object" }),
    }
    Ok(client)
}

/// What the server settled on with a client.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Negotiated {
    /// The client's side.
    pub client: ClientCaps,
    /// REGION_WRITE_MULTI is allowed.
    pub write_multiple: bool,
    /// The reply payload: major, minor, JSON + NUL.
    pub reply: Vec<u8>,
}

/// Builds the reply for `client`: major 0, minor 0, and as many capabilities as fit in the
/// client's request size.
pub fn negotiate(client: ClientCaps, limits: &Limits) -> Negotiated {
    let write_multiple = client.write_multiple;
    // Most important first; later entries are dropped first when the reply must shrink.
    let mut entries: Vec<(&str, Value)> = vec![
        ("max_msg_fds", Value::from(limits.max_msg_fds)),
        ("max_data_xfer_size", Value::from(limits.max_data_xfer_size)),
        ("pgsizes", Value::from(PAGE_SIZE)),
        ("max_dma_maps", Value::from(limits.max_dma_maps)),
        // No `migration`: the specification reads its absence as "migration is not supported
        // by the sender", which is the truth.
    ];
    if write_multiple {
        entries.insert(2, ("write_multiple", Value::Bool(true)));
    }
    let budget = client.request_size.saturating_sub(super::HEADER_SIZE + size_of::<Version>());
    let encode = |entries: &[(&str, Value)]| -> Vec<u8> {
        let caps: Map<String, Value> = entries.iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
        let mut text = serde_json::to_vec(&serde_json::json!({ "capabilities": caps })).unwrap_or_default();
        text.push(0);
        text
    };
    let mut reply = Vec::new();
    let mut write_multiple_kept = false;
    // An empty budget means the client sent no JSON: answer without JSON too.
    if budget > 0 {
        loop {
            let text = encode(&entries);
            if text.len() <= budget {
                write_multiple_kept = entries.iter().any(|(k, _)| *k == "write_multiple");
                reply = text;
                break;
            }
            if entries.pop().is_none() {
                break;
            }
        }
    }
    let fixed = Version { major: Le16::from(MAJOR), minor: Le16::from(MINOR) };
    let mut payload = Vec::with_capacity(size_of::<Version>() + reply.len());
    payload.extend_from_slice(fixed.as_slice());
    payload.extend_from_slice(&reply);
    Negotiated { client, write_multiple: write_multiple_kept, reply: payload }
}

/// The capabilities JSON QEMU 11.1.3's vfio-user-pci sends with VERSION, byte for byte: what
/// the server is tested against, and what test clients send.
pub const QEMU_11_CAPABILITIES: &str = r#"{"capabilities": {"pgsizes": 4096, "max_msg_fds": 16, "max_dma_maps": 65535, "max_data_xfer_size": 1048576, "migration": {"max_bitmap_size": 268435456, "pgsize": 4096}, "write_multiple": true}}"#;

#[cfg(test)]
mod tests {
    use super::*;

    const QEMU: &str = QEMU_11_CAPABILITIES;
    /// rust-vmm vfio_user 0.1.7's request.
    const RUST_VMM: &str =
        r#"{"capabilities":{"max_msg_fds":1,"max_data_xfer_size":1048576,"migration":{"pgsize":4096}}}"#;

    fn payload(major: u16, minor: u16, json: &[u8]) -> Vec<u8> {
        [&major.to_le_bytes()[..], &minor.to_le_bytes(), json].concat()
    }

    fn with_nul(s: &str) -> Vec<u8> {
        [s.as_bytes(), &[0]].concat()
    }

    #[test]
    fn qemu_gets_every_capability_in_a_reply_no_longer_than_its_request() {
        let p = payload(0, 0, &with_nul(QEMU));
        let size = 16 + p.len();
        assert_eq!(size, 214);
        let client = parse_client(&p, size).unwrap();
        assert!(client.write_multiple);
        assert_eq!(client.max_msg_fds, 16);
        let n = negotiate(client, &Limits::default());
        assert!(16 + n.reply.len() <= size);
        assert!(n.write_multiple);
        let json: Value = serde_json::from_slice(&n.reply[4..n.reply.len() - 1]).unwrap();
        let caps = &json["capabilities"];
        assert_eq!(caps["max_msg_fds"], 16);
        assert_eq!(caps["max_data_xfer_size"], 1 << 20);
        assert_eq!(caps["pgsizes"], 4096);
        assert_eq!(caps["max_dma_maps"], 4096);
        assert!(caps.get("migration").is_none(), "no migration is served");
        assert_eq!(caps["write_multiple"], true);
        assert_eq!(*n.reply.last().unwrap(), 0);
        assert_eq!(&n.reply[..4], &[0, 0, 0, 0]);
    }

    #[test]
    fn a_short_request_gets_a_trimmed_reply() {
        let p = payload(0, 1, &with_nul(RUST_VMM));
        let n = negotiate(parse_client(&p, 16 + p.len()).unwrap(), &Limits::default());
        assert!(n.reply.len() <= p.len());
        let json: Value = serde_json::from_slice(&n.reply[4..n.reply.len() - 1]).unwrap();
        assert_eq!(json["capabilities"]["max_msg_fds"], 16);
        assert!(!n.write_multiple);
        // Minor is never above the client's.
        assert_eq!(u16::from_le_bytes([n.reply[2], n.reply[3]]), 0);
    }

    #[test]
    fn no_json_gets_no_json() {
        let p = payload(0, 0, &[]);
        let n = negotiate(parse_client(&p, 20).unwrap(), &Limits::default());
        assert_eq!(n.reply, vec![0, 0, 0, 0]);
    }

    #[test]
    fn malformed_requests_are_refused() {
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (vec![0, 0], "short"),
            (payload(1, 0, &with_nul("{}")), "major"),
            (payload(0, 0, b"{}"), "no NUL"),
            (payload(0, 0, &with_nul("{")), "bad JSON"),
            (payload(0, 0, &with_nul("[]")), "not an object"),
            (payload(0, 0, &with_nul(r#"{"capabilities":"23"}"#)), "caps not object"),
            (payload(0, 0, &with_nul(r#"{"capabilities":{"max_msg_fds":"foo"}}"#)), "fds type"),
            (payload(0, 0, &with_nul(r#"{"capabilities":{"max_msg_fds":-1}}"#)), "fds negative"),
            (payload(0, 0, &with_nul(r#"{"capabilities":{"max_msg_fds":1025}}"#)), "fds too many"),
            (payload(0, 0, &with_nul(r#"{"capabilities":{"max_data_xfer_size":0}}"#)), "xfer zero"),
            (payload(0, 0, &with_nul(r#"{"capabilities":{"pgsizes":8192}}"#)), "no 4K"),
            (payload(0, 0, &with_nul(r#"{"capabilities":{"migration":"23"}}"#)), "migration"),
            (payload(0, 0, &with_nul(r#"{"capabilities":{"write_multiple":1}}"#)), "write_multiple"),
            (payload(0, 0, &with_nul("{\"a\":1}\u{0}x")), "NUL inside"),
        ];
        for (p, what) in cases {
            let err = parse_client(&p, 16 + p.len()).expect_err(what);
            let want = if what == "major" { libc::ENOTSUP } else { libc::EINVAL };
            assert_eq!(err.errno(), want, "{what}: {err}");
        }
        // Unknown keys and an empty object are fine.
        assert!(parse_client(&payload(0, 0, &with_nul(r#"{"capabilities":{"x":[1]},"y":2}"#)), 99).is_ok());
        assert!(parse_client(&payload(0, 0, &with_nul("{}")), 23).is_ok());
    }
}
