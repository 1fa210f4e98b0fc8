//! PolyGate wire protocol: message types, their byte encoding and the framing.
//!
//! No I/O policy lives here: a Rust client can depend on this crate alone.
//! The byte layout is documented for other languages in `bindings/PROTOCOL.md`.

pub mod codec;
mod fast;
pub mod framing;
pub mod messages;

pub use codec::{decode_client, decode_server, encode_client, encode_server, peek_id, CodecError};
pub use framing::{
    decode_client_payload, frame_size, length_codec, ClientCodec, FrameError, ServerCodec,
};
pub use messages::*;

/// The newest protocol version spoken by this crate.
pub const PROTOCOL_VERSION: u32 = 3;

/// The oldest protocol version a sidecar still accepts in `Hello`: version-1
/// clients keep working unchanged (DESIGN §11a).
pub const MIN_PROTOCOL_VERSION: u32 = 1;

/// Default and recommended maximum frame payload, in bytes.
pub const DEFAULT_MAX_FRAME: u32 = 65536;

/// Largest payload of a `Status` or `StatusJson` reply, whatever `max_frame` is: the
/// one exception to the frame limit (bindings/PROTOCOL.md §2), so a sidecar with
/// thousands of sources still answers status. Clients accept incoming frames up to
/// this size.
pub const MAX_STATUS_FRAME: usize = codec::DECODE_LIMIT;
